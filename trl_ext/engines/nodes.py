"""Several nodes: is ``output_dir`` shared between them, and so which ranks write checkpoints.

Every answer here is decided once for all ranks (each rank looks, then one verdict everywhere): ranks that
look at the files on their own can disagree (NFS attribute caching, node-local disks) and then take different
collective paths, which hangs the job (KempnerForge#49).
"""

import os
import uuid
from dataclasses import dataclass

from trl_ext.errors import ConfigError


@dataclass(frozen=True)
class Storage:
    """Where checkpoints of this run live."""

    multi_node: bool
    shared: bool  # every node sees the same output_dir

    def checkpoint_writer(self, args) -> bool:
        """Whether this rank creates and renames the partial checkpoint directory: one rank per copy of output_dir."""
        if self.shared:
            return args.process_index == 0  # save_on_each_node on shared storage would race on the rename
        return args.should_save


def detect(args, local_world_size: int | None = None) -> Storage:
    """Find out whether every node sees ``args.output_dir``: rank 0 writes a marker file, every rank looks for it.

    Collective: every rank calls it. With one node, nothing is looked at.

    Args:
        args: the run's ``TrainingArguments``.
        local_world_size: the processes on this machine, as the launcher said (default: ``args.world_size``, one
            machine).

    Returns:
        The storage, the same on every rank.
    """
    from trl_ext.process.collectives import decided_on_rank0, from_every_rank

    if args.world_size <= 1 or (local_world_size or args.world_size) >= args.world_size:
        return Storage(multi_node=False, shared=True)

    def write_marker() -> str:
        os.makedirs(args.output_dir, exist_ok=True)
        marker = os.path.join(args.output_dir, f".trl_ext-shared-{uuid.uuid4().hex}")
        with open(marker, "w"):
            pass
        return marker

    marker = decided_on_rank0(write_marker)
    seen = from_every_rank(os.path.exists(marker))  # a collective: every rank has looked once it returns
    if args.process_index == 0:
        os.remove(marker)
    return Storage(multi_node=True, shared=all(seen))


def check(storage: Storage, args) -> None:
    """Refuse, before training, a checkpoint layout that would leave no node with a whole checkpoint.

    Args:
        storage: from ``detect``.
        args: the run's ``TrainingArguments``.
    """
    if storage.multi_node and not storage.shared and not args.save_on_each_node and args.save_strategy != "no":
        raise ConfigError(
            f"output_dir {args.output_dir} is not shared between the nodes (each node sees its own): checkpoints "
            f"would be split across nodes and none could resume; set save_on_each_node=True (--save_on_each_node "
            f"true), or put output_dir on storage that every node shares.")
