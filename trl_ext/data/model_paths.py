"""A mistyped local model path, refused in one line before anything loads (transformers would first try the Hub)."""

import os
from pathlib import Path


def check_model_path(model) -> None:
    """A model given as a local path (absolute, ``./``, ``~``, or deeper than ``namespace/name``) must exist.

    Args:
        model: the ``model`` argument of a trainer (an id, a path, or a model object, which is left alone).

    Raises:
        FileNotFoundError: the path looks local and does not exist.
    """
    if not isinstance(model, (str, os.PathLike)):
        return
    name = str(model)
    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
    if looks_local and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"model path '{name}' does not exist: pass an existing model directory or a Hub "
                                "model id (namespace/name)")
