"""What the older TRL releases in the supported range (pyproject.toml) lack, said in one line, with the fallback.

- trl < 1.15 builds the PEFT adapter before seeding (TRL added ``set_seed(args.seed)`` before the model in 1.15), so
  two runs with the same seed start from different LoRA weights, and a resumed run is not the uninterrupted one.
  We seed where TRL 1.15 does: same results as TRL 1.15+.
- trl 1.15's SFT, DPO, GRPO and RLOO losses go through a fused LM head whose kernels are Triton-only, launched on a
  CUDA/XPU device; without one they fail mid-step (``'NoneType' object has no attribute 'apply'``, or Triton's error
  on CPU tensors). TRL 1.16 added a PyTorch path. There is nothing thin to fall back to, so we refuse up front.
"""

import importlib.util

import trl
from packaging.version import Version
from transformers import set_seed

from trl_ext.errors import SetupError
from trl_ext.process.notices import notice

TRL_VERSION = Version(trl.__version__)
SEEDS_BEFORE_MODEL = Version("1.15")  # first TRL that seeds before building the model (and the PEFT adapter)
SEEDED_EARLIER = {"RewardTrainer"}  # already seeded before its model in trl 1.14 (its random head)
TORCH_LOSS_PATH = Version("1.16")  # first TRL whose fused LM head runs without Triton and a GPU


def seed_before_model(args, peft_config, trainer_name: str, trl_version: Version = TRL_VERSION) -> None:
    """Seed with ``args.seed`` before TRL builds the model, as TRL >= 1.15 does itself.

    Args:
        args: the training config TRL will get.
        peft_config: the trainer's ``peft_config`` argument (the notice is only for runs where the seed matters).
        trainer_name: the TRL trainer's class name.
        trl_version: the installed TRL's version (a parameter for the tests).
    """
    if trl_version >= SEEDS_BEFORE_MODEL or trainer_name in SEEDED_EARLIER:
        return
    if peft_config is not None:
        notice(f"trl {trl_version} does not seed before creating the PEFT adapter (fixed in trl 1.15): seeding with "
               f"args.seed={args.seed} as trl 1.15 does, so runs with the same seed start from the same LoRA weights.")
    set_seed(args.seed)


def check_fused_loss_runs_here(args, trainer_name: str, trl_version: Version = TRL_VERSION,
                               has_gpu: bool | None = None) -> None:
    """Refuse, before anything starts, a trl 1.15 run whose fused-LM-head loss cannot run on this machine.

    Args:
        args: the training config (``use_cpu`` keeps a GPU machine on CPU).
        trainer_name: the trainer's class name, for the message.
        trl_version: the installed TRL's version (a parameter for the tests).
        has_gpu: whether a CUDA/XPU device is usable; detected when None.

    Raises:
        errors.SetupError: on trl 1.15 without Triton or without a CUDA/XPU device to run its kernels on.
    """
    if not (TORCH_LOSS_PATH > trl_version >= Version("1.15")):
        return
    if has_gpu is None:
        import torch

        has_gpu = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    missing = []
    if importlib.util.find_spec("triton") is None:
        missing.append("Triton")
    if not has_gpu or getattr(args, "use_cpu", False):
        missing.append("CUDA/XPU GPU")
    if missing:
        raise SetupError(
            f"trl {trl_version}'s {trainer_name} computes its loss with Triton GPU kernels only, and this run has no "
            f"{' and no '.join(missing)}: install trl>=1.16 (it adds a PyTorch path) or trl 1.14.")
