"""Embedded defaults: a tiny Llama with a chat tokenizer, and bundled arithmetic datasets (all offline)."""

from .datasets import DATASET_KINDS, DATASET_NAMES, load_dataset_by_name, load_default_dataset
from .tiny_model import DEFAULT_MODEL_NAME, default_model_path, resolve_model

__all__ = [
    "DATASET_KINDS",
    "DATASET_NAMES",
    "DEFAULT_MODEL_NAME",
    "default_model_path",
    "load_dataset_by_name",
    "load_default_dataset",
    "resolve_model",
]
