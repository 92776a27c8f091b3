"""The device check's ``diagnose`` step (bench/device_check.py, after the others): where the throughput step found
trl_ext's step time above 1.02x TRL's (the median over its repeats, by more than the A/A control strayed from 1.00:
a miss within noise is none), it runs, in one process (bench/_gpu_worker.py ``--plan``), worst miss first:

1. trl_ext's run again with reentrant gradient checkpointing (``gradient_checkpointing_kwargs={"use_reentrant":
   True}``): whether non-reentrant checkpointing's hooks are the cost;
2. a short torch-profiler record of TRL's run and of trl_ext's (bench/_device_profile.py): the top CPU and CUDA ops,
   the kernels launched and the ``aten::`` ops per step, and the ops whose calls per step differ,

so that a run that misses ends with a cause, not only a ratio. On the CPU (``--smoke``) the throughput ratios of a
3-step tiny model mean nothing, so only a ratio made up with ``--made_up_ratio`` counts as a miss there: it shows that
the records are made and read (tests/test_device_check.py).
"""

import json
import sys
import time
from pathlib import Path

from _device_profile import count_differences, ops

BENCH = Path(__file__).resolve().parent
GOAL_RATIO = 1.02  # as the throughput step's goal
PROFILED_STEPS = 2
# A throughput run on the GPU, and the reentrant rerun compared with it: 8 steps, 5 timed after 3 of warm-up (16 and
# 12 before each workload ran in 2 repeats beside an A/A control: bench/RESULTS.md, 2026-12-02)
GPU_RUN = ["--steps", "8", "--warmup", "3"]
SMOKE_RUN = ["--smoke", "--seq_len", "64", "--batch", "4", "--steps", "3", "--warmup", "1"]


def ok(condition: bool, detail: str = "") -> dict:
    return {"ok": bool(condition), "detail": detail}


def misses(ratios: dict, smoke: bool) -> list[str]:
    """The workloads whose median ratio misses the goal by more than the A/A control's noise (their ``verdict`` is
    "miss"; "within noise" is not one), worst first; on the CPU, made-up ones only (see the docstring).

    Args:
        ratios: the throughput step's ``ratios`` (workload -> ``{"ratio", "verdict", "made_up", ...}``).
        smoke: a CPU run.

    Returns:
        Workload names, e.g. ``["DPO lora"]``.
    """
    missed = [n for n, r in ratios.items() if r["verdict"].startswith("miss") and (r["made_up"] or not smoke)]
    return sorted(missed, key=lambda n: -ratios[n]["ratio"])


def needed(check) -> bool:
    """Whether the step has work (a miss to explain, or no ratios to read): without, it takes no time, and runs even
    where the budget is spent."""
    ratios = (check.results["steps"].get("throughput") or {}).get("ratios")
    return ratios is None or bool(misses(ratios, check.smoke))


def plan(ratios: dict, missed: list[str], smoke: bool) -> list[dict]:
    """The worker's runs: per missed workload, trl_ext with reentrant checkpointing, then each side profiled."""
    steps = 3 if smoke else 6  # profiled: the last PROFILED_STEPS, after the first ones built caches and pools
    runs = []
    for name in missed:
        workload = {"trainer": ratios[name]["trainer"], "tuning": ratios[name]["tuning"], "gc": "on"}
        runs.append({**workload, "impl": "trl_ext", "reentrant": True})
        runs += [{**workload, "impl": impl, "profile_steps": PROFILED_STEPS, "steps": steps, "warmup": 1}
                 for impl in ("trl", "trl_ext")]
    return runs


def diagnose(check, deadline: float) -> dict:
    """The step (see the module docstring): ``{"rows", "checks", "goals", "notes", "tables", "diagnosed"}``."""
    throughput = check.results["steps"].get("throughput") or {}
    ratios = throughput.get("ratios")
    if ratios is None:
        return {"rows": [], "goals": {}, "notes": [], "checks": {
            "the throughput step's ratios were there to read": ok(False, "the throughput step did not finish")}}
    missed = misses(ratios, check.smoke)
    if not missed:
        note = f"every step ratio within {GOAL_RATIO}x TRL's: nothing to explain"
        if check.smoke:
            note += " (on the CPU only a --made_up_ratio counts as a miss)"
        return {"rows": [], "checks": {}, "goals": {}, "notes": [note]}
    out = check.work / "diagnose.jsonl"
    out.unlink(missing_ok=True)
    sizes = SMOKE_RUN if check.smoke else GPU_RUN  # as the throughput step's runs
    cmd = [sys.executable, str(BENCH / "_gpu_worker.py"), "--plan", json.dumps(plan(ratios, missed, check.smoke)),
           "--results", str(out), *sizes]
    code, tail = check.run("diagnose", cmd, deadline - time.monotonic())
    results = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    found = {"rows": [], "checks": {"the runs finished": ok(code == 0, "" if code == 0 else
                                                            f"exit code {code}: {tail[-300:]}")},
             "goals": {}, "notes": [], "tables": [], "diagnosed": {}}
    for name in missed:
        workload(found, name, ratios[name], results)
    return found


