"""Saving: plan -> gather (ZeRO-3 partitions, FSDP2 shards) -> write -> check -> agree -> commit, on the files layer
(``trl_ext.files``); a trainer's checkpoints, in the foreground or in the background, from the save to retention
(``checkpoints``).

``save(model, dir)`` is the one save path (``pipeline``); nothing else writes checkpoints.
"""

from trl_ext.saving.pipeline import DEFAULT_MAX_SHARD_SIZE, save, supports

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "save", "supports"]
