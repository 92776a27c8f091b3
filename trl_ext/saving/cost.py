"""What one checkpoint cost training, as one record (``Cost``), logged as training metrics (``checkpoint/*``)."""

from dataclasses import astuple, dataclass, fields

import torch

from trl_ext.process.collectives import max_over_ranks

PREFIX = "checkpoint/"  # the metrics' names: checkpoint/held_s, checkpoint/held_save_s, ...
MEMORY_PREFIX = "memory_checkpoint/"  # the same of a memory checkpoint (memory_checkpoint_steps)


@dataclass
class Cost:
    """One checkpoint's cost on one rank (or, from ``slowest``, each field's largest over the ranks).

    Args:
        held_save_s: how long the training thread was held inside ``_save_checkpoint``.
        held_copy_wait_s: how long it waited for the checkpoint's copies before the next optimizer step (on a GPU, the
            compute stream's wait included).
        held_previous_s: how long it waited for the previous checkpoint to be committed.
        write_s: the checkpoint's files written, synced, checked and committed (in the background: while training went
            on).
        bytes: the committed directory (its writer; 0 on the other ranks).
    """

    held_save_s: float = 0.0
    held_copy_wait_s: float = 0.0
    held_previous_s: float = 0.0
    write_s: float = 0.0
    bytes: int = 0

    @property
    def held_s(self) -> float:
        """How long the training thread was held for the checkpoint in all."""
        return self.held_save_s + self.held_copy_wait_s + self.held_previous_s

    def metrics(self, prefix: str = PREFIX) -> dict[str, float]:
        """The record as training metrics: ``checkpoint/held_s`` (or ``prefix``'s) and each field, times rounded to
        0.1 ms."""
        times = {"held_s": self.held_s, **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "bytes"}}
        return {**{prefix + name: round(value, 4) for name, value in times.items()}, prefix + "bytes": self.bytes}

    def slowest(self, device: torch.device) -> "Cost":
        """Each field's largest value over the ranks; on every rank at the same point (a collective when distributed).

        Args:
            device: where the all-reduce's tensor lives (the training arguments' device).

        Returns:
            The record of the slowest rank's parts.
        """
        *times, nbytes = max_over_ranks([float(v) for v in astuple(self)], device)
        return Cost(*times, bytes=int(nbytes))