def workload(found: dict, name: str, ratio: dict, results: list[dict]) -> None:
    """One missed workload's rows, checks, count differences and verdict, added to ``found``."""
    def result(impl: str, **flags):
        return next((r for r in results if (r["trainer"], r["tuning"], r["impl"]) == (ratio["trainer"],
                     ratio["tuning"], impl) and all(bool(r.get(k)) == v for k, v in flags.items())), None)

    rerun = result("trl_ext", reentrant=True, profile=False)
    profiles = {impl: (result(impl, reentrant=False, profile=True) or {}).get("profile") for impl in ("trl", "trl_ext")}
    trl_step = ratio["trl_step_s"]
    measured = "made up" if ratio["made_up"] else "measured"
    rows = [{"workload": name, "run": "TRL (throughput step)", "step s": trl_step, "vs TRL's step": 1.0,
             "gradient checkpointing": ratio["trl_gc"]},
            {"workload": name, "run": f"trl_ext (throughput step; ratio {measured})", "step s": ratio["trl_ext_step_s"],
             "vs TRL's step": ratio["ratio"]}]
    if rerun:
        rows.append({"workload": name, "run": "trl_ext, use_reentrant=True", "step s": rerun["step_s"],
                     "vs TRL's step": rerun["step_s"] / trl_step,
                     "gradient checkpointing": (rerun.get("figures") or {}).get("gradient_checkpointing")})
    for impl, p in profiles.items():
        if p:
            rows.append({"workload": name, "run": f"{'TRL' if impl == 'trl' else 'trl_ext'}, profiled",
                         "step s": p["step_s"], "kernel launches / step": p["kernel_launches_per_step"],
                         "aten ops / step": p["aten_ops_per_step"], "top CPU ops / step": ops(p["top_cpu"]),
                         "top CUDA ops / step": ops(p["top_cuda"])})
    found["rows"] += rows
    gc = ((rerun or {}).get("figures") or {}).get("gradient_checkpointing")
    found["checks"][f"{name}: trl_ext rerun with reentrant checkpointing"] = ok(
        rerun is not None and str(gc).startswith("reentrant"),
        f"{rerun['step_s']:.4g} s a step, {gc}" if rerun else "no result")
    both = all(p and p["aten_ops_per_step"] > 0 and p["top_cpu"] for p in profiles.values())
    found["checks"][f"{name}: both sides profiled"] = ok(both, "" if both else f"records: {list(profiles)}")
    differences = count_differences(profiles["trl"], profiles["trl_ext"]) if both else []
    if differences:
        found["tables"].append((f"{name}: aten ops whose calls per step differ, TRL vs trl_ext",
                                [{"op": d["op"], "TRL": d["trl"], "trl_ext": d["trl_ext"],
                                  "trl_ext - TRL": d["difference"]} for d in differences]))
    text = verdict(name, ratio, rerun, profiles if both else None, differences)
    found["notes"].append(text)
    found["diagnosed"][name] = {"ratio": ratio, "reentrant": rerun and {
        "step_s": rerun["step_s"], "vs_trl": rerun["step_s"] / trl_step, "gradient_checkpointing": gc},
        "profiles": profiles, "count_differences": differences, "verdict": text}


def verdict(name: str, ratio: dict, rerun: dict | None, profiles: dict | None, differences: list[dict]) -> str:
    """One line: what the reentrant rerun and the profiles say about the miss."""
    parts = [f"{name}: trl_ext at {ratio['ratio']:.3f}x TRL's step" + (" (made up)" if ratio["made_up"] else "")]
    if rerun:
        again = rerun["step_s"] / ratio["trl_step_s"]
        parts.append(f"with use_reentrant=True {again:.3f}x: " + ("reentrant closes the gap, the cost is non-reentrant "
                     "checkpointing's" if again <= GOAL_RATIO else "reentrant does not close the gap"))
    if profiles:
        trl, ours = profiles["trl"], profiles["trl_ext"]
        if ours["kernel_launches_per_step"] is not None:
            parts.append(f"kernel launches per step {ours['kernel_launches_per_step']:g} vs TRL's "
                         f"{trl['kernel_launches_per_step']:g}")
        parts.append(f"aten ops per step {ours['aten_ops_per_step']:g} vs TRL's {trl['aten_ops_per_step']:g}")
        if differences:
            parts.append("most different: " + ", ".join(f"{d['op']} {d['difference']:+g}" for d in differences[:3]))
    return "; ".join(parts)
