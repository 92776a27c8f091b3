"""Checkpoints that outlive the machine: every committed checkpoint and the final model uploaded to object storage
(``checkpoint_mirror``, any fsspec URL) in the background, checked against a manifest written last, and a fresh
machine resuming from it.

``options`` (the URL and storage options, secrets kept out of configs), ``store`` (the store and the refusals before
training), ``manifest`` (each file's size and checksum), ``lease`` (one run per mirror), ``outbox`` (the uploads not
done yet, on disk), ``uploader`` (the thread), ``downloader`` (a checkpoint brought back and checked), ``verify``
(``trl-ext verify URL``), and ``mirror`` (the trainer's one object).

One word, one meaning (saving's words are in ``trl_ext.saving``'s glossary, and hold here too):

- **mirror**: the prefix in object storage a run's checkpoints and final model go to (``checkpoint_mirror``).
- **store**: that object storage, through fsspec (``store.Store``); its **failures** are what a later attempt may get
  past (connection errors, timeouts, 5xx, throttling: ``store.is_store_failure``), and only they are sent again.
- **upload**: one committed checkpoint or saved model sent to the mirror (an ``outbox.Upload``); **queued** in the
  uploader until it is **complete**: its **manifest** (sizes and checksums) written last.
- **outbox**: where an upload's files wait, hard-linked in the output directory (``.trl_ext-mirror``), until it is
  complete; what a run leaves there, the next run on the output directory uploads.
- **lease**: which run writes the mirror (``lease``).
- **grace period**: how long a stop waits for uploads: ``mirror_grace_period`` after a preemption's signal,
  ``mirror_exit_grace_period`` at a process's exit.
- **partial directory**: as in saving, where a download is written before its commit (never "staging").
"""

__all__ = ["Mirror", "check"]


def __getattr__(name: str):
    # Imported when first asked for: ``mirror`` brings transformers (its callback), which the store, the lease, the
    # uploader and ``trl-ext verify URL`` do without (importing this package took 34 s of a 2-core machine under load)
    if name in __all__:
        from trl_ext.mirror import mirror

        return getattr(mirror, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
