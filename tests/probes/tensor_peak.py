"""Peak bytes of live tensors, counted at the dispatcher: each tensor an op creates is added when it is made and
subtracted when its storage is freed. A count, free of the allocator's retention, so two runs of the same code give
the same number (bench/_gradient_checkpointing_worker.py ``--tensor_peak``). torch's MemTracker does this too, but
registers a gradient hook on every parameter, which fails on the frozen ones LoRA leaves."""

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import TrainerCallback


class LiveTensorPeak(TorchDispatchMode):
    """Inside ``with LiveTensorPeak() as peak:``, ``peak.peak`` is the most bytes that tensors made inside it held at
    once (tensors made before it are not counted); ``peak.window()`` starts a new window (a step), and
    ``peak.growth()`` is its peak over the bytes live when it started (DeepSpeed's bucket buffers, allocated once and
    larger than a tiny model, do not hide what a step adds)."""

    def __init__(self):
        super().__init__()
        self.current, self.peak, self.base, self._live = 0, 0, 0, {}

    def window(self) -> None:
        self.base = self.peak = self.current

    def growth(self) -> int:
        return self.peak - self.base

    def _freed(self, key: int, nbytes: int) -> None:
        self.current -= nbytes
        self._live.pop(key, None)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata  # one per storage, whatever the views
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._freed(key, nbytes))
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                self._track(value)
        return out


class StepWindows(TrainerCallback):
    """Each optimizer step's peak of live tensor bytes over those live at its start (``growths``, one per step)."""

    def __init__(self, tracker: LiveTensorPeak):
        self.tracker, self.growths = tracker, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.tracker.window()

    def on_step_end(self, args, state, control, **kwargs):
        self.growths.append(self.tracker.growth())


@contextlib.contextmanager
def step_peaks(trainer):
    """Inside the block, each optimizer step of ``trainer`` has its peak of live tensor bytes counted over those live
    at the step's start. Yields the list of them, filled as steps end (``with step_peaks(trainer) as peaks:``)."""
    tracker = LiveTensorPeak()
    windows = StepWindows(tracker)
    trainer.add_callback(windows)
    with tracker:
        yield windows.growths
