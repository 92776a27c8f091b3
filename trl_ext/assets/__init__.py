"""Embedded defaults: a tiny Llama with a chat tokenizer (and a copy SFT-warmed on arithmetic), a tiny Llama vLLM
serves on CPU (head_dim 64), a tiny LLaVA-style VLM, and bundled arithmetic and image datasets (all offline)."""

from trl_ext.assets.datasets import DATASET_KINDS, DATASET_NAMES, load_dataset_by_name, load_default_dataset
from trl_ext.assets.models import resolve_model
from trl_ext.assets.shapes import SHAPES_NAMES, answer_accuracy, load_shapes
from trl_ext.assets.tiny_arith import ARITH_MODEL_NAME, arith_model_path
from trl_ext.assets.tiny_model import DEFAULT_MODEL_NAME, default_model_path
from trl_ext.assets.tiny_vllm import VLLM_MODEL_NAME, vllm_model_path
from trl_ext.assets.tiny_vlm import VLM_MODEL_NAME, vlm_model_path

__all__ = [
    "ARITH_MODEL_NAME",
    "DATASET_KINDS",
    "DATASET_NAMES",
    "DEFAULT_MODEL_NAME",
    "SHAPES_NAMES",
    "VLLM_MODEL_NAME",
    "VLM_MODEL_NAME",
    "answer_accuracy",
    "arith_model_path",
    "default_model_path",
    "load_dataset_by_name",
    "load_default_dataset",
    "load_shapes",
    "resolve_model",
    "vllm_model_path",
    "vlm_model_path",
]
