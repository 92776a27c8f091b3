"""Resume a checkpoint on another number of processes: DeepSpeed ZeRO here; FSDP2 and one process through
``fsdp_resume`` (weights from the Hub-format files, optimizer states resharded), with the same batch arithmetic.

A ZeRO checkpoint holds one optimizer partition per data-parallel rank, so DeepSpeed can only load it on the world
size that wrote it. When that changed, the checkpoint is converted once to DeepSpeed's universal checkpoint
(``deepspeed.checkpoint.ds_to_universal``, written beside the original in the checkpoint directory) and loaded with
``load_universal``. The global batch size is kept by changing gradient accumulation: with the same per-device batch,
the optimizer steps then see the same samples in the same order (the sampler's permutation does not depend on the
number of processes), so the data continues at the next unseen sample and the LR schedule at the next step.
"""

import contextlib
import io
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from trl_ext.process import notice

UNIVERSAL_SUFFIX = "_universal"
_OPTIM_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


@dataclass(frozen=True)
class Plan:
    """How a checkpoint written on ``saved_world_size`` processes resumes on the current ones."""

    saved_world_size: int
    world_size: int
    global_batch_size: int
    gradient_accumulation_steps: int
    tag: str | None  # the checkpoint's DeepSpeed tag (``global_stepN``); None without DeepSpeed state

    @property
    def changed(self) -> bool:
        return self.saved_world_size != self.world_size


def deepspeed_tag(checkpoint: str | os.PathLike) -> str | None:
    """The DeepSpeed tag of ``checkpoint`` (from its ``latest`` file), or None if it holds no DeepSpeed state."""
    latest = Path(checkpoint) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def read_plan(checkpoint: str | os.PathLike, args) -> Plan | None:
    """What it takes to resume ``checkpoint`` with training arguments ``args`` (None: not a ZeRO checkpoint).

    Args:
        checkpoint: a ``checkpoint-N`` directory written by the Trainer under DeepSpeed.
        args: the resumed run's ``TrainingArguments``.

    Returns:
        The plan. Raises ``ValueError`` (one line) when the global batch cannot be kept (with the arithmetic), or
        when the checkpoint lacks some ranks' states and the number of processes changed.
    """
    tag = deepspeed_tag(checkpoint)
    if tag is None:
        return None
    folder = Path(checkpoint) / tag
    ranks = {int(m.group(1)) for p in folder.iterdir() if (m := _OPTIM_FILE.search(p.name))}
    if not ranks:
        return None
    model_states = sorted(folder.glob("*model_states.pt"))[0]
    # mmap: the ds_config is all we need; ZeRO-1/2 files also hold the whole 16-bit model
    saved_config = torch.load(model_states, map_location="cpu", weights_only=False, mmap=True)["ds_config"]
    global_batch = int(saved_config["train_batch_size"])
    # From the saved batch sizes, not from the files: a node-local copy holds only its own ranks' states
    saved_world = global_batch // (int(saved_config["train_micro_batch_size_per_gpu"]) *
                                   int(saved_config["gradient_accumulation_steps"]))
    if saved_world != args.world_size and len(ranks) < saved_world:
        raise ValueError(
            f"{folder} holds the ZeRO states of {len(ranks)} of the {saved_world} processes that saved it (node-local "
            f"storage?): resume on {saved_world} processes, or first copy every node's {tag}/ files into one "
            f"directory.")
    return _keeping_global_batch(global_batch, saved_world, args, tag)


