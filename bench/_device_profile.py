"""A short torch-profiler record of a few training steps (bench/_gpu_worker.py ``--profile_steps``), and TRL's
record against trl_ext's: the device check's ``diagnose`` step runs it where a step ratio misses 1.02x, so that the
record says where the time goes, not only that it went.

Per record (JSON-safe): the profiled steps' wall time per step; the top ops by self CPU time and, on a GPU, by self
CUDA time (calls and milliseconds per step); the CUDA kernels launched per step (the host's launch calls: a small
model on a big card is bound by them); the ``aten::`` ops per step, in all and by name (on the CPU, what differs
between two sides that run the same model).
"""

import time

import torch
from transformers import TrainerCallback

# The host calls that launch work on the GPU, as the profiler names them (CUDA runtime and driver APIs).
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
TOP = 8


class ProfileSteps(TrainerCallback):
    """Profiles optimizer steps ``first`` to ``first + steps - 1`` (1-based, as ``state.global_step`` counts them).

    Args:
        first: the first profiled step (after the warm-up: the first steps build caches and allocator pools).
        steps: how many steps to profile.
        cuda: whether to record CUDA activity too (a GPU run).
    """

    def __init__(self, first: int, steps: int, cuda: bool):
        self.first, self.steps, self.cuda = first, steps, cuda
        self.profiler, self.started, self.summary = None, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.first and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None and self.summary is None and state.global_step == self.first + self.steps - 1:
            if self.cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.started
            self.profiler.stop()
            self.summary = summarise(self.profiler.key_averages(), self.steps, self.cuda, wall)


def _device_time(event) -> float:
    """An event's self time on the GPU in microseconds (the attribute's name changed across torch releases)."""
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0


def summarise(events, steps: int, cuda: bool, wall_s: float) -> dict:
    """One side's record, per step.

    Args:
        events: ``profiler.key_averages()`` over the profiled steps.
        steps: how many steps they span.
        cuda: whether CUDA activity was recorded.
        wall_s: the profiled steps' wall time (the GPU synchronised at both ends).

    Returns:
        ``{"steps", "step_s", "top_cpu", "top_cuda", "kernel_launches_per_step", "aten_ops_per_step", "aten_ops"}``;
        ``top_*``: ``[{"op", "calls", "ms"}]`` per step; ``top_cuda`` and the launches are None on the CPU.
    """
    def row(e, ms: float) -> dict:
        return {"op": e.key, "calls": e.count / steps, "ms": ms / steps}

    events = [e for e in events if not e.key.startswith("ProfilerStep")]
    top_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP]
    aten = {e.key: e.count / steps for e in events if e.key.startswith("aten::")}
    found = {"steps": steps, "step_s": wall_s / steps,
             "top_cpu": [row(e, e.self_cpu_time_total / 1e3) for e in top_cpu],
             "top_cuda": None, "kernel_launches_per_step": None,
             "aten_ops_per_step": sum(aten.values()), "aten_ops": aten}
    if cuda:
        top_cuda = sorted((e for e in events if _device_time(e) > 0), key=_device_time, reverse=True)[:TOP]
        found["top_cuda"] = [row(e, _device_time(e) / 1e3) for e in top_cuda]
        found["kernel_launches_per_step"] = sum(e.count for e in events if e.key in LAUNCHES) / steps
    return found


def count_differences(trl: dict, ours: dict, top: int = TOP) -> list[dict]:
    """The ``aten::`` ops whose calls per step differ between the two sides, the largest differences first.

    Args:
        trl: TRL's record (``summarise``).
        ours: trl_ext's record.
        top: how many to return.

    Returns:
        ``[{"op", "trl", "trl_ext", "difference"}]`` (calls per step).
    """
    names = set(trl["aten_ops"]) | set(ours["aten_ops"])
    rows = [{"op": n, "trl": trl["aten_ops"].get(n, 0), "trl_ext": ours["aten_ops"].get(n, 0)} for n in names]
    rows = [{**r, "difference": r["trl_ext"] - r["trl"]} for r in rows if r["trl_ext"] != r["trl"]]
    return sorted(rows, key=lambda r: (-abs(r["difference"]), r["op"]))[:top]


def ops(rows: list[dict] | None) -> str:
    """Top ops as one table cell: ``name x calls: ms`` per step."""
    if not rows:
        return "-"
    return "; ".join(f"{r['op']} x{r['calls']:g}: {r['ms']:.2f} ms" for r in rows)
