"""The device check's ``diagnose`` step (bench/device_check.py, after the others): where the throughput step found
trl_ext's step time above 1.02x TRL's (the median over its repeats, by more than the A/A control strayed from 1.00:
a miss within noise is none), it runs, in one process (bench/_gpu_worker.py ``--plan``), worst miss first:

1. TRL's run and trl_ext's again, side by side: the ratio measured once more, and the anchor for the runs below;
2. trl_ext's run with reentrant gradient checkpointing (``gradient_checkpointing_kwargs={"use_reentrant": True}``):
   whether non-reentrant checkpointing's hooks are the cost;
3. under LoRA, trl_ext's run with TRL's input-require-grads hook kept (the one change trl_ext makes to the autograd
   graph there): whether its removal is the cost;
4. a short torch-profiler record of TRL's run and of trl_ext's (bench/_device_profile.py): the top CPU and CUDA ops,
   the kernels launched and the ``aten::`` ops per step, and the ops whose calls per step differ,

so that a run that misses ends with a cause, not only a ratio. On a GPU, in the time left after the misses, the
workloads whose median is above 1.00 without missing are diagnosed too, highest first ("suspects"): 2 repeats beside
an A/A control that strayed 0.25 (2026-12-04) hid a steady 5% (DPO LoRA's, seen in a longer run), and the records
cost about 35 s a workload (estimated, not measured). A suspect the time did not reach is named, not failed. On the
CPU (``--smoke``) the throughput ratios of a 3-step tiny model mean nothing, so only a ratio made up with
``--made_up_ratio`` counts as a miss there, and there are no suspects: it shows that the records are made and read
(tests/test_device_check.py).
"""

import json
import sys
import time
from pathlib import Path

from _device_profile import count_differences, ops

BENCH = Path(__file__).resolve().parent
GOAL_RATIO = 1.02  # as the throughput step's goal
PROFILED_STEPS = 2
# A throughput run on the GPU, and the reruns compared with it: 8 steps, 5 timed after 3 of warm-up (16 and 12 before
# each workload ran in 2 repeats beside an A/A control: bench/RESULTS.md, 2026-12-02)
GPU_RUN = ["--steps", "8", "--warmup", "3"]
SMOKE_RUN = ["--smoke", "--seq_len", "64", "--batch", "4", "--steps", "3", "--warmup", "1"]
# The reruns of one workload, as (label, the worker's flags): TRL and trl_ext again, then trl_ext's variants
RERUNS = [("TRL, again", "trl", {}), ("trl_ext, again", "trl_ext", {}),
          ("trl_ext, use_reentrant=True", "trl_ext", {"reentrant": True}),
          ("trl_ext, input-require-grads hook kept", "trl_ext", {"keep_input_grads_hook": True})]
LORA_ONLY = {"keep_input_grads_hook"}  # the hook exists under PEFT only


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


def suspects(ratios: dict, smoke: bool) -> list[str]:
    """On a GPU, the workloads whose median ratio is above 1.00 without being a miss, highest first (see the
    docstring); none on the CPU.

    Args:
        ratios: the throughput step's ``ratios``.
        smoke: a CPU run.

    Returns:
        Workload names.
    """
    if smoke:
        return []
    above = [n for n, r in ratios.items() if not r["verdict"].startswith("miss") and r["ratio"] > 1.0]
    return sorted(above, key=lambda n: -ratios[n]["ratio"])


def needed(check) -> bool:
    """Whether the step has work (a miss or a suspect to explain, or no ratios to read): without, it takes no time,
    and runs even where the budget is spent."""
    ratios = (check.results["steps"].get("throughput") or {}).get("ratios")
    return ratios is None or bool(misses(ratios, check.smoke) + suspects(ratios, check.smoke))


def reruns(tuning: str) -> list[tuple[str, str, dict]]:
    """The reruns (``RERUNS``) that apply to a workload of this tuning."""
    return [(label, impl, flags) for label, impl, flags in RERUNS if tuning == "lora" or not set(flags) & LORA_ONLY]


