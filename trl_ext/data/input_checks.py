"""Refuse a dataset TRL cannot train on, with one line that says what is wrong and how to fix it.

The verdict is TRL's own: a dataset is refused only when TRL's dataset preparation (the trainer's
``_prepare_dataset``) fails on it, leaves it without token ids, or leaves no token to train on. Whatever TRL trains on
is accepted, so a format TRL learns (ShareGPT ``conversations``, a new column convention) needs no change here. What
these checks add is the message and the timing:

- before TRL's constructor loads the model, TRL's preparation runs on the first ``PROBE_ROWS`` rows of each dataset
  (``probe_datasets``); a failure there is refused at once;
- a later row that fails inside TRL's preparation of the whole dataset (``prepare_or_explain``) is refused too;
- either way the message names the row and says what is wrong with it in plain words (``'messages' has a message
  from 'assistant' without content``) instead of TRL's ``UndefinedError: 'dict object' has no attribute 'content'``,
  ``KeyError: 'rejected'``, ``IndexError: list index out of range`` or, for rows TRL prepares into nothing, a failure
  at the first training step.

Rows that ``max_length`` leaves nothing to learn from are checked here as well.

Each dataset is checked once per run: a check that passed is remembered under the dataset's fingerprint (stable
across processes) and what the check read, in this process and, through ``CHECKED_ENV``, in the processes a recipe
launches, so the recipe's first process, every rank and every trainer do not scan the same rows again.
"""

import contextlib
import copy
import inspect
import os
import sys
import traceback
from collections.abc import Callable

from trl_ext import patches
from trl_ext.errors import DatasetError
from trl_ext.process.notices import notice

PROBE_ROWS = 16  # rows prepared by TRL before the model is loaded; the rest are checked as TRL prepares them
# What to tell the user a trainer reads when TRL cannot find its columns (TRL's dataset formats). Only the message
# uses this: whether a dataset is refused is TRL's decision.
FORMATS = {
    "sft": [("messages",), ("prompt", "completion"), ("text",), ("conversations",)],
    "preference": [("chosen", "rejected")],
    "unpaired_preference": [("prompt", "completion", "label"), ("chosen", "rejected")],  # KTO unpairs the second
}
CONVERSATION_COLUMNS = ("messages", "conversations")  # always a list of messages, never plain text
FIX = "fix those rows or filter them out (dataset.filter) before training"
CHECKED_ENV = "TRL_EXT_CHECKED_DATASETS"  # checks passed in the launching process, handed to the launched ranks
# The config fields a check's key holds: those whose names say they can change how TRL prepares rows (max_length,
# packing, dataset_text_field, assistant_only_loss, eos_token, truncation_mode, ...). Launch settings that differ
# between a recipe's processes (ddp_backend, model_init_kwargs, output_dir) stay out, or every rank would re-check.
_DATA_FIELD_WORDS = ("dataset", "length", "packing", "padding", "token", "loss", "truncation", "template",
                     "completion", "prompt", "tools")


# ---------------------------------------------------------------- TRL's verdict


def _raised_in_rows(exc: BaseException) -> bool:
    """True for an error raised while ``datasets`` ran one of TRL's per-row functions (``map``/``filter``): a row TRL
    cannot prepare. Errors that TRL raises about its arguments (packing without ``max_length``, ...) are not."""
    return any(frame.f_code.co_name in ("map", "filter") and f"{os.sep}datasets{os.sep}" in frame.f_code.co_filename
               for frame, _ in traceback.walk_tb(exc.__traceback__))


def _in_memory(dataset, indices):
    """Rows ``indices`` of ``dataset`` as an in-memory dataset with the same features, so that preparing it writes no
    cache files next to the user's dataset."""
    return dataset.select(indices).flatten_indices(keep_in_memory=True)


class _QuietDatasets:
    """No progress bars while the checks run TRL's preparation on a few rows (TRL's own run shows them)."""

    def __enter__(self):
        import datasets

        self.was_disabled = datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()

    def __exit__(self, *exc):
        import datasets

        if not self.was_disabled:
            datasets.enable_progress_bars()


