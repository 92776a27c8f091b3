"""Vision-language models: image rows refused in one line before anything starts, and the vision tower frozen.

TRL's SFT and DPO trainers read TRL's vision formats: ``messages`` (or ``prompt``/``completion``,
``prompt``/``chosen``/``rejected``) whose content holds ``{"type": "image"}`` parts, and an ``images`` column (or one
``image``). A bad image otherwise surfaces mid-training from inside the collator (a PIL ``UnidentifiedImageError`` on
the batch that holds it, a placeholder count error from ``prepare_multimodal_messages``), or, for a text-only model,
only after the model has loaded. These checks refuse exactly what TRL would fail on, nothing it trains on.
"""

import os

from trl_ext.data.input_checks import FIX, already_passed, check_key, record_passed
from trl_ext.errors import DatasetError

IMAGE_COLUMNS = ("images", "image")
CONVERSATION_COLUMNS = ("messages", "prompt")  # where TRL looks for the image placeholders of a row


def is_vision_model(model) -> bool | None:
    """Whether ``model`` (a path, hub id or model) is a vision-language model, from its config; None when unknown.

    Args:
        model: A model instance, or a name or path that ``AutoConfig`` can read.

    Returns:
        True when its config has a vision part, False when it has none, None when the config cannot be read.
    """
    config = getattr(model, "config", None)
    if config is None and isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        from trl_ext.assets import resolve_model

        try:
            config = AutoConfig.from_pretrained(resolve_model(str(model)))
        except (OSError, ValueError):
            return None  # the model checks report that
    if config is None:
        return None
    return getattr(config, "vision_config", None) is not None


def _image_problem(value) -> str | None:
    """What is wrong with one image as TRL's processors take it: a PIL image, an array, a datasets Image dict or a
    path or URL; None when it is usable."""
    if value is None:
        return "is missing (None)"
    if isinstance(value, dict):  # an undecoded datasets Image: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return None
        value = value.get("path")
        if not value:
            return "has neither bytes nor a path"
    if isinstance(value, str):
        if value.startswith(("http://", "https://", "data:")) or os.path.isfile(value):
            return None
        return f"is a path that does not exist ({value[:60]})"
    if hasattr(value, "size") and (hasattr(value, "mode") or hasattr(value, "shape")):  # PIL image, array, tensor
        return None
    return f"has type {type(value).__name__}, expected an image (PIL image, path or datasets Image)"


def _placeholders(conversation) -> int | None:
    """Image placeholders TRL fills in one conversation; None when its contents are text (TRL then inserts them)."""
    if not isinstance(conversation, list):
        return None
    contents = [m.get("content") for m in conversation if isinstance(m, dict) and m.get("role") != "tool"]
    if all(isinstance(c, str) or c is None for c in contents):
        return None
    return sum(1 for c in contents if isinstance(c, list) for part in c
               if isinstance(part, dict) and part.get("type") == "image" and part.get("image") is None)


