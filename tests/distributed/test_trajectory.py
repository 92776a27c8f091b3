"""The same trajectory on every engine: same seed, data and global batch (4 rows a step), fp32 on CPU. The per-step
losses and gradient norms, and the trained weights, of SFT, DPO and reward (each full and LoRA) are equal within
``RTOL`` across one process, one process with gradient accumulation, DDP, ZeRO-2, ZeRO-3 (with and without
accumulation) and FSDP2.

Each engine is one launch that trains the six cases (``run_many.py``); ZeRO-3's is the launch other modules share.
"""

import functools

import pytest
from safetensors.torch import load_file

from tests.distributed.conftest import ENGINE_CASES, engine_args
from tests.distributed.test_reliability import logged

pytestmark = pytest.mark.slow

CASES = ENGINE_CASES
# name: accelerate backend, processes, per-device batch, gradient accumulation steps (4 rows per optimizer step)
ENGINES = {
    "one-process": ("ddp", 1, 4, 1),
    "one-process-accumulation": ("ddp", 1, 2, 2),
    "ddp": ("ddp", 2, 2, 1),
    "zero2": ("zero2", 2, 2, 1),
    "zero3": ("zero3", 2, 2, 1),
    "zero3-accumulation": ("zero3", 2, 1, 2),
    "fsdp2": ("fsdp2", 2, 2, 1),
}
REFERENCE = "one-process"
RTOL = 1e-4  # losses and gradient norms: the same sums in another order (fp32)
# Weights after 4 Adam steps of lr 1e-3: measured at most 1.6e-5 (reward, full; padding to 4 rows or to 2 changes the
# last bits of near-zero gradients, which Adam's division by their running scale enlarges), 3e-6 for the others
WEIGHTS_ATOL = 5e-5


@pytest.fixture(scope="module")
def trajectories(shared_runs):
    """``engine -> {case: output directory}``: one launch per engine, made when a test first asks for it (CI's gate
    leaves some engines out: tests/conftest.py)."""

    @functools.cache
    def of(engine: str) -> dict:
        backend, processes, batch, accumulation = ENGINES[engine]
        runs = [engine_args(backend, *case, batch, accumulation) for case in CASES]
        shared_runs.many("train.py", backend, runs, num_processes=processes)
        return {case: shared_runs.get("train.py", backend, args, num_processes=processes)
                for case, args in zip(CASES, runs)}

    return of


@pytest.mark.parametrize("case", CASES, ids=[f"{t}-{'lora' if lora else 'full'}" for t, lora in CASES])
@pytest.mark.parametrize("engine", [e for e in ENGINES if e != REFERENCE])
def test_same_trajectory_as_one_process(trajectories, engine, case):
    reference, got = trajectories(REFERENCE)[case], trajectories(engine)[case]
    expected, logs = logged(reference), logged(got)
    assert [h["step"] for h in logs] == [h["step"] for h in expected] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert [h[key] for h in logs] == pytest.approx([h[key] for h in expected], rel=RTOL), key
    assert expected[0]["loss"] != expected[-1]["loss"]  # it trained
    a, b = (load_file(d / "trained.safetensors") for d in (reference, got))
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"\n{engine} {case}: max |weight diff| vs one process {worst:.2e}")
    assert worst <= WEIGHTS_ATOL