def plan(ratios: dict, workloads: list[str], smoke: bool) -> list[dict]:
    """The worker's runs, workload after workload: the reruns (TRL and trl_ext again, trl_ext's variants), then each
    side profiled."""
    steps = 3 if smoke else 6  # profiled: the last PROFILED_STEPS, after the first ones built caches and pools
    runs = []
    for name in workloads:
        workload = {"trainer": ratios[name]["trainer"], "tuning": ratios[name]["tuning"], "gc": "on"}
        runs += [{**workload, "impl": impl, **flags} for _, impl, flags in reruns(workload["tuning"])]
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
    missed, suspected = misses(ratios, check.smoke), suspects(ratios, check.smoke)
    if not missed + suspected:
        note = f"every step ratio within {GOAL_RATIO}x TRL's: nothing to explain"
        note += (" (on the CPU only a --made_up_ratio counts as a miss)" if check.smoke else
                 ", and none above 1.00")
        return {"rows": [], "checks": {}, "goals": {}, "notes": [note]}
    out = check.work / "diagnose.jsonl"
    out.unlink(missing_ok=True)
    sizes = SMOKE_RUN if check.smoke else GPU_RUN  # as the throughput step's runs
    cmd = [sys.executable, str(BENCH / "_gpu_worker.py"), "--plan",
           json.dumps(plan(ratios, missed + suspected, check.smoke)), "--results", str(out), *sizes]
    code, tail = check.run("diagnose", cmd, deadline - time.monotonic())
    results = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []

    def complete(name: str) -> bool:  # every rerun and both profiles recorded
        runs = [r for r in results if (r["trainer"], r["tuning"]) == (ratios[name]["trainer"], ratios[name]["tuning"])]
        return len(runs) >= len(reruns(ratios[name]["tuning"])) + 2

    cut = [n for n in suspected if not complete(n)]
    # the plan holds the misses first; a suspect the time cut short is named, not failed
    finished = code == 0 or (code is None and all(complete(n) for n in missed))
    detail = ("" if code == 0 else f"the step's time ran out after the misses' runs: {', '.join(cut)} cut short"
              if finished else f"exit code {code}: {tail[-300:]}")
    found = {"rows": [], "checks": {"the runs finished": ok(finished, detail)},
             "goals": {}, "notes": [], "tables": [], "diagnosed": {}}
    for name in missed + [n for n in suspected if n not in cut]:
        workload(found, name, ratios[name], results, suspect=name in suspected)
    for name in cut:
        found["notes"].append(f"{name}: at {ratios[name]['ratio']:.3f}x TRL's step (not a miss): not diagnosed, "
                              "the step's time ran out")
    return found


