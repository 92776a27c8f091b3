"""One save as an object: what each step of the pipeline needs, from the plan to the commit, carried through them in
the foreground or on a background save's thread."""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from trl_ext.files.commit import PARTIAL_SUFFIX, commit

logger = logging.getLogger("trl_ext")


@dataclass(frozen=True)
class Layout:
    """Who writes what, the same on every rank, planned once per model (``pipeline.plan_layout``).

    Args:
        copies: the ranks that write each copy of the checkpoint (one copy, or one per node), each led by its first.
        weight_sets: what is written (``plan.WeightSet``: the adapters, or the full model in the Hub's layout).
        owners: per weight set, per copy, file name -> the rank that writes it.
    """

    copies: list[list[int]]
    weight_sets: list
    owners: list[list[dict[str, int]]]


@dataclass
class SaveJob:
    """One save of ``model`` to ``target``.

    Args:
        model: the model saved (its config and conversions; its tensors are read through ``weight_sets``).
        target: the directory committed at the end.
        layout: who writes what (``Layout``).
        rank: this rank (0 when the save is not collective).
        is_writer: this rank leads its copy: stages it, writes the configuration files, checks and commits it.
        collective: partitioned parameters: every rank takes part in every transfer and agreement.
        processing_class: the tokenizer or processor saved beside the weights (or None).
        training_args: saved as ``training_args.bin`` (or None).
        weight_sets: what the ranks stream: the layout's, with live tensors, or a background save's CPU copies.
        group: the process group of the transfers and agreements (None: the default one).
        commit_with: puts the checked staging directory in place instead of ``files.commit.commit`` (a background
            save's, which can wait to be released).
        started: when the save started (``time.monotonic()``), for its log line.
    """

    model: object
    target: Path
    layout: Layout
    rank: int
    is_writer: bool
    collective: bool
    processing_class: object = None
    training_args: object = None
    weight_sets: list = field(default_factory=list)
    group: object = None
    commit_with: Callable[[Path, Path], None] | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def staging(self) -> Path:
        """Where the files are written and checked before the commit: beside ``target``, hidden."""
        return self.target.with_name(f".{self.target.name}{PARTIAL_SUFFIX}")

    @property
    def mine(self) -> list[int]:
        """The ranks that write this rank's copy of the checkpoint."""
        return next(ranks for ranks in self.layout.copies if self.rank in ranks)

    @property
    def copy_index(self) -> int:
        return self.layout.copies.index(self.mine)

    def commit(self) -> None:
        """The checked staging directory renamed into place, on the copy's first rank (the others: nothing)."""
        if self.is_writer:
            (self.commit_with or commit)(self.staging, self.target)
            logger.info(f"[trl_ext] saved and verified {self.target} in {time.monotonic() - self.started:.1f}s")

    def on(self, weight_sets: list, group=None, commit_with: Callable[[Path, Path], None] | None = None) -> "SaveJob":
        """The same save, streaming ``weight_sets`` (a background save's copies) over ``group``, committed by
        ``commit_with``."""
        return replace(self, weight_sets=weight_sets, group=group, commit_with=commit_with)
