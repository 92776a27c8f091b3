"""trl_ext's options in a training config, typed, each default defined here and nowhere else.

Each group is a frozen dataclass that lists its options with their types, defaults and help:

    SaveOptions            max_shard_size, save_in_background, save_on_preemption,
                           memory_checkpoint_steps                                      (every config)
    MirrorOptions          checkpoint_mirror, mirror_storage_options, mirror_grace_period,
                           mirror_exit_grace_period                                     (every config)
    VLLMServerOptions      vllm_request_timeout                                         (GRPO, RLOO)
    VLLMSyncCheckOptions   vllm_check_sync_every, vllm_check_sync_atol                  (GRPO, RLOO)

trl_ext's configs take their fields from these groups (``config_fields``): the same names, defaults and CLI flags.
A component reads its group with ``Group.of(args)`` where it uses the values, so an edit to ``trainer.args`` before
``train()`` counts for what is read during training (saves, preemption, the mirror's waits); the vLLM waits and
checks are read when the trainer is built, since TRL builds its vLLM client in its constructor. A plain TRL config
(``trl.DPOConfig``) has none of these fields: ``of`` gives the defaults.
"""

from dataclasses import dataclass, field, fields, make_dataclass


class _Group:
    """What every group shares: reading itself from a config."""

    @classmethod
    def of(cls, args):
        """This group's values in a training config.

        Args:
            args: a training config (trl_ext's, TRL's or transformers' ``TrainingArguments``), or None.

        Returns:
            The group, each option as ``args`` holds it, or its default where ``args`` has no such field.
        """
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


@dataclass(frozen=True)
class SaveOptions(_Group):
    """The save path's options (every config)."""

    max_shard_size: str = field(
        default="50GB",  # transformers' default
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
    memory_checkpoint_steps: int = field(
        default=0,
        metadata={"help": "Also keep a checkpoint in this machine's memory every N steps (0: none): written in the "
                          "background into TRL_EXT_MEMORY_DIR (default /dev/shm/trl_ext), the newest one kept. A run "
                          "that is restarted (by its orchestrator, or resume_from_checkpoint=True) resumes from it "
                          "when it is newer than the newest disk checkpoint. One machine only: on several it stays "
                          "off, said in one line."},
    )


@dataclass(frozen=True)
class MirrorOptions(_Group):
    """The checkpoint mirror's options (every config)."""

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


@dataclass(frozen=True)
class VLLMServerOptions(_Group):
    """Bounded waits on a vLLM server (GRPO, RLOO)."""

    vllm_request_timeout: float = field(
        default=600.0,  # a generation request for a large batch can legitimately take minutes
        metadata={"help": "Server mode (vllm_mode='server'): seconds to wait for each answer of the vLLM server, and "
                          "(plus 30 s) for each weight sync. A server that stalls or dies stops training on every "
                          "rank within this bound, with a message naming the server and the step."},
    )


@dataclass(frozen=True)
class VLLMSyncCheckOptions(_Group):
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


GROUPS = (SaveOptions, MirrorOptions, VLLMServerOptions, VLLMSyncCheckOptions)
NAMES = frozenset(f.name for group in GROUPS for f in fields(group))  # every trl_ext option of a config


def config_fields(group: type) -> type:
    """A plain dataclass with ``group``'s fields (names, types, defaults, help), for a config class to inherit: the
    config's fields and CLI flags are the group's, defined once.

    Args:
        group: one of ``GROUPS``.

    Returns:
        A dataclass, not frozen (``TrainingArguments`` sets fields after it is built), named ``<group>Fields``.
    """
    made = make_dataclass(group.__name__.replace("Options", "Fields"),
                          [(f.name, f.type, field(default=f.default, metadata=f.metadata)) for f in fields(group)])
    made.__module__, made.__doc__ = __name__, f"The fields of ``{group.__name__}``, for a config class."
    return made
