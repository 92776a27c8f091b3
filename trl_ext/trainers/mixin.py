"""``TrlExtMixin``: the one place that holds what trl_ext changes in TRL's trainers. Overrides only, ``super()``
first; each step it adds lives in the module named for it (saving, engines, data).
"""

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trl_ext import patches, resuming, saving
from trl_ext.data import input_checks, model_paths, vision
from trl_ext.engines import (
    fsdp,
    gradient_checkpointing,
    nodes,
    quantization,
    rank0_loading,
    runtime,
    sharded,
)
from trl_ext.errors import DIVERGED, NONFINITE, CheckpointError, GaveUp
from trl_ext.mirror import Mirror, run_record
from trl_ext.placement import outcome, ownership
from trl_ext.placement.orchestrators import torchrun
from trl_ext.process import warning_filter
from trl_ext.process.clean_exit import destroy_gloo_group_at_exit
from trl_ext.process.collectives import decided_on_rank0
from trl_ext.resuming.choose import last_committed
from trl_ext.saving.checkpoints import Checkpoints
from trl_ext.saving.memory_tier import MemoryTier
from trl_ext.settings.trainer_options import SaveOptions
from trl_ext.trainers import compat, components, configs, preemption


class TrlExtMixin:
    """Behaviour shared by every trainer (SFT, reward, DPO, KTO, GRPO, RLOO). Overrides call ``super()`` and keep TRL's
    signatures. What joins the trainer (checkpoints, the mirror, preemption, an orchestrator's own) joins through
    ``join``, in the order ``trl_ext.trainers.components`` states, and reads it through ``checkpoints``, ``mirror``,
    ``preemption``, ``storage`` and ``writes_files()``."""

    _config_class: type  # the trl_ext config used when the caller passes no ``args``
    _default_run_suffix: str
    _dataset_kind: str | None = None  # the rows it takes (``input_checks.FORMATS``); None: prompts (GRPO, RLOO)
    _fused_lm_head = True  # TRL computes this trainer's loss through its fused LM head (trl >= 1.15)

    def __init__(self, *args, **kwargs):
        warning_filter.quiet_known_noise()  # third-party warnings raised every step about calls the user did not make
        self._storage: nodes.Storage | None = None  # output_dir's storage across nodes, known once train() starts
        self._resume = resuming.Resume()  # what train() resumes (nothing until it says)
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        training_args = self._config_for(bound)
        self._refuse_before_loading(training_args)
        if self._fused_lm_head:
            compat.check_fused_loss_runs_here(training_args, type(self).__name__)
        self._check_input(bound)
        quantization.adjust_for_engine(training_args, bound)  # QLoRA: the ZeRO stage's dtype; refusals
        fsdp_recomputes = gradient_checkpointing.fsdp_recomputes(training_args)  # FSDP's recompute, or ours
        user_reentrant = gradient_checkpointing.take_user_choice(training_args)
        compat.seed_before_model(training_args, bound.arguments.get("peft_config"), self._trl_class.__name__)
        trl_module = sys.modules[self._trl_class.__module__]
        with (self._around_trl_init(bound), rank0_loading.rank0_loading(trl_module, training_args),
              runtime.fsdp_on_cpu(training_args)):
            super().__init__(*bound.args, **bound.kwargs)
        destroy_gloo_group_at_exit()  # the process group exists now; see process/clean_exit.py
        rank0_loading.give_meta_parameters_storage(self.model)  # left on meta on the ranks that do not read
        fsdp.wrap_layers_the_model_has(self.accelerator, self.model)
        quantization.match_adapter_dtype(self.args, self.model)
        for model in (self.model, getattr(self, "ref_model", None)):
            if model is not None:
                quantization.disable_cpu_packed_path(model)
        self._after_trl_init()
        if not getattr(self.args, "packing", False):  # packing changes the row count by design
            input_checks.check_rows_kept(bound.arguments.get("train_dataset"), self.train_dataset, "train_dataset",
                                         getattr(self.args, "max_length", None))
        self._apply_gradient_checkpointing(user_reentrant, fsdp_recomputes)
        if self.is_deepspeed_enabled:
            guard_save_pretrained(self.model)
        self._join_components()

    def _config_for(self, bound) -> object:
        """The config TRL trains with, set in ``bound``: TRL's default (``<model>-<Suffix>``) built from trl_ext's
        hardware-aware config when none is given, a plain ``TrainingArguments`` converted as TRL would convert it."""
        training_args = bound.arguments.get("args")
        if training_args is None:
            model = bound.arguments["model"]
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            bound.arguments["args"] = training_args = self._config_class(
                output_dir=f"{str(name).rstrip('/').split('/')[-1]}-{self._default_run_suffix}"
            )
        elif not isinstance(training_args, self._trl_config_class):
            # every check below sees the config TRL trains with (TRL keeps one of its own class as it is)
            bound.arguments["args"] = training_args = configs.from_training_arguments(
                training_args, self._config_class, self._trl_class)
        return training_args

    def _refuse_before_loading(self, training_args) -> None:
        """What is refused before the model loads: a launch that cannot run, an error of the run's own that a restart
        would repeat, a mirror that cannot be used, a run that failed too often in a row without a new checkpoint (on
        disk, in the mirror, or in this machine's memory tier)."""
        runtime.check_distributed_setup(training_args)
        runtime.check_offloading_has_an_accelerator(training_args)
        outcome.watch(training_args.output_dir)  # restarted by its orchestrator, an error of its own is not repeated
        if ownership.is_own(training_args.output_dir):
            outcome.refuse_after_error(training_args.output_dir)
        self._mirror = Mirror.for_args(training_args)  # checkpoint_mirror: the store checked now
        # the attempts (their count kept on the mirror too), decided on rank 0's view of the directory for every rank
        # (a node-local disk may hold no record on the others)
        store = self._mirror.store if self._mirror is not None else None
        memory = MemoryTier.of(training_args)  # its newest checkpoint counts as progress too
        try:
            if ownership.current_run() is not None:  # the same on every rank; a run without one has no attempts
                decided_on_rank0(lambda: run_record.begin_attempt(store, training_args.output_dir,
                                                                  memory.newest_step() if memory else 0))
        except GaveUp as gave_up:
            outcome.record(gave_up)  # for this machine's node launcher, whose exit code it becomes (202)
            raise

    def _apply_gradient_checkpointing(self, user_reentrant, fsdp_recomputes: bool) -> None:
        """Gradient checkpointing: non-reentrant unless the user or an unfixed DeepSpeed says otherwise; FSDP's own
        recompute checked instead where it is on."""
        use_reentrant = gradient_checkpointing.decide(self.args, self.model, user_reentrant)
        gradient_checkpointing.apply(self.args, use_reentrant)
        if use_reentrant is not None:
            if not use_reentrant:
                gradient_checkpointing.remove_input_require_grads_hooks(self.model)  # TRL registered it for PEFT
            self.add_callback(gradient_checkpointing.CheckpointingPolicy(use_reentrant))
        elif fsdp_recomputes:
            self.add_callback(gradient_checkpointing.FsdpCheckpointingCheck())

    def _join_components(self) -> None:
        """The components, in the order ``components`` states: checkpoints, the mirror, preemption, the
        orchestrator's own."""
        self._checkpoints = Checkpoints(self)  # each checkpoint-N; with save_in_background, written meanwhile
        self.join(self._checkpoints.callback)
        if self._mirror is not None:
            self._mirror.attach(self)  # joins first of all callbacks; uploads each checkpoint-N once committed
        self._preemption = None
        if preemption.wanted(self.args):  # SIGTERM/SIGUSR1: every rank stops at a step boundary, with a checkpoint
            preemption.replace_jit_checkpoint(self)
            self._preemption = preemption.Preemption(self._checkpoints)  # its writes count in a stop's time
            self._preemption.before_exit = self._before_preempted_exit
            self.join(self._preemption)
        for make in components.orchestrators_own():
            make(self)

    def join(self, callback=None, *, first: bool = False, committed: Callable[[Path, int], None] | None = None) -> None:
        """The one way a component joins this trainer: trl_ext's checkpoints, mirror and preemption, and an
        orchestrator's own (``components.joining``), in the order ``trl_ext.trainers.components`` states.

        Args:
            callback: the component's ``TrainerCallback`` (None: it has none), added after those joined before it.
            first: the callback runs before every other one, TRL's loggers included (the mirror's progress).
            committed: called as ``committed(path, step)`` on the rank that writes, once each ``checkpoint-N`` is
                committed, after those joined before it.
        """
        if callback is not None:
            if first:
                self.callback_handler.callbacks.insert(0, callback)
            else:
                self.add_callback(callback)
        if committed is not None:
            self._checkpoints.after_commit.append(committed)

    @property
    def checkpoints(self) -> Checkpoints:
        """This trainer's ``checkpoint-N``s (``saving.checkpoints.Checkpoints``): the one in flight, each one's cost."""
        return self._checkpoints

    @property
    def mirror(self) -> Mirror | None:
        """The checkpoint mirror (``checkpoint_mirror``), or None without one."""
        return self._mirror

    @property
    def preemption(self) -> preemption.Preemption | None:
        """The stop at a step boundary on SIGTERM or SIGUSR1, with a checkpoint (``save_on_preemption``), or None
        when it is off."""
        return self._preemption

    @property
    def storage(self) -> nodes.Storage | None:
        """``output_dir``'s storage across nodes (whether it is shared), known once ``train()`` starts; None before."""
        return self._storage

    def _before_preempted_exit(self) -> None:
        """On every rank, before a preempted run exits: the checkpoint in flight committed, then the stopping
        checkpoint uploaded to the mirror within its grace period (or said to be only local)."""
        self._checkpoints.wait_for_writes()
        if self._mirror is not None:
            self._mirror.at_preemption(self.accelerator.wait_for_everyone)

    def _check_input(self, bound: inspect.BoundArguments) -> None:
        """Refuse a missing model path, or rows TRL cannot prepare, with one clear line before the model is loaded."""
        model_paths.check_model_path(bound.arguments.get("model"))
        datasets = {"train_dataset": bound.arguments.get("train_dataset")}
        eval_dataset = bound.arguments.get("eval_dataset")
        if isinstance(eval_dataset, dict):
            datasets.update({f"eval_dataset['{k}']": v for k, v in eval_dataset.items()})
        else:
            datasets["eval_dataset"] = eval_dataset
        vision_model = None  # image rows first: their problems are clearer than what TRL's preparation would say
        for name, dataset in datasets.items():
            if any(c in (getattr(dataset, "column_names", None) or ()) for c in vision.IMAGE_COLUMNS):
                if vision_model is None:
                    vision_model = vision.is_vision_model(bound.arguments["model"])
                vision.check_image_dataset(dataset, name, vision_model)
        input_checks.probe_datasets(self._trl_class, datasets, bound.arguments["args"], bound.arguments.get("model"),
                                    bound.arguments.get("processing_class"), bound.arguments.get("formatting_func"),
                                    self._dataset_kind)

    def _prepare_dataset(self, dataset, *args, **kwargs):
        """TRL's dataset preparation; rows it cannot prepare (or prepares into nothing) are refused in one line (patch
        ``dataset-preparation-refusal``)."""
        prepare = super()._prepare_dataset
        if not patches.applies("dataset-preparation-refusal"):
            return prepare(dataset, *args, **kwargs)
        bound = inspect.signature(prepare).bind(dataset, *args, **kwargs)
        return input_checks.prepare_or_explain(
            lambda rows: prepare(rows, *args, **kwargs), dataset,
            input_checks.dataset_display_name(bound.arguments.get("dataset_name", "train")), self._dataset_kind,
            getattr(bound.arguments.get("args"), "dataset_text_field", "text"), bound.arguments.get("formatting_func"))

    def _around_trl_init(self, bound: inspect.BoundArguments):
        """Context for TRL's constructor; trainers with something to fix while TRL builds the model override it."""
        return contextlib.nullcontext()

    def _after_trl_init(self) -> None:
        """Checks once TRL's constructor has built everything."""

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """Before Trainer's loop: on several nodes, check output_dir's storage; resume through ``resuming.prepare``
        (the checkpoint chosen and audited, a damaged one refused in one line before anything loads; another number
        of processes prepared)."""
        # several nodes: is output_dir shared? (refused here if that breaks)
        self._storage = nodes.detect(self.args, torchrun.local_world_size())
        nodes.check(self._storage, self.args)
        asked = resume_from_checkpoint
        self._resume = resuming.prepare(self, resume_from_checkpoint)
        if self._resume.checkpoint is not None or self._resume.fresh:  # None with True: Trainer says none was found
            resume_from_checkpoint = self._resume.checkpoint
        if self._mirror is not None:  # the mirror's lease: a new run may not train over another run's checkpoints
            self._mirror.begin(self, resuming=bool(asked or resume_from_checkpoint))
        self._checkpoints.start_memory_tier(self._resume.checkpoint)
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        except BaseException:  # a checkpoint still being written is not committed: the run stopped before it was whole
            self._checkpoints.abandon()
            raise
        finally:  # a failed run too gives the signals back their handlers; a preempted one is exiting
            if self._preemption is not None and not self._preemption.stopping:
                self._preemption.restore()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Trainer's, except where trl_ext's checkpoints need otherwise (``resuming.Resume.load_weights``)."""
        model = model if model is not None else self.model
        if not self._resume.load_weights(self, resume_from_checkpoint, model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_rng_state(self, checkpoint):
        """On another number of processes, rank r takes rank r's saved RNG state (``resuming.Resume.load_rng``)."""
        if checkpoint is None:
            return super()._load_rng_state(checkpoint)
        return self._resume.load_rng(self, checkpoint, super()._load_rng_state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Under FSDP2 the optimizer states stay sharded (DCP, one part per rank) and the weights are not written a
        second time: ``save_model`` already wrote them in the Hub's layout. Otherwise, Trainer's own."""
        if not fsdp.is_fsdp2(self.accelerator):
            return super()._save_optimizer_and_scheduler(output_dir)
        from accelerate.utils import save_fsdp_optimizer
        from transformers.trainer import SCHEDULER_NAME

        # Not super(): Trainer's FSDP branch would also write the weights again (save_fsdp_model); the scheduler line
        # below is the rest of that branch.

        with fsdp.sharded_optimizer_states(self.accelerator) as plugin:
            save_fsdp_optimizer(plugin, self.accelerator, self.optimizer, self.model, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Trainer's, reading the sharded optimizer states written above under FSDP2; states written in the other
        layout (a one-process checkpoint resumed under FSDP2, or the reverse) are converted
        (``resuming.Resume.load_optimizer``)."""
        if checkpoint is not None and self._resume.load_optimizer(self, checkpoint):
            return None
        if checkpoint is None or not fsdp.is_fsdp2(self.accelerator):
            return super()._load_optimizer_and_scheduler(checkpoint)
        with fsdp.sharded_optimizer_states(self.accelerator):
            return super()._load_optimizer_and_scheduler(checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save through trl_ext's one save path (gathered, streamed, verified, committed atomically)."""
        if (self.is_fsdp_enabled and not self.accelerator.is_fsdp2) or not saving.supports(self.model):
            return super().save_model(output_dir, _internal_call)  # FSDP1's flat parameters: transformers' path
        try:
            saving.save(self.model, output_dir or self.args.output_dir, processing_class=self.processing_class,
                        training_args=self.args,
                        max_shard_size=SaveOptions.of(self.args).max_shard_size,
                        is_writer=self.writes_files(), into=self._checkpoints.collecting)
        except CheckpointError as exc:
            diverged = self._diverged(exc)
            if diverged is None:
                raise
            raise diverged from exc
        if self._mirror is not None and not _internal_call and self.writes_files():  # a checkpoint's own: committed()
            self._mirror.model_saved(output_dir or self.args.output_dir)
        if self.args.push_to_hub and not _internal_call:  # as Trainer.save_model does
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def writes_files(self) -> bool:
        """Whether this rank writes saved files: the main process, or on several nodes without shared storage, each
        node's first process (every copy of output_dir needs its own files).

        Returns:
            True on the ranks that create, commit and rotate checkpoints and saved models.
        """
        return self._storage.checkpoint_writer(self.args) if self._storage else self.args.should_save

    def write_states(self, directory: str) -> None:
        """Write what a checkpoint holds besides the weights, as Trainer writes it there: the optimizer and scheduler
        states and this rank's RNG state (the background checkpoints' reserve measures and copies them).

        Args:
            directory: where to write them.
        """
        self._save_optimizer_and_scheduler(directory)
        self._save_rng_state(directory)

    def _diverged(self, exc: CheckpointError) -> CheckpointError | None:
        """A save refused because the weights hold NaN or inf means training diverged: say when, and what to resume."""
        if exc.kind != NONFINITE:
            return None
        step = self.state.global_step
        last = last_committed(self.args.output_dir)
        resume = (f"resume from it (resume_from_checkpoint='{last}') with a lower learning_rate or max_grad_norm"
                  if last else "start again with a lower learning_rate or max_grad_norm")
        return CheckpointError(f"training diverged at step {step}; last good checkpoint: {last or 'none'} (the weights "
                               f"at step {step} hold NaN or inf: {exc.detail}). Nothing was saved for step {step}; "
                               f"{resume}.", kind=DIVERGED)

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint save, written into a hidden directory and renamed to checkpoint-N once complete; with
        ``save_in_background``, its files copied here and written while training goes on (``saving.checkpoints``)."""
        if trial is not None or self.hp_search_backend is not None or not patches.applies("partial-checkpoint-dir"):
            return super()._save_checkpoint(model, trial)
        self._take_checkpoint(model, memory=False)

    def _take_checkpoint(self, model, memory: bool) -> None:
        """Trainer's own ``_save_checkpoint``, writing into the hidden directory ``saving.checkpoints`` gives it, of
        the output directory or, with ``memory``, of the memory tier."""

        def save_checkpoint(partial_dir: str) -> None:
            # Trainer builds the checkpoint path from _get_output_dir(): point it at the hidden partial directory.
            with patches.swapped("partial-checkpoint-dir", self, "_get_output_dir", lambda trial=None: partial_dir):
                super(TrlExtMixin, self)._save_checkpoint(model, None)

        saving_flag = self.control.should_save
        self.control.should_save = True  # as Trainer's own save records it in the trainer state
        try:
            self._checkpoints.take(f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}", save_checkpoint, memory=memory)
        finally:
            self.control.should_save = saving_flag

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        """Trainer's step-end logging, evaluation and checkpoint; then, every ``memory_checkpoint_steps`` steps, a
        checkpoint in memory (``saving.memory_tier``), at the same point of the step as Trainer's own."""
        super()._maybe_log_save_evaluate(*args, **kwargs)
        memory = self._checkpoints.memory
        if (memory is not None and memory.due(self.state, self.control, self._checkpoints.taken_step)
                and patches.applies("memory-checkpoint-point") and patches.applies("partial-checkpoint-dir")):
            self._take_checkpoint(self.model_wrapped, memory=True)

    def create_model_card(self, *args, **kwargs):
        """TRL's; at a checkpoint, only when the card would change (``saving.trainer_files.ModelCard``)."""
        write = functools.partial(super().create_model_card, *args, **kwargs)
        checkpoints = getattr(self, "_checkpoints", None)  # None while TRL's constructor runs
        return write() if checkpoints is None else checkpoints.write_model_card(write, (args, kwargs))

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        trl_base = cls.__mro__[cls.__mro__.index(TrlExtMixin) + 1]

        # Show TRL's exact signature and docs (help(), IDEs, inspect) while running the mixin's __init__.
        @functools.wraps(trl_base.__init__)
        def __init__(self, *args, **kwargs):
            TrlExtMixin.__init__(self, *args, **kwargs)

        cls.__init__ = __init__
        cls._trl_class = trl_base
        if cls._dataset_kind is not None:  # its TRL class's dataset preparation is wrapped: the patch's guard probes it
            patches.DATASET_PREPARERS.add(f"{trl_base.__module__}.{trl_base.__qualname__}")
        cls._trl_config_class = next(c for c in cls._config_class.__mro__ if c.__module__.startswith("trl."))


def guard_save_pretrained(model) -> None:
    """Make ``model.save_pretrained(dir)`` refuse, with the fix, while its parameters are ZeRO-3 placeholders.

    A plain ``save_pretrained`` would write the empty ``(0,)`` shards silently (patch ``save-pretrained-guard``).
    """

    def refuse(target) -> str | None:
        if not sharded.has_partitioned_params(target):
            return None
        return (f"{type(target).__name__}.save_pretrained() cannot save a DeepSpeed ZeRO-3 model: each rank holds only "
                "a slice of every parameter, so the file would contain empty torch.Size([0]) tensors. Call "
                "trainer.save_model(output_dir) on every rank instead (it gathers the weights, writes them from one "
                "rank and verifies the result), or trl_ext.saving.save(model, output_dir) on every rank.")

    _refuse_save_pretrained(model, refuse)


def _refuse_save_pretrained(model, refuse: Callable[[object], str | None]) -> None:
    """Make ``model.save_pretrained(dir)`` raise ``RuntimeError(refuse(model))`` whenever ``refuse`` returns a message
    (patch ``save-pretrained-guard``). Calls that pass their own ``state_dict`` (what Trainer does) are left alone.

    Args:
        model: a transformers or PEFT model; for PEFT the base model's method is guarded too.
        refuse: returns the message to raise with, or None to save as usual.
    """
    if not patches.applies("save-pretrained-guard"):
        return
    targets = [model, model.get_base_model()] if hasattr(model, "get_base_model") else [model]
    for target in targets:
        original = target.save_pretrained

        def guarded(save_directory, *args, _original=original, _model=target, **kwargs):
            message = refuse(_model) if kwargs.get("state_dict") is None else None
            if message:
                raise CheckpointError(message, kind="zero3-placeholders")
            return _original(save_directory, *args, **kwargs)

        target.save_pretrained = guarded
