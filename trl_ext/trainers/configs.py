"""What trl_ext's config classes add to TRL's (each is defined beside its trainer: ``sft.SFTConfig``, ...): adapted to
the hardware before validation (``HardwareAware``, see ``runtime.adapt_to_hardware``), and the options below.

They are subclasses: every field, default and CLI flag is TRL's, and ``isinstance(cfg, trl.DPOConfig)`` holds.
Fields added: ``max_shard_size`` for trl_ext's save path, ``save_in_background``, ``save_on_preemption`` and the
checkpoint mirror's ``checkpoint_mirror``, ``mirror_storage_options``, ``mirror_grace_period`` and
``mirror_exit_grace_period`` (every config), and
``vllm_request_timeout``, ``vllm_check_sync_every`` and ``vllm_check_sync_atol`` (GRPO, RLOO).
"""

from dataclasses import dataclass, field

from trl_ext.engines.runtime import adapt_to_hardware
from trl_ext.errors import ConfigTypeError
from trl_ext.process import warning_filter


class HardwareAware:
    """Settings the hardware cannot honour changed, with one line, before TRL's and transformers' checks."""

    def __post_init__(self):
        warning_filter.quiet_known_noise()  # before TrainingArguments warns about TRL's own default
        adapt_to_hardware(self)
        super().__post_init__()


@dataclass
class SaveOptions:
    """The save path's options (every config)."""

    max_shard_size: str = field(
        default="50GB",
        metadata={"help": "Largest safetensors file a full-model save writes (e.g. '5GB'). Saving streams tensor by "
                          "tensor, so this does not change memory use."},
    )
    save_in_background: bool = field(
        default=False,
        metadata={"help": "Write checkpoint-N's weights while training goes on: a checkpoint blocks training only "
                          "while each rank copies its own part of the weights to CPU memory (and while the optimizer "
                          "states are written, as before). The checkpoint appears, and older ones are rotated out, "
                          "once it is written and verified; a failure stops training on every rank at the next step. "
                          "The run's last checkpoint and trainer.save_model() are written in the foreground."},
    )
    save_on_preemption: bool = field(
        default=True,
        metadata={"help": "On SIGTERM or SIGUSR1 (a scheduler preempting the job) to any rank, every rank stops at the "
                          "next step boundary, the checkpoint of that step is saved, and the processes exit with code "
                          "128 + the signal's number (143 for SIGTERM). False: the signals keep their default action."},
    )
    checkpoint_mirror: str | None = field(
        default=None,
        metadata={"help": "Mirror every committed checkpoint-N and the final model to this fsspec URL, in the "
                          "background (e.g. 's3://bucket/run'; also gs://, az://, hf://, file://): files uploaded in "
                          "parallel, a manifest of sizes and checksums written last, save_total_limit applied there "
                          "too. resume_from_checkpoint=True on a machine whose output_dir holds no checkpoint "
                          "downloads the newest complete one, checked, and resumes. Needs s3fs for s3:// "
                          "(pip install s3fs)."},
    )
    mirror_storage_options: dict | str | None = field(
        default=None,
        metadata={"help": "fsspec storage options for checkpoint_mirror, as a dict or JSON (e.g. '{\"endpoint_url\": "
                          "\"https://...\"}'). Credentials are best left to the store's standard chain (environment "
                          "variables, config files, instance roles); secrets given here are never logged or saved."},
    )
    mirror_grace_period: float = field(
        default=20.0,
        metadata={"help": "Seconds a preempted run (SIGTERM, SIGUSR1) waits for its stopping checkpoint to reach "
                          "checkpoint_mirror before it exits; past them the log says the checkpoint is only local. "
                          "A process that gets SIGTERM while it finishes its uploads at exit waits as long. Keep it "
                          "below the scheduler's grace period less the save."},
    )
    mirror_exit_grace_period: float = field(
        default=600.0,
        metadata={"help": "Seconds a process that exits (a script that returned, or raised) waits for the uploads to "
                          "checkpoint_mirror still queued (the final model, the last checkpoints) before it ends; "
                          "past them, or once the store has not answered for 300 s, it ends all the same and says "
                          "what stayed only local, kept in output_dir for the next run to upload."},
    )

    def __post_init__(self):
        if self.checkpoint_mirror:
            from trl_ext.mirror import options

            self.checkpoint_mirror = options.check_url(self.checkpoint_mirror)
        if self.mirror_storage_options is not None:
            from trl_ext.mirror import options

            self.mirror_storage_options = options.parse(self.mirror_storage_options)  # secrets kept out of the config
        super().__post_init__()


