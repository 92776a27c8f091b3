"""The embedded models by name: ``trl-ext/tiny-llama``, ``trl-ext/tiny-llama-arith``, ``trl-ext/tiny-llama-vllm`` and
``trl-ext/tiny-vlm``, each built locally on first use and never fetched from the Hub."""

from trl_ext.assets.tiny_arith import ARITH_MODEL_NAME, arith_model_path
from trl_ext.assets.tiny_model import DEFAULT_MODEL_NAME, default_model_path
from trl_ext.assets.tiny_vllm import VLLM_MODEL_NAME, vllm_model_path
from trl_ext.assets.tiny_vlm import VLM_MODEL_NAME, vlm_model_path


def resolve_model(name_or_path: str | None) -> str:
    """Map ``None`` or an embedded model's name (``trl-ext/tiny-llama``, ``trl-ext/tiny-llama-arith``,
    ``trl-ext/tiny-llama-vllm``, ``trl-ext/tiny-vlm``) to its local path; pass any other hub id or path through."""
    if name_or_path == VLLM_MODEL_NAME:
        return vllm_model_path()
    if name_or_path == VLM_MODEL_NAME:
        return vlm_model_path()
    if name_or_path == ARITH_MODEL_NAME:
        return arith_model_path()
    return default_model_path() if name_or_path in (None, DEFAULT_MODEL_NAME) else name_or_path