def _first_failing_row(prepare: Callable, dataset) -> int | None:
    """The first row TRL's preparation fails on, found by bisection; None if no single row explains the failure.

    Row 0 stays in every subset: TRL detects the dataset's format from its first row.
    """
    def fails(indices) -> bool:
        try:
            prepare(_in_memory(dataset, list(indices)))
        except Exception as exc:  # noqa: BLE001 - any error TRL raises on these rows
            return _raised_in_rows(exc)
        return False

    with _QuietDatasets():
        if fails([0]):
            return 0
        lo, hi = 1, len(dataset)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fails([0, *range(lo, mid)]):
                hi = mid
            else:
                lo = mid
        return lo if lo < len(dataset) and fails([0, lo]) else None


def _is_prepared(dataset) -> bool:
    """TRL's preparation always yields token ids (``input_ids``, ``chosen_ids``, ...); without them the first step
    fails ("No columns in the dataset match the model's forward method signature")."""
    return any(column.endswith("_ids") for column in dataset.column_names)


def _has_token_to_learn(dataset) -> bool:
    """Some row has a label the loss counts (the first token is never predicted)."""
    for batch in dataset.select_columns(["labels"]).iter(1000):
        if any(any(label != -100 for label in labels[1:]) for labels in batch["labels"]):
            return True
    return False


def prepare_or_explain(prepare: Callable, dataset, name: str, kind: str, text_field: str = "text",
                       formatting_func: Callable | None = None, rows: int | None = None):
    """Run TRL's dataset preparation; if TRL cannot prepare the rows, raise one line that says why.

    Args:
        prepare: TRL's preparation of a dataset (the trainer's ``_prepare_dataset`` with its other arguments bound).
        dataset: the rows as the user passed them.
        name: the dataset's name in messages (``train_dataset``, ``eval_dataset['test']``).
        kind: a key of ``FORMATS`` (``"sft"``, ``"preference"``, ``"unpaired_preference"``): the formats the
            message suggests.
        text_field: SFT's ``dataset_text_field``.
        formatting_func: SFT's formatting function, if any (the user's function then decides which columns matter).
        rows: prepare only the first ``rows`` rows (the early check); None for the whole dataset (TRL's own run, where
            a training set with no token to train on is refused too).

    Returns:
        What ``prepare`` returned.

    Raises:
        DatasetError: a row TRL's preparation fails on, a dataset TRL prepares into nothing (no token ids), or a whole
            training set of which no row has a token to train on.
    """
    from datasets import Dataset
    from transformers import Trainer

    is_dataset = isinstance(dataset, Dataset)
    target = _in_memory(dataset, range(min(rows, len(dataset)))) if is_dataset and rows is not None else dataset
    try:
        prepared = prepare(target)
    except Exception as exc:
        if (not (is_dataset and len(dataset) and _raised_in_rows(exc))
                or isinstance(getattr(exc, "obj", None), Trainer)):  # TRL's message about its arguments, or its bug
            raise
        raise DatasetError(_explain(dataset, name, kind, text_field, formatting_func, exc,
                                    lambda: _first_failing_row(prepare, target))) from exc
    if not (is_dataset and isinstance(prepared, Dataset)):
        return prepared  # streamed rows are prepared lazily: TRL reports them as it reads them
    if not _is_prepared(prepared):
        raise DatasetError(_explain(dataset, name, kind, text_field, formatting_func, None, None))
    if (rows is None and name == "train_dataset" and len(prepared) and "labels" in prepared.column_names
            and not _has_token_to_learn(prepared)):
        raise DatasetError(f"{name}: none of its {len(prepared)} rows has a token to train on once TRL has prepared "
                           "it (empty texts or completions, or everything masked out), so training would run on "
                           "nothing at loss 0; fix the rows or the masking options (assistant_only_loss, "
                           "completion_only_loss)")
    return prepared


def dataset_display_name(trl_name: str) -> str:
    """TRL's name for a dataset it prepares ("train", "eval", an eval dict key) as the user knows it."""
    if trl_name == "train":
        return "train_dataset"
    return "eval_dataset" if trl_name == "eval" else f"eval_dataset['{trl_name}']"


