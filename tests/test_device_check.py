"""bench/device_check.sh --smoke: the GPU machine's check, run on the CPU with tiny models (fp32, gloo), exactly as the
GPU run goes (the same script, steps, processes, verifications and table). It must pass every check, and the table
must hold every row: a check that fails there fails here. Also: a failing check or step fails the run loudly (exit
code, status, FAIL in the table), and what the device machine returns (at most 8 files, flat) fits.
"""

import json
import shutil
import sys

import pytest
import torch

from tests.harness import REPO, run_command

pytestmark = pytest.mark.slow

STEPS = ["throughput", "checkpoint", "zero3", "fsdp2", "qlora"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """One smoke run for the module: its output folder, work folder (kept for the checks below) and launch."""
    out, work = tmp_path_factory.mktemp("device-out"), tmp_path_factory.mktemp("device-work")
    launch = run_command(["bash", str(REPO / "bench" / "device_check.sh"), str(out), "--smoke", "--work", str(work)],
                         timeout=600, env={"PYTHON": sys.executable})
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    return {"out": out, "work": work, "launch": launch, "results": results}


def test_every_step_passed(smoke):
    launch, results = smoke["launch"], smoke["results"]
    assert not launch.timed_out, launch.output[-3000:]
    statuses = {name: results["steps"].get(name, {}).get("status") for name in STEPS}
    failed = {name: {k: c for k, c in results["steps"][name].get("checks", {}).items() if not c["ok"]}
              or results["steps"][name].get("error") for name, s in statuses.items() if s != "passed" and s}
    assert statuses == dict.fromkeys(STEPS, "passed"), f"{statuses}\n{failed}\n{launch.output[-3000:]}"
    assert launch.returncode == 0 and "every step passed" in launch.output


def test_the_table_has_every_row(smoke):
    table = (smoke["out"] / "table.txt").read_text()
    assert table in (smoke["out"] / "console.txt").read_text()  # printed at the end too
    for workload in ("SFT lora", "SFT full", "DPO lora", "DPO full"):
        for impl in ("trl", "trl_ext"):
            assert f"| {workload} | {impl} |" in table, (workload, impl)
    for run in ("foreground", "background", "resumed"):
        assert f"| {run} |" in table
    for engine in ("zero3", "fsdp2"):
        for run in ("DPO LoRA, non-reentrant GC", "SFT full"):
            assert f"| {engine} | " in table and f"| {run} |" in table
    rows = smoke["results"]["steps"]["qlora"]["rows"]
    assert len(rows) == 1 and rows[0]["4-bit layers"] > 0 and rows[0]["merged vs base + adapter"] < 1e-4
    assert "FAIL" not in table and "PASSED" in table


def test_self_checks_for_every_workload(smoke):
    """Before its figures are believed, the throughput step prints what each run trained, TRL's side by trl_ext's:
    equal, or the difference named; and the peak-memory floor (checked on a GPU only)."""
    table = (smoke["out"] / "table.txt").read_text()
    assert "self-checks: TRL vs trl_ext" in table
    checks = smoke["results"]["steps"]["throughput"]["checks"]
    for workload in ("SFT lora", "SFT full", "DPO lora", "DPO full"):
        for figure in ("trainable params", "optimizer state after step 1", "parameter dtypes",
                       "gradient checkpointing", "attention", "weights (+ reference model)", "peak memory floor",
                       "peak memory vs floor"):
            assert f"| {workload} | {figure} |" in table, (workload, figure)
        assert checks[f"{workload}: self-checks, TRL and trl_ext train the same"]["ok"], checks
        assert f"{workload} trl: peak memory >= its floor" not in checks  # no peak on the CPU: printed, not judged
    assert "UNEXPLAINED" not in table and "| peak memory vs floor | not measured (CPU) |" in table


def test_background_checkpoints_verify_and_resume_exactly(smoke):
    step = smoke["results"]["steps"]["checkpoint"]
    checks = step["checks"]
    # checkpoint-2 and -4 were written in the background, -6 (the last) in the foreground
    for name in ("deterministic", "audit checkpoint-2", "checkpoint-2 as foreground's", "audit checkpoint-4",
                 "checkpoint-4 as foreground's", "resumed losses", "resumed final checkpoint",
                 "background checkpoint-4 reloads in plain transformers"):
        assert checks[name]["ok"], (name, checks[name])
    runs = {row["run"]: row for row in step["rows"]}
    assert runs["background"]["checkpoints"] == runs["foreground"]["checkpoints"] == "2, 4, 6"
    assert runs["resumed"]["checkpoints"] == "6"
    assert runs["background"]["write s (background)"] != "-"  # two background writes were timed
    assert len(runs["background"]["held s (each)"].split(", ")) == 3


def test_saves_verify_and_reload(smoke):
    steps = smoke["results"]["steps"]
    for engine in ("zero3", "fsdp2"):
        checks = steps[engine]["checks"]
        for run in ("DPO LoRA, non-reentrant GC", "SFT full"):
            for what in ("trained", "saved tensors are the trained ones", "audit",
                         "reloads in plain transformers/peft"):
                assert checks[f"{run}: {what}"]["ok"], (engine, run, what, checks[f"{run}: {what}"])
    qlora = steps["qlora"]["checks"]
    for name in ("the base was 4-bit", "adapter audit", "saved adapter tensors are the trained ones", "trl-ext merge",
                 "merged model audit", "training changed the outputs",
                 "reloaded on the 4-bit base: the trained outputs", "merged model = full-precision base + adapter"):
        assert qlora[name]["ok"], (name, qlora[name])


def test_what_comes_back_fits(smoke):
    """The device machine returns at most 8 files from the output folder, no more than 2 folders down."""
    files = [p for p in smoke["out"].rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.parent == smoke["out"] for p in files), files
    assert {p.name for p in files} == {"results.json", "table.txt", "log.txt", "console.txt"}


def test_a_damaged_save_or_reload_is_caught(smoke, tmp_path):
    """The comparisons the check relies on can fail: one saved value changed, one optimizer state changed, or
    outputs off by more than the tolerance."""
    from safetensors.torch import load_file, save_file

    from tests.saved_compare import outputs_close, same_checkpoint, same_tensors

    saved = smoke["work"] / "zero3" / "sft-full" / "final"
    damaged = tmp_path / "final"
    shutil.copytree(saved, damaged)
    (weights,) = damaged.glob("*.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    trained = saved.parent / "trained.safetensors"
    assert same_tensors(saved, trained) == []
    assert same_tensors(damaged, trained) == [f"{name}: differs from the trained tensor"]

    checkpoint = smoke["work"] / "checkpoint" / "background" / "checkpoint-6"  # the foreground run's are removed
    copy = tmp_path / "checkpoint-6"
    shutil.copytree(checkpoint, copy)
    assert same_checkpoint(checkpoint, copy) == []
    optimizer = torch.load(copy / "optimizer.pt", weights_only=False)
    state = next(iter(optimizer["state"].values()))
    state["exp_avg"].view(-1)[0] += 1.0
    torch.save(optimizer, copy / "optimizer.pt")
    assert len(same_checkpoint(checkpoint, copy)) == 1

    probes = json.loads((saved.parent / "probes_final.json").read_text())
    assert outputs_close(probes, probes, "float32")[0]
    assert not outputs_close((torch.tensor(probes) + 0.01).tolist(), probes, "float32")[0]


def test_a_step_that_does_not_run_fails_the_run(tmp_path):
    """Out of time before any step: each is recorded as skipped, the table says so, the exit code is 1."""
    launch = run_command([sys.executable, str(REPO / "bench" / "device_check.py"), str(tmp_path / "out"), "--smoke",
                          "--budget", "1", "--work", str(tmp_path / "work")], timeout=120)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert launch.returncode == 1 and "NOT PASSED" in launch.output, launch.output[-2000:]
    assert {s["status"] for s in results["steps"].values()} == {"skipped"} and len(results["steps"]) == len(STEPS)
    assert "SKIPPED" in (tmp_path / "out" / "table.txt").read_text()
