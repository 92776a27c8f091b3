"""Refuse bad input before TRL touches it, with one line that says what is wrong and how to fix it.

Without these checks a malformed row surfaces deep inside TRL's dataset preparation (``KeyError: 'rejected'``,
``'int' object has no attribute 'endswith'``, a Jinja ``UndefinedError``), an empty sample trains silently on
nothing, rows longer than ``max_length`` are dropped without a word (all of them: ``num_samples=0`` at train
time), and a mistyped model path is reported as an invalid Hub repo id.
"""

import os
from pathlib import Path

from .runtime import notice

# The columns each trainer reads, per TRL's dataset formats (conversational or plain text).
REQUIRED = {
    "sft": [("messages",), ("prompt", "completion"), ("text",)],
    "preference": [("chosen", "rejected")],
}
FIX = "fix those rows or filter them out (dataset.filter) before training"
TOKENIZED_SUFFIXES = ("input_ids", "_ids")  # already tokenized: TRL skips preparation, and so do we


class DatasetError(ValueError):
    """A training or evaluation dataset that TRL cannot train on."""


def check_model_path(model) -> None:
    """A model given as a local path (absolute, ``./``, ``~``, or deeper than ``namespace/name``) must exist."""
    if not isinstance(model, (str, os.PathLike)):
        return
    name = str(model)
    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
    if looks_local and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"model path '{name}' does not exist: pass an existing model directory or a Hub "
                                "model id (namespace/name)")


def _problem(value, empty_ok: bool, conversation: bool) -> str | None:
    """What is wrong with one field: text, or a conversation (a list of {'role', 'content'} messages)."""
    if isinstance(value, str) and conversation:
        return "is text, expected a list of {'role', 'content'} messages"
    if isinstance(value, str):
        return None if value.strip() or empty_ok else "is empty"
    if isinstance(value, list):
        if not value:
            return "is an empty conversation"
        for message in value:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
                return f"has a message without 'role' and 'content' ({str(message)[:60]})"
            if message["content"] is None:  # Arrow fills a missing key with None
                return f"has a message from '{message['role']}' without content"
            content = message["content"]
            if message["role"] == "assistant" and isinstance(content, str) and not content.strip():
                return "has an empty assistant message"
        return None
    if value is None:
        return "is missing (None)"
    return (f"has type {type(value).__name__} ({repr(value)[:40]}), expected text or a list of "
            "{'role', 'content'} messages")


def check_dataset(dataset, kind: str, name: str, text_field: str = "text") -> None:
    """Every row has the columns ``kind`` ("sft" or "preference") needs, each text or a conversation, none empty.

    Datasets that are already tokenized, streamed (``IterableDataset``) or formatted by a user function are left to
    TRL. Reads the dataset in batches of the needed columns only.
    """
    columns = getattr(dataset, "column_names", None)
    if not columns or not hasattr(dataset, "__len__") or any(c.endswith(TOKENIZED_SUFFIXES) for c in columns):
        return
    options = [tuple(text_field if c == "text" else c for c in option) for option in REQUIRED[kind]]
    needed = next((option for option in options if set(option) <= set(columns)), None)
    if needed is None:
        wanted = " or ".join("+".join(option) for option in options)
        raise DatasetError(f"{name} has columns {columns}, but this trainer needs {wanted}: rename the columns "
                           "(dataset.rename_column) or map the rows to one of TRL's dataset formats")
    if "prompt" in columns and kind == "preference":
        needed = ("prompt", *needed)
    bad, first = 0, None
    for start, batch in zip(range(0, len(dataset), 1000), dataset.select_columns(list(needed)).iter(1000)):
        for column in needed:
            # An empty prompt is legitimate (an implicit prompt); an empty answer or text trains on nothing.
            for offset, value in enumerate(batch[column]):
                problem = _problem(value, empty_ok=column == "prompt", conversation=column == "messages")
                if problem:
                    bad += 1
                    first = first or f"row {start + offset}: '{column}' {problem}"
    if bad:
        raise DatasetError(f"{name}: {bad} bad field(s) in {len(dataset)} rows, first at {first}; {FIX}")


def check_rows_kept(before, after, name: str, max_length) -> None:
    """TRL drops rows that ``max_length`` leaves nothing to learn from; say so, and refuse if none are left."""
    if not (hasattr(before, "__len__") and hasattr(after, "__len__")) or len(after) >= len(before):
        return
    dropped = len(before) - len(after)
    fix = f"raise max_length (now {max_length}) or shorten those rows"
    if len(after) == 0:
        raise DatasetError(f"{name}: all {dropped} rows are too long for max_length={max_length} (nothing to train "
                           f"on is left after truncation); {fix}")
    notice(f"{name}: {dropped} of {len(before)} rows were dropped as too long for max_length={max_length}; {fix}.")


def check_resume_checkpoint(path: str, num_labels: int = 1) -> None:
    """The checkpoint a run resumes from must pass the ``trl-ext verify`` audit: a truncated or corrupted weights file
    fails here, in one line naming it, instead of deep inside a loader (or worse, after optimizer states loaded)."""
    from .verify import ADAPTER_WEIGHTS, FULL_INDEX, FULL_WEIGHTS, CheckpointError, audit

    root = Path(path)
    if root.is_dir() and not any((root / name).exists() for name in (ADAPTER_WEIGHTS, FULL_WEIGHTS, FULL_INDEX)):
        return  # weights in another format (.bin, FSDP shards): Trainer's own loader checks those
    report = audit(path, num_labels=num_labels)
    if not report.ok:
        earlier = sorted((p for p in Path(path).parent.glob("checkpoint-*") if p.name != Path(path).name
                          and p.name.split("-")[-1].isdigit()), key=lambda p: int(p.name.split("-")[-1]))
        hint = f"--resume_from_checkpoint {earlier[-1]}" if earlier else "a new run"
        raise CheckpointError(f"cannot resume from {path}: {'; '.join(report.problems)}. Nothing was changed; "
                              f"resume from an earlier checkpoint ({hint}) or start a new run.")