# ---------------------------------------------------------------- what is wrong, in plain words


def _message_problem(message, column: str) -> str | None:
    if not isinstance(message, dict):
        return f"has a message that is not a dict ({str(message)[:60]})"
    role, content = ("from", "value") if column == "conversations" else ("role", "content")
    if not isinstance(message.get(role), str) or content not in message:
        return f"has a message without '{role}' and '{content}' ({str(message)[:60]})"
    if message[content] is None and not message.get("tool_calls"):  # Arrow fills a missing key with None
        return f"has a message from '{message[role]}' without {content}"
    return None


def _problem(value, column: str) -> str | None:
    """What is wrong with one field, as text or as a conversation (a list of messages); None when nothing is."""
    if column == "label":  # KTO: whether the completion is desirable
        return None if isinstance(value, bool) else f"is {repr(value)[:40]}, expected True or False"
    if isinstance(value, str):
        return "is text, expected a list of {'role', 'content'} messages" if column in CONVERSATION_COLUMNS else None
    if isinstance(value, list):
        if not value:
            return "is an empty conversation"
        return next((p for p in (_message_problem(m, column) for m in value) if p), None)
    if value is None:
        return "is missing (None)"
    return (f"has type {type(value).__name__} ({repr(value)[:40]}), expected text or a list of "
            "{'role', 'content'} messages")


def _needed_columns(columns, kind: str, text_field: str):
    options = [tuple(text_field if c == "text" else c for c in option) for option in FORMATS[kind]]
    needed = next((option for option in options if set(option) <= set(columns)), None)
    if needed is not None and "prompt" in columns and kind == "preference":
        needed = ("prompt", *needed)
    return options, needed


def _describe_rows(dataset, kind: str, text_field: str, formatting_func) -> str | None:
    """Missing columns, or the malformed fields among the columns TRL reads, in one phrase; None if none is found."""
    if formatting_func is not None:
        return None  # the user's function reads whichever columns it wants
    options, needed = _needed_columns(dataset.column_names, kind, text_field)
    if needed is None:
        wanted = " or ".join("+".join(option) for option in options)
        return (f"has columns {dataset.column_names}, but this trainer needs {wanted}: rename the columns "
                "(dataset.rename_column) or map the rows to one of TRL's dataset formats")
    bad, first = 0, None
    for start, batch in zip(range(0, len(dataset), 1000), dataset.select_columns(list(needed)).iter(1000)):
        for column in needed:
            for offset, value in enumerate(batch[column]):
                problem = _problem(value, column)
                if problem:
                    bad += 1
                    first = first or f"row {start + offset}: '{column}' {problem}"
    return f"{bad} bad field(s) in {len(dataset)} rows, first at {first}; {FIX}" if bad else None


def _explain(dataset, name, kind, text_field, formatting_func, exc, locate) -> str:
    """The message for a dataset TRL cannot prepare: what is wrong with its rows if we can tell, else the row TRL
    fails on (``locate()``) and TRL's error."""
    described = _describe_rows(dataset, kind, text_field, formatting_func)
    if described:
        return f"{name} {described}" if described.startswith("has columns") else f"{name}: {described}"
    if exc is None:
        return (f"{name}: TRL's preparation left no token ids in it (columns {dataset.column_names}); map the rows "
                "to one of TRL's dataset formats")
    row = locate()
    error = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
    where = f"row {row}" if row is not None else f"its rows (columns {dataset.column_names})"
    return f"{name}: TRL cannot prepare {where} ({error}); {FIX}"


# ---------------------------------------------------------------- each dataset checked once per run


def check_key(check: str, dataset, *inputs) -> str | None:
    """A key for one check of one dataset: its fingerprint and everything else the check reads, hashed.

    Args:
        check: the check's name.
        dataset: a ``datasets.Dataset``.
        inputs: what else decides the check's outcome (configs, tokenizer names, functions), hashable by datasets.

    Returns:
        The key, or None for data without a fingerprint (those are checked every time).
    """
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint is None:
        return None
    from datasets.fingerprint import Hasher

    return f"{check}-{Hasher.hash((fingerprint, inputs))}"