VLLM_REQUEST_TIMEOUT = 600.0  # seconds; a generation request for a large batch can legitimately take minutes


@dataclass
class VLLMServerOptions:
    """Bounded waits on a vLLM server (GRPO, RLOO)."""

    vllm_request_timeout: float = field(
        default=VLLM_REQUEST_TIMEOUT,
        metadata={"help": "Server mode (vllm_mode='server'): seconds to wait for each answer of the vLLM server, and "
                          "(plus 30 s) for each weight sync. A server that stalls or dies stops training on every "
                          "rank within this bound, with a message naming the server and the step."},
    )


@dataclass
class VLLMSyncCheckOptions:
    """The proof that a weight sync landed in vLLM (GRPO, RLOO, colocate mode)."""

    vllm_check_sync_every: int = field(
        default=1,
        metadata={"help": "Colocate mode (use_vllm=True, vllm_mode='colocate'): after the first weight sync and every "
                          "Nth after it, compare vLLM's prompt log-probabilities on a few fixed tokens with the "
                          "trainer's; a sync that did not land stops training with an error naming the tensors. "
                          "0 turns the check off."},
    )
    vllm_check_sync_atol: float = field(
        default=1e-3,
        metadata={"help": "Largest difference allowed between vLLM's and the trainer's log-probabilities in the sync "
                          "check. 1e-3 fits fp32; raise it for bf16 or fp16 weights."},
    )


def from_training_arguments(args, config_class: type, trl_trainer: type):
    """The config a trainer trains with when it is given a plain ``transformers.TrainingArguments``.

    TRL's trainers that declare ``TrainingArguments`` for ``args`` (``SFTTrainer``) convert it into their config with
    ``to_dict()``; here it becomes the matching trl_ext config, a subclass of TRL's, so TRL keeps it as it is and
    trl_ext's checks see the same values TRL trains with. The others (``DPOTrainer``, ``RewardTrainer``) would fail
    on a missing field deep inside their constructor: they are refused with the fix.

    Args:
        args: the ``args`` the user passed (anything that is not ``config_class``'s TRL config).
        config_class: the trl_ext config for this trainer (``trl_ext.SFTConfig``, ...).
        trl_trainer: TRL's trainer class.

    Returns:
        ``args`` converted to ``config_class``, or ``args`` unchanged when it is not a ``TrainingArguments`` (TRL
        reports that).

    Raises:
        errors.ConfigTypeError: ``trl_trainer`` does not accept a plain ``TrainingArguments``.
    """
    import inspect

    from transformers import TrainingArguments

    if not isinstance(args, TrainingArguments):
        return args
    annotation = inspect.signature(trl_trainer.__init__).parameters["args"].annotation
    if "TrainingArguments" not in str(annotation):
        trl_config = config_class.__name__  # trl_ext's configs carry TRL's names
        raise ConfigTypeError(f"{trl_trainer.__name__} needs a {trl_config}, not a {type(args).__name__} (TRL converts "
                        f"one only for SFTTrainer): build the config as {trl_config}(output_dir=..., ...), or convert "
                        f"it with {trl_config}(**args.to_dict())")
    values = args.to_dict()
    values["hub_token"] = args.hub_token  # to_dict() hides it
    # trl_ext's own options set on the TrainingArguments object (args.checkpoint_mirror = "s3://...") come along
    values.update({name: value for name, value in vars(args).items()
                   if name in config_class.__dataclass_fields__ and name not in values})
    return config_class(**values)
