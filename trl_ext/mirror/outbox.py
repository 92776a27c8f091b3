"""A mirror's outbox: the uploads not done yet, kept in the output directory as hard links (``.trl_ext-mirror/<name>``,
one folder per upload, described by its ``job.json``), so that local rotation (``save_total_limit``) cannot remove a
queued checkpoint's files, and a crash leaves what the next run on the machine uploads (``pending``).

The words are ``trl_ext.mirror``'s glossary's.
"""

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

DIR = ".trl_ext-mirror"  # in output_dir: one folder of hard links per upload not done yet
JOB_FILE = "job.json"


@dataclass
class Upload:
    """One upload: a committed ``checkpoint-N`` or a saved model, hard-linked under ``folder``.

    Args:
        rel: the remote folder, relative to the mirror (``checkpoint-20``; ``""`` for a model saved in output_dir).
        step: the checkpoint's step (None for a model).
        folder: its folder in the outbox, of hard links.
    """

    rel: str
    step: int | None
    folder: str
    sent: dict[str, tuple[int, str]] = field(default_factory=dict)  # file -> (size, checksum), in the store already

    @property
    def name(self) -> str:
        return self.rel or "the model"

    def files(self) -> list[str]:
        root = Path(self.folder)
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != JOB_FILE)


def put(source: Path, folder: Path, rel: str, step: int | None, top_files_only: bool = False) -> Upload:
    """Hard-link the files of ``source`` (a committed checkpoint, or a saved model: ``top_files_only``, the regular
    files at its top) into the outbox's ``folder``; copied where the file system has no hard links.

    Args:
        source: the committed checkpoint or saved model.
        folder: its folder in the outbox (replaced if there).
        rel: the remote folder (see ``Upload``).
        step: the checkpoint's step (None for a model).
        top_files_only: only the regular files at the top of ``source`` (a model saved in output_dir).

    Returns:
        The ``Upload``, described in ``folder/job.json`` too (so that a later run can finish it).
    """
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    paths = ([p for p in source.iterdir() if p.is_file() and not p.name.startswith(".")] if top_files_only
             else [p for p in source.rglob("*") if p.is_file()])
    for path in paths:
        target = folder / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:  # no hard links here (some network file systems): a copy, slower but as safe
            shutil.copy2(path, target)
    job = Upload(rel, step, str(folder))
    (folder / JOB_FILE).write_text(json.dumps({"rel": rel, "step": step, "folder": str(folder)}))
    return job


def pending(root: Path) -> list[Upload]:
    """The uploads an earlier run on this machine left in the outbox ``root``, oldest checkpoint first, models last.

    Args:
        root: ``<output_dir>/.trl_ext-mirror``.

    Returns:
        Their jobs (an unreadable description is removed with its folder).
    """
    jobs = []
    for path in sorted(root.glob(f"*/{JOB_FILE}")) if root.is_dir() else []:
        try:
            raw = json.loads(path.read_text())
            jobs.append(Upload(raw["rel"], raw["step"], str(path.parent)))
        except (OSError, ValueError, KeyError):
            shutil.rmtree(path.parent, ignore_errors=True)
    return sorted(jobs, key=lambda j: (j.step is None, j.step or 0))
