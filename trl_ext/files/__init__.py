"""Checkpoint files in the Hub's own format, read, written and checked in one place: the safetensors header
(``header``), a lazy reader (``reader``), shard planning and the streaming writer (``shards``), the Hub's tensor names
and layout (``hub_names``), the audit of any checkpoint directory (``audit``, behind ``trl-ext verify``), the
read-back of a save's own files against what was written (``readback``), the atomic commit (``commit``), and an
output directory's ``checkpoint-N`` folders (``checkpoint_dirs``). Its words are saving's glossary
(``trl_ext/saving/__init__.py``).

Saving (``trl_ext.saving``) and merging (``trl_ext.merge``) both stand on this layer; it imports neither.
"""
