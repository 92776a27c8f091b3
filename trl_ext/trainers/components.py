"""What joins a trl_ext trainer beside TRL's loop, and in which order: the trainer's extension points.

Each component joins through one hook, ``TrlExtMixin.join(callback, first=..., committed=...)``, called while the
trainer is built, in this order (a later one's callback runs after an earlier one's, and its ``committed`` after
theirs):

1. checkpoints: ``saving.checkpoints.Checkpoints`` (``trainer.checkpoints``), each ``checkpoint-N`` from ``take`` to
   retention; its callback after TRL's and the user's own;
2. the mirror: ``mirror.Mirror`` (``trainer.mirror``), its ``Progress`` first of all callbacks (the lease renewed
   and the lag logged before TRL's loggers write the step's metrics), and its upload queued once each checkpoint is
   committed;
3. preemption: ``trainers.preemption.Preemption`` (``trainer.preemption``), which replaces transformers'
   ``JITCheckpointCallback``;
4. the orchestrator's own, made for every trainer built inside ``joining(...)`` (``trl_ext.ray``: what Ray sees of
   the run, a watch for nodes that join), in the order given.

What the components read of the trainer is public: ``trainer.checkpoints``, ``trainer.mirror``,
``trainer.preemption``, ``trainer.storage``, ``trainer.writes_files()`` and ``trainer.write_states(directory)``.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator

# The factories of the ``joining`` blocks this context is in: scoped to the block, never shared by a class.
_joining: contextvars.ContextVar[tuple[Callable, ...]] = contextvars.ContextVar("trl_ext_joining", default=())


@contextlib.contextmanager
def joining(*factories: Callable) -> Iterator[None]:
    """Every trl_ext trainer built inside the block (on this thread) calls each ``factory(trainer)`` last, in order:
    each joins the trainer through ``trainer.join`` (step 4 of the order above). For an orchestrator that runs a
    recipe it does not write (``trl_ext.ray``'s workers).

    Args:
        factories: functions of the trainer; each calls ``trainer.join`` with what it adds.
    """
    token = _joining.set(_joining.get() + factories)
    try:
        yield
    finally:
        _joining.reset(token)


def orchestrators_own() -> tuple[Callable, ...]:
    """The factories of the ``joining`` blocks the caller is in, outermost first."""
    return _joining.get()
