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

STEPS = ["throughput", "checkpoint", "zero3", "fsdp2", "qlora", "diagnose"]
MADE_UP = 1.10  # DPO LoRA's step ratio, forced to miss 1.02x: the diagnose step must explain it


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """One smoke run for the module: its output folder, work folder (kept for the checks below) and launch."""
    out, work = tmp_path_factory.mktemp("device-out"), tmp_path_factory.mktemp("device-work")
    launch = run_command(["bash", str(REPO / "bench" / "device_check.sh"), str(out), "--smoke", "--work", str(work),
                          "--made_up_ratio", f"DPO lora={MADE_UP}"], timeout=600, env={"PYTHON": sys.executable})
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
    for run in ("foreground", "background", "spaced", "resumed"):
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


def test_a_missed_ratio_is_explained(smoke):
    """A made-up miss (DPO LoRA at 1.10x TRL's step): the throughput step reports it as a missed goal, marked made up,
    and the diagnose step records both sides' profiles (op names, calls and times per step) and trl_ext's rerun with
    reentrant checkpointing (its step time, the mode its layers ran); the other workloads are left alone."""
    steps = smoke["results"]["steps"]
    throughput = steps["throughput"]
    goal = throughput["goals"]["DPO lora: step <= 1.02x TRL's"]
    assert not goal["ok"] and goal["detail"] == f"{MADE_UP:.3f}x (made up)"
    ratios = throughput["ratios"]
    assert ratios["DPO lora"]["made_up"] and ratios["DPO lora"]["ratio"] == MADE_UP
    assert not any(r["made_up"] for name, r in ratios.items() if name != "DPO lora")
    found = steps["diagnose"]
    assert list(found["diagnosed"]) == ["DPO lora"]  # on the CPU only the made-up miss counts
    diagnosed = found["diagnosed"]["DPO lora"]
    rerun = diagnosed["reentrant"]
    assert rerun["gradient_checkpointing"] == "reentrant (2/2 layers)" and 0 < rerun["step_s"] < 60
    assert rerun["vs_trl"] == pytest.approx(rerun["step_s"] / ratios["DPO lora"]["trl_step_s"])
    for side in ("trl", "trl_ext"):
        profile = diagnosed["profiles"][side]
        assert profile["steps"] == 2 and 0 < profile["step_s"] < 60
        assert profile["kernel_launches_per_step"] is None and profile["top_cuda"] is None  # the CPU: no CUDA
        top = {r["op"]: r for r in profile["top_cpu"]}
        assert len(top) == 8 and all(r["calls"] > 0 and r["ms"] > 0 for r in top.values())
        # a 2-layer Llama's step: its matmuls and their backward are among the costliest ops, every step
        assert "aten::mm" in top and profile["aten_ops"]["aten::mm"] >= 20
        assert profile["aten_ops_per_step"] == pytest.approx(sum(profile["aten_ops"].values())) and \
            profile["aten_ops_per_step"] > 1000
    for d in diagnosed["count_differences"]:
        assert d["difference"] == d["trl_ext"] - d["trl"] != 0
        assert d["trl"] == diagnosed["profiles"]["trl"]["aten_ops"].get(d["op"], 0)
    assert diagnosed["verdict"].startswith(f"DPO lora: trl_ext at {MADE_UP:.3f}x TRL's step (made up); with "
                                           f"use_reentrant=True {rerun['vs_trl']:.3f}x")
    table = (smoke["out"] / "table.txt").read_text()
    assert "| DPO lora | trl_ext, use_reentrant=True |" in table and "| DPO lora | trl_ext, profiled |" in table
    assert f"{MADE_UP:.3f} (made up; measured " in table and diagnosed["verdict"] in table


def test_background_checkpoints_verify_and_resume_exactly(smoke):
    step = smoke["results"]["steps"]["checkpoint"]
    checks = step["checks"]
    # checkpoint-1 to -3 were written in the background, -4 (the last) in the foreground
    for name in ("deterministic", "audit checkpoint-1", "checkpoint-1 as foreground's", "audit checkpoint-3",
                 "checkpoint-3 as foreground's", "resumed losses", "resumed final checkpoint",
                 "background checkpoint-3 reloads in plain transformers"):
        assert checks[name]["ok"], (name, checks[name])
    runs = {row["run"]: row for row in step["rows"]}
    assert runs["background"]["checkpoints"] == runs["foreground"]["checkpoints"] == "1, 2, 3, 4"
    assert runs["resumed"]["checkpoints"] == "4"
    assert len(runs["background"]["write s (background)"].split(", ")) == 3  # the background writes were timed
    assert len(runs["background"]["held s (each)"].split(", ")) == 4


def test_background_checkpoints_against_the_disk(smoke):
    """The two cases of a background checkpoint against its write (bench/_checkpoint_cases.py): spaced from the
    measured write time, each holds training for its own save call only; due faster than the writes, each after the
    first waits for the previous write, as trl_ext logs it (checkpoint/held_previous_s), and none is skipped. Each
    reports the held time per background checkpoint, the final save apart."""
    report = json.loads((smoke["work"] / "checkpoint.json").read_text())
    spaced, faster = report["cases"]["spaced"], report["cases"]["faster"]
    picked = report["spaced"]
    assert picked["save_steps"] >= 2 * picked["write_s"] / picked["step_s"] > 0
    assert report["runs"]["spaced"]["save_steps"] == picked["save_steps"]
    writes = [e["checkpoint/write_s"] for e in report["runs"]["foreground"]["logged"]]
    assert picked["write_s"] == max(writes + report["runs"]["background"]["summary"]["write_s"])
    # the intervals against the writes are timings of a loaded CPU (the smoke run's two lanes share it): reported, the
    # spaced one's >= 2x as a goal; that the faster case occurred is trl_ext's logged wait, below
    for case in (spaced, faster):
        assert case["interval_over_write"] > 0
        assert case["interval_over_write"] == pytest.approx(case["interval_s"] / case["write_s"])
    assert len(spaced["expected"]) == 3 and len(faster["expected"]) == 4
    for case in (spaced, faster):
        assert case["committed"] == case["expected"]  # none skipped
        n = len(case["expected"]) - 1  # the background ones; the final apart
        assert len(case["held_s"]) == len(case["waited_previous_s"]) == n
        assert case["final_held_s"] > 0 and case["final_vs_foreground"] > 0 and case["held_vs_foreground"] > 0
        assert case["waited_previous_s"][0] == 0  # nothing was in flight before the first
    logged = report["runs"]["background"]["logged"]  # trl_ext's own records, per checkpoint, the final one last
    waits = [e["checkpoint/held_previous_s"] for e in logged]
    assert faster["waited_previous_s"] == waits[:3] and faster["final_waited_previous_s"] == waits[3]
    assert max(waits[1:]) > 0  # a checkpoint after the first, or the final save, waited for the write before it
    assert all(e["checkpoint/held_s"] >= e["checkpoint/held_previous_s"] for e in logged)  # the wait held training
    assert "set save_steps to at least 2 x checkpoint/write_s" in faster["what_happened"]
    assert spaced["what_happened"].startswith("none skipped") and faster["what_happened"].startswith("none skipped")
    table = (smoke["out"] / "table.txt").read_text()
    assert "| spaced | " in table and "| faster | " in table and "held: previous s (logged)" in table


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

    checkpoint = smoke["work"] / "checkpoint" / "background" / "checkpoint-4"  # the foreground run's are removed
    copy = tmp_path / "checkpoint-4"
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
