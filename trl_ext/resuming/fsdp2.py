"""Resume from a ``checkpoint-N`` on another number of processes, FSDP2 or one process: weights from the Hub-format
files trl_ext wrote (each FSDP2 rank reads its own rows), optimizer states across the two layouts.

An FSDP2 checkpoint keeps its optimizer states sharded (DCP, ``optimizer_0/``): FSDP2 on any number of processes
reads them through DCP, which reshards on load. One process (no FSDP) writes and reads the Trainer's whole
``optimizer.pt``. Between the two, the states are converted here, keyed by parameter name, and set through torch's
``set_optimizer_state_dict``, which places each rank's rows.
"""

import os
import tempfile
from pathlib import Path

import torch

from trl_ext.engines import sharded
from trl_ext.errors import ResumeError
from trl_ext.files.reader import SafetensorsReader, checkpoint_files
from trl_ext.saving import save_plan


def load_checkpoint_weights(model, checkpoint: str) -> None:
    """Load weights saved by trl_ext (adapters, or a full model in the Hub's layout) into an FSDP2-sharded model.

    Each rank reads only its own rows of each tensor from the safetensors files (memory-mapped), so no rank ever
    holds the whole model. A full model whose Hub layout differs from memory (fused MoE experts, say) is converted
    by ``from_pretrained`` instead, on CPU in every rank.

    Args:
        model: the model being trained, sharded by FSDP2 (a PEFT model or a transformers model).
        checkpoint: a ``checkpoint-N`` directory written by trl_ext.

    Raises:
        ResumeError: a tensor the model trains is not in the checkpoint.
    """
    import torch.distributed as dist

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    for weight_set in save_plan.plan_weight_sets(model):
        directory = Path(checkpoint) / weight_set.subdir
        if any(unit.converted for unit in weight_set.units):
            _load_converted(model, directory)
            continue
        reader = SafetensorsReader(checkpoint_files(directory))  # positioned reads: only this rank's rows
        try:
            with torch.no_grad():
                for unit in weight_set.units:
                    _load_own_rows(reader, unit.outputs[0].name, unit.sources[0][1], world, rank, directory)
        finally:
            reader.close()


def _load_own_rows(reader: SafetensorsReader, name: str, live, world: int, rank: int, directory: Path) -> None:
    if name not in reader:
        raise ResumeError(f"{directory} has no tensor {name}, which this model trains: resume with the model and "
                          "adapter that saved it.")
    rows = sharded.dtensor_rows(live, world, rank) if sharded.is_dtensor(live) else slice(None)
    if rows is None:  # another placement: distribute the whole tensor as the model places it
        from torch.distributed.tensor import distribute_tensor

        whole = reader.read(name).to(live.dtype)
        live.to_local().copy_(distribute_tensor(whole, live.device_mesh, live.placements).to_local())
        return
    target = live.to_local() if sharded.is_dtensor(live) else live.data
    if rows == slice(None):
        target.copy_(reader.read(name).to(target.dtype))
    else:
        target.copy_(reader.read_rows(name, rows.start, rows.stop).to(target.dtype).view(target.shape))


def _load_converted(model, directory: Path) -> None:
    from torch.distributed.tensor import distribute_tensor

    loaded = type(model).from_pretrained(str(directory), dtype=model.dtype, config=model.config).state_dict()
    with torch.no_grad():
        for name, live in sharded.state_tensors(model).items():
            whole = loaded[name].to(live.dtype)
            if sharded.is_dtensor(live):
                live.to_local().copy_(distribute_tensor(whole, live.device_mesh, live.placements).to_local())
            else:
                live.data.copy_(whole)


SHARDED_OPTIMIZER = "optimizer_0"  # accelerate's DCP folder (OPTIMIZER_NAME + "_0")
WHOLE_OPTIMIZER = "optimizer.pt"  # the Trainer's file


def needs_conversion(checkpoint: str, sharded_run: bool) -> bool:
    """Whether ``checkpoint``'s optimizer states are in the other layout than this run reads (FSDP2: sharded)."""
    folder = Path(checkpoint)
    has_sharded, has_whole = (folder / SHARDED_OPTIMIZER).is_dir(), (folder / WHOLE_OPTIMIZER).is_file()
    return (has_whole and not has_sharded) if sharded_run else (has_sharded and not has_whole)


def _by_name(model, optimizer, whole: dict) -> dict:
    """The Trainer's ``optimizer.pt`` (states keyed by position) keyed by parameter name, as torch's
    ``set_optimizer_state_dict`` takes it. Positions follow the optimizer's groups, which the resumed Trainer builds
    from the same named parameters in the same order."""
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = [i for group in whole["param_groups"] for i in group["params"]]
    if len(saved) != len(ordered):
        raise ResumeError(f"the checkpoint's optimizer holds {len(saved)} parameters, this model trains "
                         f"{len(ordered)}: resume with the same model, adapter and trainable parameters.")
    name_of = dict(zip(saved, ordered, strict=True))
    groups = [{**g, "params": [name_of[i] for i in g["params"]]} for g in whole["param_groups"]]
    return {"state": {name_of[i]: state for i, state in whole["state"].items()}, "param_groups": groups}


def load_optimizer_converted(model, optimizer, checkpoint: str, sharded_run: bool) -> None:
    """Load ``checkpoint``'s optimizer states written in the other layout (see the module docstring).

    Args:
        model: the model being trained (FSDP2-sharded when ``sharded_run``).
        optimizer: its torch optimizer (not accelerate's wrapper).
        checkpoint: the ``checkpoint-N`` directory.
        sharded_run: whether this run is FSDP2 (states to shard) or one process (states to gather).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    folder = Path(checkpoint)
    if sharded_run:  # the whole states, on every rank (each keeps its rows); adapters' states are small
        whole = torch.load(folder / WHOLE_OPTIMIZER, map_location="cpu", weights_only=True)
        state = _by_name(model, optimizer, whole)
    else:  # DCP's shards read whole in this process (no process group), then set by name
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(folder / SHARDED_OPTIMIZER), os.path.join(tmp, "optimizer.pt"))
            state = torch.load(os.path.join(tmp, "optimizer.pt"), map_location="cpu", weights_only=False)["optimizer"]
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