def workload(found: dict, name: str, ratio: dict, results: list[dict], suspect: bool = False) -> None:
    """One workload's rows, checks, count differences and verdict, added to ``found`` (``suspect``: above 1.00, not
    a miss)."""
    def result(impl: str, **flags):
        wanted = {"reentrant": False, "keep_input_grads_hook": False, "profile": False, **flags}
        return next((r for r in results if (r["trainer"], r["tuning"], r["impl"]) == (ratio["trainer"],
                     ratio["tuning"], impl) and all(bool(r.get(k)) == v for k, v in wanted.items())), None)

    found_runs = {label: result(impl, **flags) for label, impl, flags in reruns(ratio["tuning"])}
    trl_again = found_runs.get("TRL, again")
    profiles = {impl: (result(impl, profile=True) or {}).get("profile") for impl in ("trl", "trl_ext")}
    # the reruns are compared with TRL's run in this same step (the throughput step's, if that one is missing)
    trl_step = trl_again["step_s"] if trl_again else ratio["trl_step_s"]
    kind = "a suspect: above 1.00, not a miss" if suspect else f"ratio {'made up' if ratio['made_up'] else 'measured'}"
    rows = [{"workload": name, "run": "TRL (throughput step)", "step s": ratio["trl_step_s"], "vs TRL's step": 1.0,
             "gradient checkpointing": ratio["trl_gc"]},
            {"workload": name, "run": f"trl_ext (throughput step; {kind})", "step s": ratio["trl_ext_step_s"],
             "vs TRL's step": ratio["ratio"]}]
    for label, run in found_runs.items():
        if run:
            figures = run.get("figures") or {}
            rows.append({"workload": name, "run": label, "step s": run["step_s"],
                         "vs TRL's step": run["step_s"] / trl_step,
                         "gradient checkpointing": figures.get("gradient_checkpointing"),
                         "input-embedding hooks": figures.get("input_grad_hooks")})
    for impl, p in profiles.items():
        if p:
            rows.append({"workload": name, "run": f"{'TRL' if impl == 'trl' else 'trl_ext'}, profiled",
                         "step s": p["step_s"], "kernel launches / step": p["kernel_launches_per_step"],
                         "aten ops / step": p["aten_ops_per_step"], "top CPU ops / step": ops(p["top_cpu"]),
                         "top CUDA ops / step": ops(p["top_cuda"])})
    found["rows"] += rows
    checks = found["checks"]
    ours_again = found_runs.get("trl_ext, again")
    checks[f"{name}: TRL and trl_ext again"] = ok(
        trl_again is not None and ours_again is not None,
        f"{ours_again['step_s'] / trl_step:.3f}x" if trl_again and ours_again else "no result")
    rerun = found_runs.get("trl_ext, use_reentrant=True")
    gc = ((rerun or {}).get("figures") or {}).get("gradient_checkpointing")
    checks[f"{name}: trl_ext rerun with reentrant checkpointing"] = ok(
        rerun is not None and str(gc).startswith("reentrant"),
        f"{rerun['step_s']:.4g} s a step, {gc}" if rerun else "no result")
    if "trl_ext, input-require-grads hook kept" in found_runs:
        kept = found_runs["trl_ext, input-require-grads hook kept"]
        hooks = ((kept or {}).get("figures") or {}).get("input_grad_hooks")
        checks[f"{name}: trl_ext rerun with the input-require-grads hook kept"] = ok(
            kept is not None and bool(hooks),
            f"{kept['step_s']:.4g} s a step, {hooks} hook(s) on the input embeddings" if kept else "no result")
    both = all(p and p["aten_ops_per_step"] > 0 and p["top_cpu"] for p in profiles.values())
    checks[f"{name}: both sides profiled"] = ok(both, "" if both else f"records: {list(profiles)}")
    differences = count_differences(profiles["trl"], profiles["trl_ext"]) if both else []
    if differences:
        found["tables"].append((f"{name}: aten ops whose calls per step differ, TRL vs trl_ext",
                                [{"op": d["op"], "TRL": d["trl"], "trl_ext": d["trl_ext"],
                                  "trl_ext - TRL": d["difference"]} for d in differences]))
    text = verdict(name, ratio, trl_step, found_runs, profiles if both else None, differences, suspect)
    found["notes"].append(text)
    found["diagnosed"][name] = {
        "ratio": ratio, "suspect": suspect, "trl_step_s": trl_step,
        "reruns": {label: run and {"step_s": run["step_s"], "vs_trl": run["step_s"] / trl_step,
                                   "gradient_checkpointing": (run.get("figures") or {}).get("gradient_checkpointing"),
                                   "input_grad_hooks": (run.get("figures") or {}).get("input_grad_hooks")}
                   for label, run in found_runs.items()},
        "profiles": profiles, "count_differences": differences, "verdict": text}


def verdict(name: str, ratio: dict, trl_step: float, found_runs: dict, profiles: dict | None,
            differences: list[dict], suspect: bool = False) -> str:
    """One line: what the reruns and the profiles say about the miss (or the suspect)."""
    parts = [f"{name}: trl_ext at {ratio['ratio']:.3f}x TRL's step" + (" (made up)" if ratio["made_up"] else "")
             + (" (a suspect, not a miss)" if suspect else "")]
    again = found_runs.get("trl_ext, again")
    if again:
        parts.append(f"again {again['step_s'] / trl_step:.3f}x")
    for label, text, change, cost in (
            ("trl_ext, use_reentrant=True", "with use_reentrant=True", "reentrant", "non-reentrant checkpointing's"),
            ("trl_ext, input-require-grads hook kept", "with TRL's input-require-grads hook kept", "keeping it",
             "its removal")):
        run = found_runs.get(label)
        if run:
            x = run["step_s"] / trl_step
            parts.append(f"{text} {x:.3f}x: {change} " + (f"closes the gap, the cost is {cost}" if x <= GOAL_RATIO
                                                           else "does not close the gap"))
    if profiles:
        trl, ours = profiles["trl"], profiles["trl_ext"]
        if ours["kernel_launches_per_step"] is not None:
            parts.append(f"kernel launches per step {ours['kernel_launches_per_step']:g} vs TRL's "
                         f"{trl['kernel_launches_per_step']:g}")
        parts.append(f"aten ops per step {ours['aten_ops_per_step']:g} vs TRL's {trl['aten_ops_per_step']:g}")
        if differences:
            parts.append("most different: " + ", ".join(f"{d['op']} {d['difference']:+g}" for d in differences[:3]))
    return "; ".join(parts)
