"""Resume an FSDP2 run from a ``checkpoint-N`` that trl_ext wrote in the Hub's layout: each rank reads its own rows."""

from pathlib import Path

import torch

from trl_ext.saving import gather
from trl_ext.saving import plan as save_plan


def load_checkpoint_weights(model, checkpoint: str) -> None:
    """Load weights saved by trl_ext (adapters, or a full model in the Hub's layout) into an FSDP2-sharded model.

    Each rank reads only its own rows of each tensor from the safetensors files (memory-mapped), so no rank ever
    holds the whole model. A full model whose Hub layout differs from memory (fused MoE experts, say) is converted
    by ``from_pretrained`` instead, on CPU in every rank.

    Args:
        model: the model being trained, sharded by FSDP2 (a PEFT model or a transformers model).
        checkpoint: a ``checkpoint-N`` directory written by trl_ext.

    Raises:
        KeyError: a tensor the model needs is missing from the checkpoint.
    """
    import torch.distributed as dist
    from safetensors import safe_open

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    for weight_set in save_plan.plan_weight_sets(model):
        directory = Path(checkpoint) / weight_set.subdir
        if any(unit.converted for unit in weight_set.units):
            _load_converted(model, directory)
            continue
        files = {name: directory / file for file, specs in weight_set.plan.items() for name in
                 (s.name for s in specs)}
        handles = {}
        with torch.no_grad():
            for unit in weight_set.units:
                name, live = unit.outputs[0].name, unit.sources[0][1]
                path = files[name]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt", device="cpu")
                rows = gather.dtensor_rows(live, world, rank) if gather.is_dtensor(live) else slice(None)
                if rows is None:  # another placement: distribute the whole tensor as the model places it
                    from torch.distributed.tensor import distribute_tensor

                    whole = handles[path].get_tensor(name).to(live.dtype)
                    live.to_local().copy_(distribute_tensor(whole, live.device_mesh, live.placements).to_local())
                    continue
                target = live.to_local() if gather.is_dtensor(live) else live.data
                target.copy_(handles[path].get_slice(name)[rows].to(target.dtype))


def _load_converted(model, directory: Path) -> None:
    from torch.distributed.tensor import distribute_tensor

    loaded = type(model).from_pretrained(str(directory), dtype=model.dtype, config=model.config).state_dict()
    with torch.no_grad():
        for name, live in gather.state_tensors(model).items():
            whole = loaded[name].to(live.dtype)
            if gather.is_dtensor(live):
                live.to_local().copy_(distribute_tensor(whole, live.device_mesh, live.placements).to_local())
            else:
                live.data.copy_(whole)
