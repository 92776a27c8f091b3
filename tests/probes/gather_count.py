"""Parameter elements all-gathered per optimizer step, counted where each engine gathers: ZeRO-3's parameter
coordinator (the partitions it fetches) and FSDP2's unshard (each unit's all-gather). A count, not a timing: the same
run gives the same numbers, so tests can compare them (tests/scripts/train.py and
bench/_gradient_checkpointing_worker.py).
"""

import functools

import torch
from transformers import TrainerCallback

_counting: list = []  # the GatherCount of the run in progress (a process may train several runs one after another)


def _add(numel: int) -> None:
    if _counting:
        _counting[-1].add(numel)


@functools.cache
def _install() -> None:
    """Wrap each engine's gather once per process."""
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC

        name = "_PartitionedParameterCoordinator__all_gather_params"
        zero3_gather = getattr(PPC, name)

        def zero3_counted(coordinator, params, forward):
            _add(sum(p.ds_numel for p in params if p.ds_status.name == "NOT_AVAILABLE"))
            return zero3_gather(coordinator, params, forward)

        setattr(PPC, name, zero3_counted)
    except ImportError:
        pass
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    fsdp2_gather = _fsdp_param_group.foreach_all_gather

    def fsdp2_counted(*args, **kwargs):
        result = fsdp2_gather(*args, **kwargs)
        if result is not None:
            _add(result.all_gather_output.numel())
        return result

    _fsdp_param_group.foreach_all_gather = fsdp2_counted


class GatherCount(TrainerCallback):
    """Counts the elements all-gathered in each optimizer step (``per_step``) and, in total, in each phase
    (``per_phase[name]``, where ``phase`` is whatever the caller last set)."""

    def __init__(self):
        self.per_step, self.current, self.phase, self.per_phase = [], 0, "step", {}
        _install()
        _counting[:] = [self]

    def add(self, numel: int) -> None:
        self.current += numel
        self.per_phase[self.phase] = self.per_phase.get(self.phase, 0) + numel

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self.current)
        self.current = 0



def model_numel(model: torch.nn.Module) -> int:
    """Every parameter's full element count (ZeRO-3 and FSDP2 hold only parts of them)."""
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())
