"""Merging an adapter into its base: ``merge_adapter`` (``trl-ext merge``: streamed, or in memory where it must be),
``merge_streamed`` and ``merge`` (in memory) directly, and ``iter_merged_weights`` for serving engines."""

from trl_ext.merge.front import merge_adapter
from trl_ext.merge.in_memory import merge
from trl_ext.merge.streamed import merge_streamed
from trl_ext.merge.weights import iter_merged_weights

__all__ = ["iter_merged_weights", "merge", "merge_adapter", "merge_streamed"]
