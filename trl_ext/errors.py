"""Every exception trl_ext raises. Each carries a ``kind`` that code tests; the message is for people, and no code
ever matches its text.

Each error also subclasses the built-in exception it always was (``RuntimeError``, ``ValueError``, ``SystemExit``),
so ``except ValueError`` in a user's code still catches what it caught before.
"""

from trl_ext.process import env_rank

# Kinds that code branches on.
NONFINITE = "nonfinite"  # a save refused because the weights hold NaN or inf: training diverged
DIVERGED = "diverged"  # the trainer's message for a NONFINITE save: when it diverged and what to resume


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


class CheckpointError(TrlExtError, RuntimeError):
    """A save failed or its files failed verification (nothing was committed), or a checkpoint failed its audit."""

    kind = "checkpoint"


class MergeError(TrlExtError, RuntimeError):
    """An adapter that cannot be merged as asked; the message says why and what to do."""

    kind = "merge"


class AdapterError(TrlExtError, ValueError):
    """An adapter the streamed merge cannot apply; the message is one line for the user."""

    kind = "adapter"


class PlanError(TrlExtError, ValueError):
    """An adapter that does not fit its base; the message is one line."""

    kind = "plan"


class UnreadableCheckpoint(TrlExtError, ValueError):
    """A file that is not valid safetensors, or holds a dtype we cannot stream."""

    kind = "unreadable"


class DatasetError(TrlExtError, ValueError):
    """A training or evaluation dataset that TRL cannot train on."""

    kind = "dataset"


class ServerError(TrlExtError, ConnectionError):
    """A vLLM server that did not answer within its bound, or failed a request (server mode of GRPO and RLOO)."""

    kind = "server"


class UsageError(SystemExit):
    """Bad input on the command line or in a config: one line on stderr, exit code 1, nothing started or written.

    Under a multi-process launch every rank checks the input and one of them says what is wrong. A ``SystemExit``
    (not a ``TrlExtError``): Python prints its message and exits with code 1, as argparse's errors do.
    """

    kind = "usage"

    def __init__(self, message: str):
        self.message = message
        super().__init__(f"error: {message}" if env_rank() == 0 else 1)

    def __str__(self) -> str:
        return f"error: {self.message}"
