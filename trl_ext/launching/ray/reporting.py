"""What Ray sees of a run: its metrics and each committed checkpoint, in ``ray.train.report``.

At each checkpoint save, and once at the end, every rank reports the metrics logged since the run began (the newest
value of each); rank 0 adds the newest checkpoint committed since its last report, registered with Ray where it is
(``CheckpointUploadMode.NO_UPLOAD``: no copy, no upload; the run's output directory is Ray's storage for the run, see
``group``). It then is the run's ``Result.checkpoint`` and is listed in the dashboard. A checkpoint committed in the
background is registered at the report after its commit.

``ray.train.report`` is a barrier of every rank, and it waits until Ray's controller has taken the previous report
(its poll, every 2 s). It runs on a thread of its own in each worker, in the order the ranks asked, so that training
never waits for Ray; ``flush`` waits for it at the end.
"""

import queue
import threading

from transformers import TrainerCallback

from trl_ext.process.notices import notice


class RayReport(TrainerCallback):
    """The trainer's reports to Ray (``join`` adds one to a trainer)."""

    def __init__(self):
        self.metrics = {}
        self.pending = None  # rank 0: the newest committed checkpoint not reported yet

    @classmethod
    def join(cls, trainer) -> "RayReport":
        """A report for ``trainer``, joined to its loop; its committed checkpoints are heard on rank 0, the writer.

        Args:
            trainer: a trl_ext trainer.

        Returns:
            The report.
        """
        report = cls()
        trainer.join(report, committed=report._committed)
        return report

    def _committed(self, path, step) -> None:  # on the rank that writes, where the checkpoint is committed
        self.pending = str(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.metrics.update({k: v for k, v in (logs or {}).items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def on_save(self, args, state, control, **kwargs):
        checkpoint, self.pending = self.pending, None
        _reporter().put({**self.metrics, "step": state.global_step}, checkpoint)
        _last[0] = self


_last = [None]  # the report callback that reported last: the final report carries its metrics


def flush() -> None:
    """The final report (every rank: the newest metrics, and on rank 0 a checkpoint committed since the last report),
    then wait until Ray has taken every report."""
    callback = _last[0]
    metrics, checkpoint = ({}, None) if callback is None else (dict(callback.metrics), callback.pending)
    if callback is not None:
        callback.pending = None
    reporter = _reporter()
    reporter.put(metrics, checkpoint)
    reporter.wait()


class _Reporter:
    """This worker's reports, one after another, on a thread of its own."""

    def __init__(self):
        self.queue = queue.Queue()
        self.said_outside = False
        threading.Thread(target=self._run, name="trl_ext-ray-report", daemon=True).start()

    def put(self, metrics: dict, checkpoint: str | None) -> None:
        self.queue.put((metrics, checkpoint))

    def wait(self) -> None:
        self.queue.join()

    def _run(self) -> None:
        while True:
            metrics, checkpoint = self.queue.get()
            try:
                _report(metrics, self._managed(checkpoint))
            except Exception as exc:  # noqa: BLE001 - what Ray sees must never end the run
                notice(f"Ray: a report failed ({type(exc).__name__}: {exc}); training goes on")
            finally:
                self.queue.task_done()

    def _managed(self, checkpoint: str | None) -> str | None:
        """The checkpoint, if it lies in Ray's storage for the run (else Ray would need a copy: not registered)."""
        if checkpoint is None:
            return None
        import os

        import ray.train

        storage = os.path.realpath(ray.train.get_context().get_storage().experiment_fs_path)
        if os.path.realpath(checkpoint).startswith(storage + os.sep):
            return checkpoint
        if not self.said_outside:
            self.said_outside = True
            notice(f"Ray: {checkpoint} is outside the run's Ray storage {storage}: checkpoints are not registered "
                   "with Ray (pass the trainer's output_dir to trl_ext.ray.fit)")
        return None


def _report(metrics: dict, checkpoint: str | None) -> None:
    import ray.train
    from ray.train import Checkpoint
    from ray.train.v2.api.report_config import CheckpointUploadMode

    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(checkpoint) if checkpoint else None,
                     checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


_instance = []


def _reporter() -> _Reporter:
    if not _instance:
        _instance.append(_Reporter())
    return _instance[0]
