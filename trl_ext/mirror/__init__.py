"""Checkpoints that outlive the machine: every committed checkpoint and the final model uploaded to object storage
(``checkpoint_mirror``, any fsspec URL) in the background, checked against a manifest written last, and a fresh
machine resuming from it.

``options`` (the URL and storage options, secrets kept out of configs), ``store`` (the store and the refusals before
training), ``manifest`` (each file's size and checksum), ``lease`` (one run per mirror), ``uploader`` (the thread),
``downloader`` (a checkpoint brought back and checked), ``verify`` (``trl-ext verify URL``), and ``mirror`` (the
trainer's one object).
"""

from trl_ext.mirror.mirror import Mirror, check

__all__ = ["Mirror", "check"]
