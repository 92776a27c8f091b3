"""Merging an adapter into its base: ``merge_streamed`` (``trl-ext merge``), ``merge`` in memory, and
``iter_merged_weights`` for serving engines."""

from trl_ext.merge.in_memory import iter_merged_weights, merge
from trl_ext.merge.streamed import merge_streamed

__all__ = ["iter_merged_weights", "merge", "merge_streamed"]