def _keeping_global_batch(global_batch: int, saved_world: int, args, tag: str | None) -> Plan:
    """The plan that keeps ``global_batch`` on ``args``' processes and per-device batch, or a one-line refusal with
    the arithmetic (``ValueError``)."""
    per_step = args.world_size * args.per_device_train_batch_size
    if global_batch % per_step:
        raise ValueError(
            f"cannot keep the checkpoint's global batch size of {global_batch} samples (saved on {saved_world} "
            f"processes) on {args.world_size} processes x per_device_train_batch_size "
            f"{args.per_device_train_batch_size} = {per_step} samples per micro-step: {global_batch} is not a multiple "
            f"of {per_step}; resume on a number of processes (or a per-device batch) whose product divides "
            f"{global_batch}.")
    return Plan(saved_world, args.world_size, global_batch, global_batch // per_step, tag)


def read_trainer_plan(checkpoint: str | os.PathLike, args) -> Plan | None:
    """``read_plan`` for a checkpoint without DeepSpeed state (FSDP2, DDP, one process), from the Trainer's own files.

    The saved number of processes is the number of RNG states (``rng_state_<rank>.pth``, or one ``rng_state.pth``);
    the saved per-device batch and gradient accumulation are in ``training_args.bin``.

    Args:
        checkpoint: a ``checkpoint-N`` directory written by the Trainer.
        args: the resumed run's ``TrainingArguments``.

    Returns:
        The plan (``tag`` None), or None when the checkpoint does not say (no RNG state or training arguments).
    """
    folder = Path(checkpoint)
    ranks = len(list(folder.glob("rng_state_*.pth"))) or (1 if (folder / "rng_state.pth").is_file() else 0)
    if not ranks or not (folder / "training_args.bin").is_file():
        return None
    try:  # the Trainer's own pickle of the arguments (trl_ext's or TRL's config classes)
        saved = torch.load(folder / "training_args.bin", map_location="cpu", weights_only=False)
        per_device, accumulation = int(saved.per_device_train_batch_size), int(saved.gradient_accumulation_steps)
    except Exception:  # noqa: BLE001 - unreadable: resume as Trainer would, with the arguments given
        return None
    return _keeping_global_batch(ranks * per_device * accumulation, ranks, args, None)


def keep_global_batch(plan: Plan, args) -> str | None:
    """Set ``args.gradient_accumulation_steps`` to keep the plan's global batch size (before ``Trainer.train``).

    Returns:
        The one-line notice to print, or None when nothing changed.
    """
    if plan.gradient_accumulation_steps == args.gradient_accumulation_steps:
        return None
    message = (f"resuming a checkpoint saved on {plan.saved_world_size} processes on {plan.world_size}: "
               f"gradient_accumulation_steps {args.gradient_accumulation_steps} -> "
               f"{plan.gradient_accumulation_steps}, to keep the global batch size of {plan.global_batch_size}.")
    args.gradient_accumulation_steps = plan.gradient_accumulation_steps
    return message


def convert_to_universal(checkpoint: str | os.PathLike, tag: str) -> None:
    """Write DeepSpeed's universal checkpoint of ``checkpoint/tag`` to ``checkpoint/tag_universal`` (once; atomic).

    Args:
        checkpoint: the ``checkpoint-N`` directory.
        tag: its DeepSpeed tag (``global_stepN``).
    """
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    checkpoint = Path(checkpoint)
    final = checkpoint / f"{tag}{UNIVERSAL_SUFFIX}"
    if not final.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=checkpoint))
        options = Namespace(input_folder=str(checkpoint / tag), output_folder=str(staging), num_extract_workers=1,
                            num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its progress report is per parameter
                ds_to_universal.main(options)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        staging.chmod(0o755)
        os.replace(staging, final)
    # What load_universal reads instead of ``latest``. Always rewritten: ds_to_universal writes one naming its
    # output folder, here the staging directory.
    tmp = checkpoint / f".latest_universal.{os.getpid()}"
    tmp.write_text(final.name)
    os.replace(tmp, checkpoint / "latest_universal")


def apply(plan: Plan, args, deepspeed_config: dict) -> str | None:
    """Set the resumed run's gradient accumulation (and DeepSpeed's batch sizes) to keep the global batch size, and
    ask DeepSpeed for the universal checkpoint when the world size changed.

    Args:
        plan: from ``read_plan``.
        args: the resumed run's ``TrainingArguments`` (changed in place).
        deepspeed_config: the DeepSpeed config the engine will be built from (changed in place).

    Returns:
        The one-line notice to print, or None when nothing changed.
    """
    notice = keep_global_batch(plan, args)
    deepspeed_config["gradient_accumulation_steps"] = plan.gradient_accumulation_steps
    deepspeed_config["train_batch_size"] = plan.global_batch_size
    if plan.changed:
        deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    return notice


@contextlib.contextmanager
def rng_checkpoint(checkpoint: str, plan: Plan, process_index: int):
    """A directory where the Trainer finds this rank's RNG state under the name it expects for the new world size.

    Rank ``r`` takes the state saved by rank ``r``. A rank that did not exist yields None: the caller seeds it.

    Args:
        checkpoint: the ``checkpoint-N`` directory.
        plan: from ``read_plan``.
        process_index: this process's global rank.

    Returns:
        (context manager) the directory to give ``Trainer._load_rng_state``, or None.
    """
    saved = "rng_state.pth" if plan.saved_world_size == 1 else f"rng_state_{process_index}.pth"
    wanted = "rng_state.pth" if plan.world_size == 1 else f"rng_state_{process_index}.pth"
    source = Path(checkpoint) / saved
    if process_index >= plan.saved_world_size or not source.is_file():
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(source.resolve(), Path(tmp) / wanted)
        yield tmp


def prepare(trainer, checkpoint: str) -> Plan | None:
    """Before ``Trainer.train`` resumes ``checkpoint``: plan, and where the number of processes changed, keep the
    global batch (gradient accumulation) and, under DeepSpeed, convert to the universal checkpoint. Collective: every
    rank calls it, and every rank gets the same answer or error.

    Args:
        trainer: the trainer about to resume (its DeepSpeed engine is not built yet).
        checkpoint: the ``checkpoint-N`` directory.

    Returns:
        The plan, or None when ``checkpoint`` does not say how it was trained.
    """
    from accelerate.utils import broadcast_object_list, gather_object

    args = trainer.args
    deepspeed = trainer.is_deepspeed_enabled
    # Decided on one rank and broadcast: ranks that look at the files separately could disagree (NFS attribute
    # caching, node-local disks) and then take different collective paths.
    answer = [None, None]
    if args.process_index == 0:
        try:
            answer = [read_plan(checkpoint, args) if deepspeed else read_trainer_plan(checkpoint, args), None]
        except (OSError, ValueError, KeyError) as exc:
            answer = [None, str(exc)]
    if args.world_size > 1:
        broadcast_object_list(answer, from_process=0)
    plan, error = answer
    if error is not None:
        raise ValueError(error)
    if plan is None:
        return None
    if not deepspeed:  # FSDP2, DDP, one process: optimizer states are converted when they are loaded (fsdp_resume)
        message = keep_global_batch(plan, args) if plan.changed else None
        if message:
            notice(message)
        return plan
    if plan.changed:
        # One writer per copy of the checkpoint: each node's local main with save_on_each_node, else the main process.
        writer = args.local_process_index == 0 if args.save_on_each_node else args.process_index == 0
        error = None
        if writer:
            try:
                convert_to_universal(checkpoint, plan.tag)
            except Exception as exc:  # reported on every rank below, so that no rank waits for a writer that failed
                error = f"converting {checkpoint} to DeepSpeed's universal checkpoint failed: {exc}"
        errors = [e for e in (gather_object([error]) if args.world_size > 1 else [error]) if e]
        if errors:
            raise RuntimeError(errors[0])
    message = apply(plan, args, trainer.accelerator.state.deepspeed_plugin.deepspeed_config)
    if message:
        notice(message)
    return plan
