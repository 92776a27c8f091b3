"""The checkpoint a run resumes from, audited before anything loads (``files.audit``, what ``trl-ext verify`` runs)."""

from pathlib import Path

from trl_ext.errors import ResumeError
from trl_ext.files.audit import ADAPTER_WEIGHTS, FULL_INDEX, FULL_WEIGHTS, audit


def check_resume_checkpoint(path: str, num_labels: int = 1) -> None:
    """The checkpoint a run resumes from must pass the ``trl-ext verify`` audit: a truncated or corrupted weights file
    fails here, in one line naming it, instead of deep inside a loader (or worse, after optimizer states loaded).

    Args:
        path: the ``checkpoint-N`` directory.
        num_labels: the outputs a reward or classification head must have.

    Raises:
        ResumeError: the audit found problems; it names them and the checkpoint to resume instead.
    """
    root = Path(path)
    if root.is_dir() and not any((root / name).exists() for name in (ADAPTER_WEIGHTS, FULL_WEIGHTS, FULL_INDEX)):
        return  # weights in another format (.bin, FSDP shards): Trainer's own loader checks those
    report = audit(path, num_labels=num_labels)
    if not report.ok:
        earlier = sorted((p for p in Path(path).parent.glob("checkpoint-*") if p.name != Path(path).name
                          and p.name.split("-")[-1].isdigit()), key=lambda p: int(p.name.split("-")[-1]))
        hint = f"--resume_from_checkpoint {earlier[-1]}" if earlier else "a new run"
        raise ResumeError(f"cannot resume from {path}: {'; '.join(report.problems)}. Nothing was changed; "
                          f"resume from an earlier checkpoint ({hint}) or start a new run.")
