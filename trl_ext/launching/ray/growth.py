"""An elastic worker group below its maximum grows again when nodes join, after saving the work since the last
checkpoint.

Ray Train's own resize would shut the workers down within 5 s, whatever they were doing, and restart from the last
checkpoint; trl_ext turns it off (``group``) and does this instead. Rank 0 looks at the cluster's free resources every
``CHECK_SECONDS``; once they hold another worker, it asks the trainer for a planned stop (``Preemption.request_stop``):
at the next step boundary every rank agrees, the step's checkpoint is saved and committed, and the group ends with
``{GROW: step}``. The driver then starts the group again with what the cluster now has, and it resumes from that
checkpoint.

It grows only where the resumed group can keep the run's global batch (``resuming``: the per-device batch stays, the
gradient accumulation divides): a run that started on 2 workers with no accumulation cannot continue on 4, and stays
at 2, said once.
"""

import threading

from transformers import TrainerCallback

from trl_ext.launching.ray import cluster
from trl_ext.process.notices import notice

CHECK_SECONDS = 10.0


class Growth(TrainerCallback):
    """Rank 0's watch for room to grow.

    Args:
        trainer: the trainer (its ``preemption`` stops every rank with a checkpoint).
        workers: the group's size now.
        most: the range's maximum.
        per_worker: each worker's resources.
    """

    def __init__(self, trainer, workers: int, most: int, per_worker: dict):
        self.trainer, self.workers, self.most, self.per_worker = trainer, workers, most, per_worker
        self.done = threading.Event()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer.preemption is None:
            notice("save_on_preemption is off: the Ray worker group cannot save before it grows, so it stays at "
                   f"{self.workers} worker(s)")
            return
        threading.Thread(target=self._watch, name="trl_ext-ray-growth", daemon=True).start()

    def on_train_end(self, args, state, control, **kwargs):
        self.done.set()

    def _watch(self) -> None:
        import ray

        said = False
        while not self.done.wait(CHECK_SECONDS):
            try:
                free = cluster.room([ray.available_resources()], self.per_worker)
            except (ConnectionError, TimeoutError, ray.exceptions.RayError):  # the cluster not answering now: next time
                continue
            except Exception as exc:  # noqa: BLE001 - an error of our own would only repeat: said once, watch ends
                notice(f"Ray: the watch for room to grow stopped ({type(exc).__name__}: {exc}); the worker group "
                       f"stays at {self.workers} worker(s)")
                return
            if free <= 0:
                continue
            more = min(free, self.most - self.workers)
            accumulation = self.trainer.args.gradient_accumulation_steps
            if not keeps_global_batch(self.workers, accumulation, self.workers + more):
                if not said:
                    said = True
                    batch = self.trainer.args.per_device_train_batch_size
                    notice(f"Ray: room for {more} more worker(s), but the run's global batch ({self.workers} "
                           f"worker(s) x {accumulation} accumulated batch(es) of {batch}) cannot be kept on "
                           f"{self.workers + more}: the worker group stays at {self.workers}. A run that starts at the "
                           "range's maximum can shrink and grow back")
                continue
            notice(f"Ray: room for {more} more worker(s) (the range's maximum is {self.most}): the worker group "
                   "stops at the next step with a checkpoint, and starts again larger")
            self.trainer.preemption.request_stop("Ray: growing the worker group")
            return


def keeps_global_batch(workers: int, accumulation: int, grown: int) -> bool:
    """Whether a group of ``workers`` accumulating ``accumulation`` batches can resume on ``grown`` workers with the
    same global batch and per-device batch (``resuming.world_size``).

    Args:
        workers: the group's size now.
        accumulation: its gradient accumulation steps.
        grown: the size it would restart at.

    Returns:
        True when ``grown`` divides ``workers * accumulation``.
    """
    return (workers * accumulation) % grown == 0
