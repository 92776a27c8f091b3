"""A mistyped local model or dataset path, refused in one line before anything loads (transformers and datasets
would first try the Hub: for a dataset, 23 s of retries offline, then "Couldn't reach ... on the Hub")."""

import os
from pathlib import Path

from trl_ext.errors import NotFoundError


def _looks_local(name: str) -> bool:
    """Absolute, ``./``, ``../`` or ``~``, or deeper than a Hub id's ``namespace/name``."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1


def check_model_path(model) -> None:
    """A model given as a local path (absolute, ``./``, ``~``, or deeper than ``namespace/name``) must exist.

    Args:
        model: the ``model`` argument of a trainer (an id, a path, or a model object, which is left alone).

    Raises:
        NotFoundError: the path looks local and does not exist.
    """
    if not isinstance(model, (str, os.PathLike)):
        return
    name = str(model)
    if _looks_local(name) and not Path(name).expanduser().exists():
        raise NotFoundError(f"model path '{name}' does not exist: pass an existing model directory or a Hub "
                                "model id (namespace/name)")


# Files ``datasets.load_dataset`` reads by extension; a Hub id never ends with one.
DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".json.gz", ".jsonl.gz")


def check_dataset_path(name: str) -> None:
    """A dataset given as a local path (absolute, ``./``, ``~``, deeper than ``namespace/name``, or a data file's
    name) must exist.

    Args:
        name: the ``dataset_name`` a recipe or ``trl-ext <command>`` was given.

    Raises:
        NotFoundError: the path looks local and does not exist (the message names it and the working directory).
    """
    looks_local = _looks_local(name) or name.lower().endswith(DATA_FILE_SUFFIXES)
    if looks_local and not Path(name).expanduser().exists():
        raise NotFoundError(f"dataset '{name}' does not exist (looked in {os.getcwd()}): pass an existing file or "
                                "directory, or a Hub dataset id (namespace/name)")
