"""Every exception trl_ext raises. Each carries a ``kind`` that code tests; the message is for people, and no code
ever matches its text.

Each error also subclasses the built-in exception that fits its case (``RuntimeError``, ``ValueError``,
``FileNotFoundError``, ``SystemExit``), so that a user's ``except ValueError`` catches a bad value whether TRL or
trl_ext refuses it.
An error keeps its class, kind and detail when it crosses ranks (``agree``: pickled, sent, raised on every rank).
"""

from trl_ext.process.collectives import from_every_rank
from trl_ext.process.ranks import env_rank

# Kinds that code branches on.
NONFINITE = "nonfinite"  # a save refused because the weights hold NaN or inf: training diverged
DIVERGED = "diverged"  # the trainer's message for a NONFINITE save: when it diverged and what to resume
VERIFICATION = "verification"  # written files that failed their check (kept for inspection)
ABANDONED = "abandoned"  # a mirror's transfer stopped on purpose (a grace period ran out)
STALLED = "stalled"  # a mirror's store silent too long after training ended: the uploads stop
LOCAL_FILE = "local-file"  # a local file a mirror could not read or write (never retried)
GAVE_UP = "gave-up"  # a run that failed too often in a row without a new checkpoint (placement.failure_limit)


class TrlExtError(Exception):
    """Base of trl_ext's errors.

    Args:
        message: one line (or a few) saying what is wrong and how to fix it.
        kind: what went wrong, for code to test (each class has its default).
        detail: the one problem that decided ``kind`` (a tensor's line of a verification report, say), if any.
    """

    kind = "error"

    def __init__(self, message: str = "", kind: str | None = None, detail: str | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind
        self.detail = detail

    def __reduce__(self):  # the same class, kind and detail on the rank that unpickles it
        return type(self), (str(self), self.kind, self.detail)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointError(TrlExtError, RuntimeError):
    """A save failed or its files failed verification (nothing was committed), or a checkpoint failed its audit."""

    kind = "checkpoint"


class ResumeError(CheckpointError, ValueError):
    """A checkpoint that this run cannot resume from (damaged, missing on some node, or saved with a batch size that
    cannot be kept); nothing was loaded or changed. A ``CheckpointError`` (the checkpoint is at fault) and a
    ``ValueError`` (the ``resume_from_checkpoint`` given cannot be used), so that either ``except`` catches it."""

    kind = "resume"


class MergeError(TrlExtError, RuntimeError):
    """An adapter that cannot be merged as asked; the message says why and what to do."""

    kind = "merge"


class AdapterError(TrlExtError, ValueError):
    """An adapter the streamed merge cannot apply; the message is one line for the user."""

    kind = "adapter"


class PlanError(TrlExtError, ValueError):
    """An adapter that does not fit its base, or a model whose checkpoint layout cannot be planned; one line."""

    kind = "plan"


class UnreadableCheckpoint(TrlExtError, ValueError):
    """A file that is not valid safetensors, or holds a dtype we cannot stream."""

    kind = "unreadable"


class DatasetError(TrlExtError, ValueError):
    """A training or evaluation dataset that TRL cannot train on."""

    kind = "dataset"


class ConfigError(TrlExtError, ValueError):
    """Arguments or a config that cannot run together (bf16 with fp16, 8-bit QLoRA under ZeRO-3, a reward model with
    two labels, ...): refused before anything loads, with the fix."""

    kind = "config"


class ConfigTypeError(ConfigError, TypeError):
    """A config of the wrong class where TRL needs its own (a plain ``TrainingArguments`` for DPO, say)."""

    kind = "config-type"


class SetupError(TrlExtError, RuntimeError):
    """The processes, hardware or installed versions cannot run what was asked (a multi-process launch where each
    process trains alone, a release that lacks a fix, CUDA already initialised before a notebook launch)."""

    kind = "setup"


class NotFoundError(TrlExtError, FileNotFoundError):
    """A model or dataset path that does not exist."""

    kind = "not-found"


class ServerError(TrlExtError, ConnectionError):
    """A vLLM server that did not answer within its bound, or failed a request (server mode of GRPO and RLOO); Ray's
    GCS refusing a lost node's report."""

    kind = "server"


class SyncError(TrlExtError, RuntimeError):
    """A weight sync into vLLM that did not land: vLLM's log-probabilities differ from the trainer's after it (GRPO,
    RLOO with ``vllm_check_sync_every``); ``detail`` is the first tensor named."""

    kind = "sync"


class MirrorError(TrlExtError, RuntimeError):
    """A checkpoint mirror (``checkpoint_mirror``) that cannot be used: a store that refuses the credentials, a missing
    bucket, no permission to write, another run writing to the same prefix, or a mirrored checkpoint that does not
    match its manifest. Nothing local is changed."""

    kind = "mirror"


class RankError(TrlExtError, RuntimeError):
    """What ended one rank of a Ray Train worker group (``trl_ext.ray``), as the rank told it: ``kind`` "error" (an
    error of the run's own: a bug, bad data, a full disk) or "peer" (a collective lost its other end: a lost peer or
    node); the message is "rank R: <exception class>: <its first line>"."""

    kind = "error"


class RunFailed(TrlExtError, RuntimeError):
    """A run on a Ray cluster that failed (``trl_ext.ray.fit``, a submitted job's driver): ``kind`` "error" (an error
    of its own, not retried), "peer" (more lost workers than ``max_failures`` allows) or "setup" (a worker group that
    could not start)."""

    kind = "error"


class UsageError(SystemExit):
    """Bad input on the command line or in a config: one line on stderr, exit code 1, nothing started or written.

    Under a multi-process launch every rank checks the input and one of them says what is wrong; with ``every_rank``,
    each process says it (what one machine's environment gets wrong, the others' may not). A ``SystemExit`` (not a
    ``TrlExtError``): Python prints its message and exits with code 1, as argparse's errors do.
    """

    kind = "usage"

    def __init__(self, message: str, every_rank: bool = False):
        self.message = message
        self.every_rank = every_rank
        super().__init__(f"error: {message}" if every_rank or env_rank() == 0 else 1)

    def __reduce__(self):  # decided on one rank, raised on each: each says it, or not, by its own rank
        return type(self), (self.message, self.every_rank)

    def __str__(self) -> str:
        return f"error: {self.message}"


class GaveUp(SystemExit):
    """A run that failed too often in a row without a new checkpoint (``placement.failure_limit``): this attempt stops
    with exit code ``EXIT_CODE`` (202), which no example's orchestrator restarts. Global rank 0 says the one line; the
    other ranks raise it too (it is decided on rank 0), quietly.

    Args:
        message: the one line.
    """

    kind = GAVE_UP
    EXIT_CODE = 202  # above every 128 + signal; not 200 (restarted) or 201 (an error of the run's own)

    def __init__(self, message: str, quiet: bool = False):
        self.message = message
        if not quiet and env_rank() == 0:
            import sys

            print(f"[trl_ext] {message}", file=sys.stderr, flush=True)
        super().__init__(self.EXIT_CODE)

    def __reduce__(self):  # the copy another rank raises: rank 0 has said it
        return type(self), (self.message, True)

    def __str__(self) -> str:
        return self.message


def combined(failures: list[TrlExtError], prefer: tuple[str, ...] = ()) -> TrlExtError:
    """One error for several ranks' failures: the class, kind and detail of the first whose kind is in ``prefer``
    (else of the first), with every distinct message.

    Args:
        failures: the errors, in rank order (at least one).
        prefer: kinds that decide, in order (``NONFINITE`` before a plain save failure, say).

    Returns:
        The error to raise on every rank.
    """
    decisive = next((f for kind in prefer for f in failures if f.kind == kind), failures[0])
    messages = list(dict.fromkeys(str(f) for f in failures))
    if len(messages) == 1:
        return decisive
    return type(decisive)("\n".join(messages), kind=decisive.kind, detail=decisive.detail)


def across_ranks(error: TrlExtError | None, group=None, prefer: tuple[str, ...] = ()) -> TrlExtError | None:
    """Every rank's outcome, on every rank: the error any rank had (``combined``, with its class and kind), or None.
    A collective on ``group`` (default: the default group) when distributed.

    Args:
        error: this rank's failure, or None.
        group: the process group the ranks agree on.
        prefer: kinds that decide which failure's class and kind the others take.

    Returns:
        The agreed failure, the same on every rank, or None when every rank succeeded.
    """
    failures = [e for e in from_every_rank(error, group) if e is not None]
    return combined(failures, prefer) if failures else None


def agree(error: TrlExtError | None, group=None, prefer: tuple[str, ...] = ()) -> None:
    """``across_ranks``, raising the agreed failure on every rank.

    Raises:
        TrlExtError: the failure of some rank, of its class and kind, on every rank.
    """
    failure = across_ranks(error, group, prefer)
    if failure is not None:
        raise failure
