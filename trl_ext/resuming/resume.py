"""The trainer's one entry into resuming: ``prepare`` before Trainer's loop decides what to resume and how; the
``Resume`` it returns answers Trainer's three loading hooks (weights, optimizer and scheduler, RNG states).

    checkpoint = resume_from_checkpoint (a path, or True: the newest committed one)  -> choose
      -> audited before anything loads                                              -> checks
      -> saved on another number of processes? keep the global batch                 -> world_size
         (DeepSpeed: convert to the universal checkpoint)                            -> universal
    Trainer then loads: weights (FSDP2: each rank its rows; Hub layout: converted)   -> fsdp2, Resume.load_weights
                        optimizer states (across the FSDP2 / one-process layouts;    -> fsdp2, Resume.load_optimizer
                        DeepSpeed's ZeRO-3 universal load repaired)                  -> universal
                        RNG states (rank r takes rank r's)                           -> rng, Resume.load_rng
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from transformers import set_seed

from trl_ext.engines import fsdp
from trl_ext.errors import ResumeError
from trl_ext.files import checkpoint_dirs, hub_names
from trl_ext.placement import ownership
from trl_ext.process.collectives import decided_on_rank0
from trl_ext.process.notices import notice
from trl_ext.resuming import checks, choose, fsdp2, mirrored, rng, universal, world_size
from trl_ext.saving import memory_replicas, supports


@dataclass
class Resume:
    """What a run resumes and how. A run that resumes nothing has ``checkpoint`` None; its hooks are Trainer's own
    except where trl_ext's checkpoints need otherwise (FSDP2, the Hub's layout).

    Args:
        checkpoint: the ``checkpoint-N`` directory, the same on every rank.
        reshard: how a checkpoint saved on another number of processes resumes here (None: it does not say).
    """

    checkpoint: str | None = None
    reshard: world_size.Reshard | None = None
    fresh: bool = False  # resume_from_checkpoint=True with a mirror, and nothing to resume anywhere: a new run

    def load_weights(self, trainer, checkpoint: str, model) -> bool:
        """Load the weights of ``checkpoint`` where Trainer's own loader would get them wrong: under FSDP2 (each rank
        reads its own rows of the Hub-format files) and a full model whose Hub layout differs from memory (Trainer
        loads by name without transformers' conversions, leaving fused MoE experts untrained: transformers#48805).

        Args:
            trainer: the trainer.
            checkpoint: the directory Trainer loads from.
            model: the model to load into.

        Returns:
            True when loaded here; False to let Trainer load (DeepSpeed resumes from its own states, adapters and
            unconverted models load by name).
        """
        if fsdp.is_fsdp2(trainer.accelerator):
            fsdp2.load_checkpoint_weights(model, checkpoint)
            return True
        if (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or is_peft_model(model) or not supports(model)
                or not hub_names.is_converted(model)):
            return False
        # from_pretrained applies the conversions; the copy is on CPU, as Trainer's own state dict would be
        loaded = type(model).from_pretrained(checkpoint, dtype=model.dtype, config=model.config)
        model.load_state_dict(loaded.state_dict(), strict=True)
        return True

    def load_optimizer(self, trainer, checkpoint: str) -> bool:
        """Load optimizer and scheduler states written in the other layout than this run reads (a one-process
        checkpoint resumed under FSDP2, or the reverse). Returns False to let Trainer load them. Under DeepSpeed the
        engine has loaded them already; from a universal checkpoint, ZeRO-3's are repaired (``universal``)."""
        from transformers.trainer import SCHEDULER_NAME

        if trainer.is_deepspeed_enabled:
            if self.reshard is not None:
                universal.repair_after_load(trainer.model_wrapped, checkpoint, self.reshard)
            return False
        sharded = fsdp.is_fsdp2(trainer.accelerator)
        if not fsdp2.needs_conversion(checkpoint, sharded):
            return False
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper holds torch's
        fsdp2.load_optimizer_converted(trainer.model, optimizer, checkpoint, sharded)
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        return True

    def load_rng(self, trainer, checkpoint: str, trainer_load) -> None:
        """Each rank's RNG state: Trainer's own (``trainer_load``), except on another number of processes, where rank
        r takes rank r's saved state and a new rank is seeded from (seed, step, rank)."""
        if self.reshard is None or not self.reshard.changed:
            return trainer_load(checkpoint)
        with rng.rng_checkpoint(checkpoint, self.reshard, trainer.args.process_index) as found:
            if found is not None:
                return trainer_load(found)
        set_seed(rng.seed_for_new_rank(trainer.args.seed, trainer.state.global_step, self.reshard,
                                       trainer.args.process_index))


def _read_reshard(trainer, checkpoint: str) -> world_size.Reshard | None:
    """How ``checkpoint`` was trained, read on rank 0 and broadcast (ranks that look at the files separately could
    disagree and take different collective paths); a refusal is raised on every rank."""
    args = trainer.args

    def read():
        try:
            reader = world_size.read_reshard if trainer.is_deepspeed_enabled else world_size.read_trainer_reshard
            return reader(checkpoint, args)
        except (OSError, ValueError, KeyError) as exc:
            raise ResumeError(f"cannot read how {checkpoint} was trained: {exc}") from None

    return decided_on_rank0(read)


def _convert_for_deepspeed(trainer, checkpoint: str, reshard: world_size.Reshard, memory=None) -> None:
    """DeepSpeed on another number of processes: the universal checkpoint, written once per copy of the checkpoint
    (each node's local main with ``save_on_each_node`` or for a checkpoint of the memory tier ``memory``, which each
    machine resumes from its own memory, given a new manifest with the files added so that it stays resumable; else
    the main process); a failure is raised on every rank."""
    from trl_ext import errors

    args = trainer.args
    writer = args.local_process_index == 0 if args.save_on_each_node or memory else args.process_index == 0
    error = None
    if writer:
        try:
            universal.convert_to_universal(checkpoint, reshard.tag)
            if memory is not None:
                memory.committed(Path(checkpoint), checkpoint_dirs.step_of(checkpoint))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below, so that none waits for a failed writer
            error = ResumeError(f"converting {checkpoint} to DeepSpeed's universal checkpoint failed: {exc}")
    if args.world_size > 1:
        errors.agree(error)
    elif error is not None:
        raise error


def prepare(trainer, resume_from_checkpoint) -> Resume:
    """Before ``Trainer.train``: which checkpoint to resume (``choose``), audited (``checks``); on another number of
    processes, the global batch kept (gradient accumulation) and, under DeepSpeed, the universal checkpoint made.
    Collective: every rank calls it and gets the same answer or error.

    Args:
        trainer: the trainer about to train (its DeepSpeed engine is not built yet).
        resume_from_checkpoint: as given to ``train``: None or False, a path, or True (the newest committed one;
            with ``checkpoint_mirror`` and none in the output directory, the mirror's newest, downloaded:
            ``mirrored``). In a run with an identity (``placement.orchestrators``), None means the newest checkpoint
            an earlier attempt of the run committed in this output directory (``choose.restarted_checkpoint``), or in
            the mirror it was writing (``mirrored.restarted``). With the memory tier (``memory_checkpoint_steps``),
            True and a restart take its newest checkpoint where it is newer.

    Returns:
        The ``Resume``: its ``checkpoint`` is the path to hand Trainer (None: nothing to resume, or True found
        nothing and Trainer says so).

    Raises:
        ResumeError: a damaged checkpoint, one missing on some node, or a global batch that cannot be kept.
    """
    memory = trainer.checkpoints.memory  # None without memory_checkpoint_steps
    restarted = not resume_from_checkpoint and ownership.current_run() is not None
    if memory is not None and (restarted or resume_from_checkpoint is True):
        memory.know_machines(trainer.args)
        if memory.replicated:  # the parts each machine lacks of the newest memory checkpoint they hold together
            memory_replicas.settle(memory, trainer.args, trainer.checkpoints.executor.group())
    if restarted:  # a restarted run resumes by itself
        resume_from_checkpoint = choose.restarted_checkpoint(trainer.args, memory) or mirrored.restarted(trainer)
    if not resume_from_checkpoint:
        return Resume()
    if resume_from_checkpoint is True:  # the memory tier's newest where newer, else the output directory's
        resume_from_checkpoint = choose.newer_in_memory_asked(trainer.args, memory) or True
    if resume_from_checkpoint is True:  # an output directory without a checkpoint: the mirror's newest, if any
        mirrored.download_if_missing(trainer)
    checkpoint = choose.checkpoint_to_resume(trainer.args, resume_from_checkpoint,
                                             here=memory.here if memory is not None else None)
    if checkpoint is None:
        return Resume(fresh=resume_from_checkpoint is True and mirrored.start_fresh(trainer))
    config = getattr(trainer.model, "config", None)
    checks.check_resume_checkpoint(checkpoint, getattr(config, "num_labels", 1))
    reshard = _read_reshard(trainer, checkpoint)
    if reshard is None:
        return Resume(checkpoint)
    if not trainer.is_deepspeed_enabled:  # FSDP2, DDP, one process: optimizer states convert when loaded (fsdp2)
        message = world_size.keep_global_batch(reshard, trainer.args) if reshard.changed else None
    else:
        if reshard.changed:
            in_memory = memory is not None and Path(checkpoint).is_relative_to(memory.root)
            _convert_for_deepspeed(trainer, checkpoint, reshard, memory if in_memory else None)
        message = universal.apply(reshard, trainer.args, trainer.accelerator.state.deepspeed_plugin.deepspeed_config)
    if message:
        notice(message)
    return Resume(checkpoint, reshard)
