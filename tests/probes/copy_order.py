"""The order of a background checkpoint's copies and the next step's work, recorded, with the copies slowed on purpose
(tests/scripts/train.py ``--slow_copy``, ``--unguarded_copy``; tests/unit/test_background_saves.py).

``CopyOrder(trainer, step)`` holds checkpoint-``step``'s copies on their thread until the next step's backward has
begun (its loss's gradient hook): that step's forward and backward then run while the copies are still to be made, and
the optimizer step must wait for them. With ``guarded=False`` the wait before the optimizer step is removed and the
copies are held until that step has ended (DeepSpeed's 16-bit weights, rewritten after the optimizer step, included):
the checkpoint then holds the next step's values, which a test must notice. Events, not timings: the order is the
same on a loaded machine as on an idle one (a hold that is never released fails after 120 s).
"""

import threading
import time

from transformers import TrainerCallback

HOLD_S = 120


class CopyOrder(TrainerCallback):
    """Records ``(event, step, time.monotonic())``: ``forward`` and ``backward`` (begun) of each step,
    ``copies_started`` and ``copies_done`` of checkpoint-``step``, ``optimizer_step`` (begun, after trl_ext's wait)
    and ``optimizer_stepped`` (ended)."""

    def __init__(self, trainer, step: int, guarded: bool = True):
        self.trainer, self.step, self.guarded, self.events = trainer, step, guarded, []
        self.backward_began, self.stepped = threading.Event(), threading.Event()
        self._hooked = False
        checkpoints = trainer.checkpoints
        release = checkpoints._release

        def releasing(checkpoint, on_commit):
            checkpoints.snapshot.on_copies = self._hold if checkpoint.name == f"checkpoint-{step}" else None
            return release(checkpoint, on_commit)

        checkpoints._release = releasing
        if not guarded:
            checkpoints.wait_for_copies = lambda: None  # what this probe shows is needed
        trainer.model.register_forward_pre_hook(lambda *args: self._record("forward"))
        compute_loss = trainer.compute_loss

        def computing_loss(*args, **kwargs):
            result = compute_loss(*args, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            if loss.requires_grad:
                loss.register_hook(self._backward)
            return result

        trainer.compute_loss = computing_loss

    def _record(self, event: str, step: int | None = None) -> None:
        self.events.append((event, self.trainer.state.global_step + 1 if step is None else step, time.monotonic()))

    def _backward(self, grad):
        self._record("backward")
        if self.trainer.state.global_step == self.step:
            self.backward_began.set()
        return grad

    def _hold(self, when: str) -> None:
        """On the copies' thread of checkpoint-``step``: held before they copy; the end recorded."""
        if when == "end":
            self._record("copies_done", self.step)
            return
        self._record("copies_started", self.step)
        if self.guarded:
            released = self.backward_began.wait(HOLD_S)
        else:
            released = self.stepped.wait(HOLD_S)
        if not released:
            raise RuntimeError(f"checkpoint-{self.step}'s copies were held and nothing released them")

    def on_step_begin(self, args, state, control, **kwargs):
        if self._hooked:
            return
        self._hooked = True  # after trl_ext's own pre-hook (registered when training began): it runs after the wait
        from trl_ext.saving.mode import torch_optimizers

        for optimizer in torch_optimizers(self.trainer):
            optimizer.register_step_pre_hook(lambda *a: self._record("optimizer_step"))
            optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *args):
        self._record("optimizer_stepped")

    def on_step_end(self, args, state, control, **kwargs):
        self._record("step_end", state.global_step)
        if state.global_step == self.step + 1:
            self.stepped.set()