def _passed() -> set[str]:
    return set(filter(None, os.environ.get(CHECKED_ENV, "").split(",")))


def already_passed(key: str | None) -> bool:
    """Whether this check passed before in this run (this process or the one that launched it)."""
    return key is not None and key in _passed()


def record_passed(key: str | None) -> None:
    """Remember a passed check in the environment: for this process and the processes it launches (they inherit it)."""
    if key is not None:
        os.environ[CHECKED_ENV] = ",".join(sorted(_passed() | {key}))


def _config_fields(args) -> dict:
    import dataclasses

    if not dataclasses.is_dataclass(args):
        return {"args": repr(args)}
    return {f.name: repr(getattr(args, f.name, None)) for f in dataclasses.fields(args)
            if any(word in f.name for word in _DATA_FIELD_WORDS)}


# ---------------------------------------------------------------- the check before the model is loaded


def _processing_class(model, args, processing_class):
    """The tokenizer TRL would prepare the rows with: the one given, else the model's (loaded as TRL loads it).
    None where the check cannot stand in for TRL (a multimodal processor, a tokenizer that does not load here)."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase

    if processing_class is None:
        name = model if isinstance(model, (str, os.PathLike)) else getattr(getattr(model, "config", None),
                                                                          "_name_or_path", None)
        revision = ((getattr(args, "model_init_kwargs", None) or {}).get("revision")
                    if isinstance(model, (str, os.PathLike)) else None)
        try:
            processing_class = AutoProcessor.from_pretrained(
                str(name), revision=revision, trust_remote_code=getattr(args, "trust_remote_code", False))
        except Exception:  # noqa: BLE001 - TRL reports a tokenizer that cannot be loaded, when it loads it
            return None
    return processing_class if isinstance(processing_class, PreTrainedTokenizerBase) else None


def _trl_preparation(trl_cls, tokenizer, args, formatting_func) -> Callable | None:
    """TRL's ``trl_cls._prepare_dataset`` as the trainer will call it, on an instance that holds only what that method
    reads (TRL's constructor would load the model first). None where the result could differ from TRL's own run."""
    if not patches.applies("dataset-preparation-probe"):
        return None  # the TRL release moved _prepare_dataset: TRL decides, in its constructor
    if getattr(args, "chat_template_path", None) or getattr(args, "eos_token", None):
        return None  # TRL changes the tokenizer first
    chat_template = None
    if getattr(args, "assistant_only_loss", False):
        try:
            from trl.chat_template_utils import has_generation_markers
        except ImportError:
            return None
        if not has_generation_markers(tokenizer.chat_template or ""):
            return None  # TRL swaps in a training template of its own
    probe = trl_cls.__new__(trl_cls)  # no __init__: nothing is loaded
    probe.__dict__.update(_tokenizer=tokenizer, chat_template=chat_template, completion_only_loss=False)
    # KTO's preparation also reads the class weights (for its balance warning) and whether to add the KL rows
    # (completions shifted between rows: nothing a row can get wrong, so not built here).
    probe.__dict__.update({name: getattr(args, name) for name in ("desirable_weight", "undesirable_weight")
                           if hasattr(args, name)}, calculate_KL=False)
    probe_args = copy.copy(args)
    probe_args.dataset_num_proc = None  # a few rows: no worker processes
    parameters = inspect.signature(trl_cls._prepare_dataset).parameters
    given = {"processing_class": tokenizer, "args": probe_args, "packing": False, "formatting_func": formatting_func}
    kwargs = {k: v for k, v in given.items() if k in parameters}

    def prepare(dataset):
        # TRL's preparation holds every rank at a barrier (global_then_local_main_first); the probe is local, and a
        # probe that ends early on one rank must not leave the others waiting there.
        with patches.swapped("dataset-preparation-probe", sys.modules[trl_cls.__module__],
                             "global_then_local_main_first", contextlib.nullcontext):
            return trl_cls._prepare_dataset(probe, dataset, dataset_name="probe", **kwargs)

    return prepare


def probe_datasets(trl_cls, datasets: dict, args, model=None, processing_class=None, formatting_func=None,
                   kind: str = "sft") -> None:
    """Before TRL's constructor: run TRL's own preparation on the first ``PROBE_ROWS`` rows of each dataset.

    A dataset whose first rows TRL cannot prepare is refused here, in one line, before the model is loaded. Where this
    check cannot reproduce what TRL's constructor will do (a multimodal dataset or processor, streamed rows, a chat
    template TRL replaces, a tokenizer that does not load) it stays silent and TRL decides.

    Args:
        trl_cls: TRL's trainer class (``trl.SFTTrainer``, ...), whose ``_prepare_dataset`` decides.
        datasets: ``{name: dataset}``, ``None`` values allowed.
        args: the trainer's config, as TRL will use it.
        model: the ``model`` argument (an id, a path or a model), for the tokenizer when none is given.
        processing_class: the ``processing_class`` argument.
        formatting_func: SFT's ``formatting_func``.
        kind: a key of ``FORMATS``, for the message.

    Raises:
        DatasetError: TRL cannot prepare one of the first rows of a dataset.
    """
    from datasets import Dataset

    datasets = {n: d for n, d in datasets.items() if isinstance(d, Dataset) and len(d)}
    if kind == "unpaired_preference":
        for name, dataset in datasets.items():
            _check_labels(dataset, name)
    if not datasets or (getattr(args, "dataset_kwargs", None) or {}).get("skip_prepare_dataset"):
        return
    if any({"image", "images"} & set(d.column_names) for d in datasets.values()):
        return  # TRL prepares multimodal rows on the fly, in its collator
    tokenizer = _processing_class(model, args, processing_class)
    prepare = _trl_preparation(trl_cls, tokenizer, args, formatting_func) if tokenizer is not None else None
    if prepare is None:
        return
    inputs = (trl_cls.__name__, kind, tokenizer.name_or_path, tokenizer.chat_template, _config_fields(args),
              formatting_func)
    with _QuietDatasets():
        for name, dataset in datasets.items():
            key = check_key("probe", dataset, *inputs)
            if already_passed(key):
                continue
            try:
                prepare_or_explain(prepare, dataset, name, kind, getattr(args, "dataset_text_field", "text"),
                                   formatting_func, rows=PROBE_ROWS)
            except DatasetError:
                raise
            except Exception:  # noqa: BLE001 - about the arguments, or this TRL needs more than the stand-in holds
                return  # TRL's constructor raises it with its own message, or trains
            record_passed(key)


def _check_labels(dataset, name: str) -> None:
    """KTO's ``label`` column: TRL prepares any value and fails only when it batches one that is not a bool, mid-run."""
    if "label" not in dataset.column_names:
        return  # paired rows: TRL unpairs them
    problems = [(row, p) for row, value in enumerate(dataset["label"]) if (p := _problem(value, "label"))]
    if problems:
        row, problem = problems[0]
        raise DatasetError(f"{name}: {len(problems)} bad field(s) in {len(dataset)} rows, first at row {row}: 'label' "
                           f"{problem}; {FIX}")


# ---------------------------------------------------------------- after TRL's preparation


def check_rows_kept(before, after, name: str, max_length) -> None:
    """TRL drops rows that ``max_length`` leaves nothing to learn from; say so, and refuse if none are left.

    Args:
        before: the dataset as passed to the trainer.
        after: the dataset TRL prepared from it.
        name: the dataset's name in messages.
        max_length: the config's ``max_length``.

    Raises:
        DatasetError: every row was dropped.
    """
    if not (hasattr(before, "__len__") and hasattr(after, "__len__")) or len(after) >= len(before):
        return
    dropped = len(before) - len(after)
    fix = f"raise max_length (now {max_length}) or shorten those rows"
    if len(after) == 0:
        raise DatasetError(f"{name}: all {dropped} rows are too long for max_length={max_length} (nothing to train "
                           f"on is left after truncation); {fix}")
    notice(f"{name}: {dropped} of {len(before)} rows were dropped as too long for max_length={max_length}; {fix}.")