def check_image_dataset(dataset, name: str, vision_model: bool | None) -> None:
    """Refuse image rows that TRL cannot train on, in one line naming the first bad row and the fix.

    Args:
        dataset: A ``datasets.Dataset`` (other kinds, streamed or user-prepared data are left to TRL).
        name: How the message names the dataset ("train_dataset", "dataset 'x' split 'train'").
        vision_model: Whether the model is a vision-language model (None: unknown, no model check).

    Raises:
        DatasetError: An image column given to a text-only model; an image that is missing, unreadable or of the
            wrong type; a row whose number of images differs from its image placeholders.
    """
    columns = getattr(dataset, "column_names", None)
    if not columns or not hasattr(dataset, "__len__") or not hasattr(dataset, "select_columns"):
        return
    column = next((c for c in IMAGE_COLUMNS if c in columns), None)
    if column is None:
        return
    if vision_model is False:
        raise DatasetError(f"{name} has an '{column}' column but the model is text-only: train a vision-language "
                           f"model (e.g. trl-ext/tiny-vlm), or drop the column (dataset.remove_columns('{column}'))")
    key = check_key("images", dataset, vision_model)
    if already_passed(key):
        return
    conversation = next((c for c in CONVERSATION_COLUMNS if c in columns), None)
    wanted = [column, *([conversation] if conversation else [])]
    # Images stay undecoded here: a file that PIL cannot open is reported below, not raised from inside datasets.
    rows = dataset.select_columns(wanted)
    feature = rows.features[column]
    undecoded = _without_decoding(feature)
    if undecoded is not None:
        rows = rows.cast_column(column, undecoded)
    bad, first = 0, None
    for start in range(0, len(rows), 256):
        batch = rows[start:start + 256]
        for offset, value in enumerate(batch[column]):
            problem = _row_problem(value, column, batch[conversation][offset] if conversation else None)
            if problem:
                bad += 1
                first = first or f"row {start + offset}: {problem}"
    if bad:
        raise DatasetError(f"{name}: {bad} bad image row(s) in {len(dataset)} rows, first at {first}; {FIX}")
    record_passed(key)


def _without_decoding(feature):
    """The same feature with its images left as ``{"bytes", "path"}`` dicts, or None when it holds no Image."""
    from datasets import Image, Sequence

    if isinstance(feature, Image):
        return Image(decode=False)
    if isinstance(feature, Sequence) and isinstance(feature.feature, Image):
        return Sequence(Image(decode=False))
    if isinstance(feature, list) and feature and isinstance(feature[0], Image):
        return [Image(decode=False)]
    return None


def _row_problem(value, column: str, conversation) -> str | None:
    if column == "images":
        if not isinstance(value, list):
            return f"'images' has type {type(value).__name__}, expected a list of images"
        images = value
    else:
        images = [value]
    for image in images:
        problem = _image_problem(image)
        if problem is None and isinstance(image, dict) and image.get("bytes"):
            problem = _undecodable(image["bytes"])
        elif problem is None and isinstance(image, (str, dict)):  # a local file: its header, not its pixels
            path = image.get("path") if isinstance(image, dict) else image
            problem = None if path.startswith(("http://", "https://", "data:")) else _unreadable_file(path)
        if problem:
            return f"an image {problem}"
    placeholders = _placeholders(conversation)
    if placeholders is not None and placeholders != len(images):
        return (f"{len(images)} image(s) but {placeholders} {{'type': 'image'}} placeholder(s) in its "
                "conversation (one placeholder per image)")
    return None


def _unreadable_file(path: str) -> str | None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path):  # reads the header only: cheap for every row, catches non-images and missing files
            pass
    except (UnidentifiedImageError, OSError) as exc:
        return f"cannot be read ({path[:60]}: {type(exc).__name__})"
    return None


def _undecodable(data: bytes) -> str | None:
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)):  # the header only: a pass over every row stays cheap on large datasets
            pass
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        return f"cannot be read ({type(exc).__name__})"
    return None


def vision_tower(model):
    """The vision encoder of a vision-language model (PEFT-wrapped or not), or None.

    Args:
        model: A model, possibly inside a ``PeftModel``.

    Returns:
        The vision tower module, or None for a text-only model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for holder in (base, getattr(base, "model", None)):
        for attr in ("vision_tower", "visual", "vision_model"):
            module = getattr(holder, attr, None) if holder is not None else None
            if module is not None:
                return module
    return None


def freeze_vision_tower(model) -> int:
    """Freeze the vision tower (``requires_grad=False``), as VLM fine-tuning usually does. Call it before training:
    the optimizer (DeepSpeed's too) is built from the parameters that require grad when training starts.

    Args:
        model: A vision-language model, possibly inside a ``PeftModel``.

    Returns:
        The number of the vision tower's parameter tensors, all frozen now (0 for a text-only model).
    """
    tower = vision_tower(model)
    if tower is None:
        return 0
    params = list(tower.parameters())
    for param in params:
        param.requires_grad_(False)
    return len(params)
