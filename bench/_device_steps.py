"""The steps of bench/device_check.py, each a function ``step(check, deadline) -> {"rows", "checks", "goals"}``: it
runs its processes through ``check.run`` (own time limit, output to log.txt), reads what they wrote, asks the reload
process for the saved models' outputs, and says what it measured (``rows``: the table) and what it verified
(``checks``: name -> {"ok", "detail"}; a check that fails fails the step). ``goals`` are the performance targets,
reported as met or not, never failed. Also: the table itself (``table``), and the card's dense bf16 peak.
"""

import json
import math
import statistics
import sys
import time
from pathlib import Path

import _checkpoint_cases
import _device_diagnose
import _device_figures
import _pairing
from _device_diagnose import GOAL_RATIO, diagnose  # noqa: F401 - a step: bench/device_check.py finds it here

from tests.saved_compare import REL_TOL, outputs_close, same_tensors

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SCRIPTS = REPO / "tests" / "scripts"

# Dense bf16 peaks (TFLOP/s) as TRL's table has them (trl.trainer.utils._PEAK_FLOPS_BY_DEVICE), most specific first.
PEAKS = [("H100 NVL", 835), ("H100 PCIe", 756), ("H100", 989), ("H200 NVL", 835), ("H200", 989), ("GB200", 2500),
         ("B200", 2250), ("A100", 312), ("L40S", 362), ("L4", 121), ("A10G", 125)]
QUANTIZATION_ERROR_MARGIN = 1.25  # as tests/distributed/test_qlora.py
ADAPTER_EFFECT_RTOL = 0.25


def peak_tflops(device: str) -> float | None:
    """The card's dense bf16 peak in TFLOP/s (None for an unknown card or the CPU)."""
    return next((peak for name, peak in PEAKS if name.lower() in device.lower()), None)


def filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (tmpfs, ext4, overlay...), from /proc/mounts."""
    try:
        mounts = [line.split() for line in open("/proc/mounts")]
    except OSError:
        return "unknown"
    resolved = str(Path(path).resolve())
    best = max((m for m in mounts if resolved == m[1] or resolved.startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]), default=None)
    return best[2] if best else "unknown"


def ok(condition: bool, detail: str = "") -> dict:
    return {"ok": bool(condition), "detail": detail}


def listed(problems: list) -> dict:
    """A check from a list of problems (none: passed)."""
    return ok(not problems, "; ".join(map(str, problems[:3])) + (f" (+{len(problems) - 3} more)"
                                                                  if len(problems) > 3 else ""))


def max_diff(a, b) -> float:
    import torch

    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


def scale(a) -> float:
    import torch

    return max(torch.tensor(a).abs().max().item(), 1e-6)


def default_model() -> str:
    from trl_ext.assets import default_model_path

    return default_model_path()


def needs_time(name: str, check) -> bool:
    """Whether step ``name`` needs time from the budget: every one does, but diagnose where no ratio missed."""
    return name != "diagnose" or _device_diagnose.needed(check)


def device(check) -> str:
    return "cpu" if check.smoke else "cuda"


def left(deadline: float) -> float:
    return deadline - time.monotonic()


# --- 1. throughput --------------------------------------------------------------------------------------------------
REPEATS = 2  # alternated repeats per workload: TRL first, then trl_ext first (bench/_pairing.py)
# The A/A control (TRL against TRL, the same alternation): DPO's cheapest workload on the H200 (0.19 s a step,
# 2026-11-28), DPO being the trainer whose ratios missed there. Its noise is read beside every workload's ratio.
CONTROLS = ["dpo-full"]


def throughput(check, deadline: float) -> dict:
    out = check.work / "throughput.json"
    peak = check.results["env"].get("peak_bf16_tflops")
    cmd = [sys.executable, str(BENCH / "gpu.py"), "--trainers", "sft", "dpo", "--tunings", "lora", "full", "--gc", "on",
           "--impls", "trl", "trl_ext", "--repeats", str(REPEATS), "--control", *CONTROLS, "--json", str(out)]
    # All runs in one process: each run's own would cost a start-up (TRL's imports) twenty times over. Each run's peak
    # is measured from a reset once the earlier runs' memory is freed (bench/_gpu_worker.py says why, and reports
    # what was still held); a run that fails does not stop the others.
    cmd += ["--one_process"]
    if check.smoke:
        cmd += ["--smoke"]
    else:
        cmd += _device_diagnose.GPU_RUN + (["--peak_tflops", str(peak)] if peak else [])
    code, tail = check.run("throughput", cmd, left(deadline))
    found = json.loads(out.read_text()) if out.exists() else {"rows": [], "failures": [], "runs": []}
    main = [r for r in found["rows"] if not r.get("control")]
    rows, checks, goals = [], {}, {}
    for r in main:
        floor = _device_figures.memory_floor(r["figures"]) if r.get("figures") else None
        ratio = (r.get("paired") or {}).get("median") if r["impl"] == "trl_ext" else 1.0
        rows.append({"workload": f"{r['trainer'].upper()} {r['tuning']}", "impl": r["impl"], "runs": r["runs"],
                     "tokens/s": r["tokens_per_s"], "TFLOP/s": r["tflops"], "MFU %": r["mfu_percent"],
                     "peak mem GiB": r["peak_mem_gib"], "floor GiB": None if floor is None else floor / 2**30,
                     "step s": r["step_s"], "step vs TRL (median)": ratio})
    expected = {(t, tu, i) for t in ("sft", "dpo") for tu in ("lora", "full") for i in ("trl", "trl_ext")}
    got = {(r["trainer"], r["tuning"], r["impl"]) for r in main}
    checks["every workload ran"] = listed([f"{t} {tu} {i} missing" for t, tu, i in sorted(expected - got)]
                                          + [f.splitlines()[0] for f in found.get("failures", [])]
                                          + ([] if code == 0 else [f"bench/gpu.py exit code {code}: {tail[-300:]}"]))
    checks[f"every workload ran {REPEATS} alternated repeats, the A/A control too"] = listed(
        [f"{r['trainer']} {r['tuning']} {'A/A ' if r.get('control') else ''}{r['impl']}: {r['runs']} runs"
         for r in found["rows"] if r["runs"] != REPEATS]
        + [f"no A/A control for {c}" for c in CONTROLS if not any(
            r.get("control") and f"{r['trainer']}-{r['tuning']}" == c for r in found["rows"])])
    by = {(r["trainer"], r["tuning"], r["impl"]): r for r in main}
    controls = {f"{r['trainer'].upper()} {r['tuning']}": r["paired"] for r in found["rows"]
                if r.get("control") and r["impl"] == "trl_ext" and r.get("paired")}
    ratios = {}  # what the diagnose step reads: each workload's median ratio, its verdict, both sides' step times
    for t, tu in dict.fromkeys((t, tu) for t, tu, _ in by):
        ours, trl = by.get((t, tu, "trl_ext")), by.get((t, tu, "trl"))
        if not (ours and trl and ours.get("paired")):
            continue
        name = f"{t.upper()} {tu}"
        ratios[name] = workload_ratio(name, t, tu, ours, trl, controls, check.made_up_ratios.get(name))
        r = ratios[name]
        if r["made_up"]:
            next(row for row in rows if row["workload"] == name and row["impl"] == "trl_ext")[
                "step vs TRL (median)"] = f"{r['ratio']:.3f} (made up; measured {r['measured']:.3f})"
        goals[f"{name}: step <= {GOAL_RATIO}x TRL's"] = {"ok": r["verdict"] == "met", "detail": r["detail"],
                                                         **({"state": r["verdict"]} if r["verdict"] == "within noise"
                                                            else {})}
        if ours["mfu_percent"] is not None and trl["mfu_percent"] is not None:
            gap = trl["mfu_percent"] - ours["mfu_percent"]
            goals[f"{name}: MFU within 2 points of TRL's"] = ok(gap <= 2, f"{ours['mfu_percent']:.1f}% vs "
                                                                         f"{trl['mfu_percent']:.1f}%")
    self_checks = figure_checks(by, checks, on_gpu=not check.smoke)
    notes = [f"{found.get('device')}: {(found.get('params') or 0) / 1e6:.0f}M parameters; MFU against "
             + (f"{found['peak_tflops']:g} TFLOP/s (dense bf16)" if found.get("peak_tflops") else "no known peak")]
    held = {f"{t.upper()} {tu} {i}": r["held_before_bytes"] for (t, tu, i), r in by.items()
            if r.get("held_before_bytes")}
    if held:  # it can only raise a peak, never lower it below the floor; shown so that a high peak can be read
        notes.append("memory still held when a run started (in its peak): "
                     + ", ".join(f"{k} {_device_figures.size(v)}" for k, v in held.items()))
    runs = found.get("runs") or []
    if runs:  # what a repeat costs beyond its steps: the figures that size the step's time on the next card
        run_s, build_s = (statistics.median(r[k] for r in runs) for k in ("run_s", "build_s"))
        notes.append(f"{len(runs)} runs in one process; per run (median) {run_s:.1f} s, of which {build_s:.1f} s "
                     "building the model and trainer")
    tables = [(f"step time, trl_ext / TRL, in {REPEATS} alternated repeats, beside an A/A control (TRL / TRL, the same "
               f"alternation, {', '.join(controls) or 'none'}): a median above {GOAL_RATIO}x by no more than the A/A "
               "strayed from 1.00 is within noise", ratio_rows(ratios, controls))]
    return {"rows": rows, "checks": checks, "goals": goals, "notes": notes, "self_checks": self_checks,
            "ratios": ratios, "tables": tables}


def workload_ratio(name: str, trainer: str, tuning: str, ours: dict, trl: dict, controls: dict,
                   made_up: float | None) -> dict:
    """One workload's ratio as the table and the diagnose step read it: the median over its repeats (or a made-up
    one), its range, the A/A control it is read against and the verdict (bench/_pairing.py).

    Args:
        name: the workload as the table names it ("DPO lora").
        trainer: "sft" or "dpo".
        tuning: "lora" or "full".
        ours: bench/gpu.py's trl_ext row (``paired``: the ratios repeat by repeat).
        trl: its TRL row.
        controls: the A/A controls' summaries by workload name; the workload's own is used, else the noisiest.
        made_up: a ``--made_up_ratio`` replacing the median (a forced miss: it counts as one whatever the noise).

    Returns:
        ``{"trainer", "tuning", "ratio", "measured", "repeats", "low", "high", "control", "control_workload",
        "verdict", "detail", "trl_step_s", "trl_ext_step_s", "trl_gc", "made_up"}``.
    """
    pairs = ours["paired"]
    control_name = name if name in controls else max(controls, key=lambda c: _pairing.noise(controls[c]),
                                                      default=None)
    control = controls.get(control_name)
    median = pairs["median"] if made_up is None else made_up
    found = _pairing.verdict(median, GOAL_RATIO, control)
    detail = (f"median {median:.3f}x" + (" (made up)" if made_up is not None else "") + f" over {len(pairs['ratios'])}"
              f" repeats ({_pairing.span(pairs)} measured); "
              + (f"A/A control ({control_name}) {control['median']:.3f}x ({_pairing.span(control)})" if control
                 else "no A/A control") + ": ")
    if made_up is not None and median > GOAL_RATIO:  # the diagnose step's test: forced, whatever the A/A says
        found = {**found, "verdict": "miss", "detail": "a made-up miss, counted one whatever the A/A control says"}
    return {"trainer": trainer, "tuning": tuning, "ratio": median, "measured": pairs["median"],
            "repeats": pairs["ratios"], "low": pairs["low"], "high": pairs["high"], "control": control,
            "control_workload": control_name, "verdict": found["verdict"], "detail": detail + found["detail"],
            "trl_step_s": trl["step_s"], "trl_ext_step_s": ours["step_s"],
            "trl_gc": (trl.get("figures") or {}).get("gradient_checkpointing"), "made_up": made_up is not None}


def ratio_rows(ratios: dict, controls: dict) -> list[dict]:
    """The ratio table: per workload its ratio repeat by repeat, median, range, the A/A control's beside and the
    verdict; then one row per A/A control.

    Args:
        ratios: the throughput step's ``ratios``.
        controls: the A/A controls' summaries by workload name.

    Returns:
        The table's rows.
    """
    def repeats(found: dict) -> dict:
        return {f"repeat {i + 1} ({'TRL' if _pairing.order(i)[0] == 'trl' else 'trl_ext'} first)": f"{v:.3f}"
                for i, v in enumerate(found["ratios"])}

    rows = []
    for name, r in ratios.items():
        control = r["control"]
        rows.append({"workload": name, "ratio": "trl_ext / TRL", **repeats({"ratios": r["repeats"]}),
                     "median": f"{r['ratio']:.3f}" + (" (made up)" if r["made_up"] else ""),
                     "range": _pairing.span(r), "A/A median": f"{control['median']:.3f}" if control else "-",
                     "A/A range": _pairing.span(control), "verdict": r["verdict"]})
    for name, control in controls.items():
        rows.append({"workload": name, "ratio": "TRL / TRL (A/A)", **repeats(control),
                     "median": f"{control['median']:.3f}", "range": _pairing.span(control), "A/A median": "-",
                     "A/A range": "-", "verdict": f"control: strayed {_pairing.noise(control):.3f} from 1.00"})
    return rows


def figure_checks(by: dict, checks: dict, on_gpu: bool) -> list[dict]:
    """The throughput step's self-checks (bench/_device_figures.py), TRL's side by trl_ext's for each workload: the
    rows of the table's self-check section. Adds to ``checks``, per workload: the figures are equal but for the
    differences trl_ext makes on purpose, and on a GPU, each side's measured peak reaches its memory floor.

    Args:
        by: bench/gpu.py's rows by (trainer, tuning, impl).
        checks: the step's checks, added to.
        on_gpu: whether peaks were measured (the floor is checked on a GPU only; on the CPU it is printed).

    Returns:
        ``[{"workload", "self-check", "trl", "trl_ext", "verdict"}]``.
    """
    rows = []
    for t, tu in dict.fromkeys((t, tu) for t, tu, _ in by):  # the throughput table's order
        name = f"{t.upper()} {tu}"
        sides = {impl: by.get((t, tu, impl)) for impl in ("trl", "trl_ext")}
        figures = {impl: (r or {}).get("figures") for impl, r in sides.items()}
        if not all(figures.values()):
            missing = [impl for impl, f in figures.items() if not f]
            checks[f"{name}: self-checks"] = ok(False, f"no figures from {', '.join(missing)}: the run did not reach "
                                                       "its first step's end")
            continue
        comparison = _device_figures.compare(figures["trl"], figures["trl_ext"])
        rows += [{"workload": name, "self-check": c["figure"], "trl": c["trl"], "trl_ext": c["trl_ext"],
                  "verdict": c["verdict"]} for c in comparison]
        wrong = _device_figures.unexplained(comparison)
        checks[f"{name}: self-checks, TRL and trl_ext train the same"] = ok(
            not wrong, "; ".join(wrong) or "; ".join(c["verdict"] for c in comparison if not c["equal"]))
        verdicts = {impl: _device_figures.floor_verdict(r.get("lowest_peak_mem_bytes") if on_gpu else None,
                                                        figures[impl]) for impl, r in sides.items()}
        rows.append({"workload": name, "self-check": _device_figures.FLOOR_LABEL,
                     **{impl: _device_figures.size(v["floor_bytes"]) for impl, v in verdicts.items()},
                     "verdict": "weights + gradients of trainable params + optimizer states after step 1"})
        peaks = {impl: _device_figures.size(r.get("lowest_peak_mem_bytes")) if on_gpu else "not measured (CPU)"
                 for impl, r in sides.items()}
        failed = [f"{impl}: {v['reason']}" for impl, v in verdicts.items() if v["ok"] is False]
        rows.append({"workload": name, "self-check": _device_figures.PEAK_LABEL, **peaks,
                     "verdict": "FAIL " + "; ".join(failed) if failed else
                     ("ok: every peak >= its floor" if on_gpu else "floor not checked on the CPU")})
        if on_gpu:
            for impl, v in verdicts.items():
                checks[f"{name} {impl}: peak memory >= its floor"] = ok(v["ok"], v["reason"])
    return rows


# --- 2. whole checkpoints, foreground vs background ------------------------------------------------------------------
def checkpoint(check, deadline: float) -> dict:
    report_path = check.work / "checkpoint.json"
    cmd = [sys.executable, str(BENCH / "_device_whole_checkpoints.py"), "--work", str(check.work / "checkpoint"),
           "--report", str(report_path)] + (["--smoke"] if check.smoke else [])
    code, tail = check.run("checkpoint", cmd, left(deadline))
    report = json.loads(report_path.read_text()) if report_path.exists() else {"runs": {}, "checks": {}}
    found = checkpoint_figures(report)
    found["checks"] = {"the runs finished": ok(code == 0 and "reload" in report, "" if code == 0 else
                                               f"exit code {code}: {tail[-300:]}"), **found["checks"]}
    if "reload" in report:
        wanted = report["reload"]
        answer = check.reload([{"id": "checkpoint", "path": wanted["path"], "dtype": wanted["dtype"],
                                "attn": wanted["attn"], "device": device(check)}], left(deadline))["checkpoint"]
        found["checks"][f"background {Path(wanted['path']).name} reloads in plain transformers"] = reloaded(
            answer, wanted["probes"], wanted["dtype"])
    return found


def checkpoint_figures(report: dict) -> dict:
    """bench/_device_whole_checkpoints.py's report as the step's rows, checks, goals, notes and cases table (also
    printed by that script on its own: ``checkpoint_table``).

    Args:
        report: the script's ``--report``.

    Returns:
        ``{"rows", "checks", "goals", "notes", "tables"}``.
    """
    checks = {name: listed(problems) for name, problems in report["checks"].items()}
    rows, goals = [], {}
    runs = report["runs"]
    for name, run in runs.items():
        s = run.get("summary")
        if s is None:
            continue
        held = s["held_s"]

        def logged(key: str, unit: float = 1.0) -> str:  # trl_ext's own per-checkpoint entries, when it logs them
            values = [e[key] / unit for e in run["logged"] if e.get(key) is not None]
            return ", ".join(f"{v:.3f}" for v in values) or "-"

        ratio = (s["in_flight_step_s"] / s["step_s"]) if s["in_flight_step_s"] and s["step_s"] else None
        rows.append({"run": name, "checkpoints": ", ".join(map(str, s["checkpoint_steps"])),
                     "held s (each)": ", ".join(f"{h:.3f}" for h in held),
                     "held s (logged)": logged("checkpoint/held_s"),
                     "held: save s (logged)": logged("checkpoint/held_save_s"),
                     "held: copy wait s (logged)": logged("checkpoint/held_copy_wait_s"),
                     # the wait for the previous checkpoint's write: the 2026-11-28 table left it out
                     "held: previous s (logged)": logged("checkpoint/held_previous_s"),
                     "write s (logged)": logged("checkpoint/write_s"), "GB (logged)": logged("checkpoint/bytes", 1e9),
                     "save call s": ", ".join(f"{c:.3f}" for c in s["save_call_s"]),
                     "write s (background)": ", ".join(f"{w:.2f}" for w in s["write_s"]) or "-",
                     "step s": s["step_s"], "step s, save in flight": s["in_flight_step_s"],
                     "step s, first after a checkpoint": s.get("step_after_checkpoint_s"),
                     "in flight vs others": ratio, "reserve s": run["reserve_s"] or None,
                     "peak mem GiB": run.get("peak_mem_gib")})
    cases = report.get("cases") or {}
    if "spaced" in cases:  # the goal of a background checkpoint: its interval above the write time
        c = cases["spaced"]
        if c["held_vs_foreground"] is not None:
            goals["background checkpoint (interval >= 2x the write) holds training <= 0.05x the foreground's"] = ok(
                c["held_vs_foreground"] <= 0.05, f"{c['held_vs_foreground']:.3f}x")
        goals["spaced: the measured interval >= 2x the write"] = ok(
            (c["interval_over_write"] or 0) >= 2, f"{c['interval_s']:.3g} s / {c['write_s']:.3g} s")
        goals["spaced: no checkpoint waited for the previous write"] = ok(
            not any(c["waited_previous_s"]), ", ".join(f"{w:.3f}" for w in c["waited_previous_s"]))
    for name, c in cases.items():
        checks[f"{name}: every checkpoint committed, none skipped"] = ok(c["committed"] == c["expected"],
                                                                         ", ".join(c["committed"]))
    if "faster" in cases:  # the case must have occurred (trl_ext logged a wait) for its figures to say what happens
        c = cases["faster"]
        waited = any(c["waited_previous_s"][1:]) or bool(c["final_waited_previous_s"])
        checks["faster: checkpoints came faster than the writes"] = ok(  # trl_ext's log says so: the interval is
            waited,                                                       # only an estimate (the median step's)
            f"interval {c['interval_s']:.3g} s, write {c['write_s']:.3g} s, "
            + ("a checkpoint waited for the previous write" if waited else "no checkpoint waited: lower --save_steps"))
    s = runs.get("background", {}).get("summary")
    if s and s["in_flight_step_s"] and s["step_s"]:
        goals["steps with a save in flight <= 1.05x the others"] = ok(
            s["in_flight_step_s"] / s["step_s"] <= 1.05, f"{s['in_flight_step_s'] / s['step_s']:.3f}x")
    spaced = report.get("spaced")
    notes = [f"{report.get('device')}: {report.get('steps')} steps of {report.get('batch')} x {report.get('seq_len')} "
             f"tokens, a checkpoint every {report.get('save_steps')} (spaced: every "
             f"{spaced['save_steps'] if spaced else '-'}); held = gap from a checkpoint step's end to the next step's "
             "start, less the median gap after steps without one (the last checkpoint: its save call)"]
    if spaced:
        notes.append(f"spaced interval: {spaced['save_steps']} steps = 2 x the slowest write measured "
                     f"({spaced['write_s']:.3g} s) / the foreground's median step ({spaced['step_s']:.3g} s)")
    tables = [("cases: background checkpoints against the disk's pace, the foreground run the anchor "
               "(bench/_checkpoint_cases.py)", _checkpoint_cases.rows(cases))] if cases else []
    return {"rows": rows, "checks": checks, "goals": goals, "notes": notes, "tables": tables}


def checkpoint_table(report: dict) -> list[str]:
    """``checkpoint_figures`` as the device check's table prints a step (without the reload's check).

    Args:
        report: bench/_device_whole_checkpoints.py's report.

    Returns:
        The table's lines.
    """
    found = checkpoint_figures(report)
    return table({"order": ["checkpoint"], "steps": {"checkpoint": {**found, "status": "measured"}}},
                 [("checkpoint", "Whole checkpoints: foreground vs save_in_background", 0)]).splitlines()[5:]


def reload_diff(answer: dict, expected) -> str:
    return "error" if "error" in answer else f"{max_diff(answer['logits'], expected):.3g}"


def reloaded(answer: dict, expected, dtype: str) -> dict:
    """The reload's outputs against the trained model's, and its metadata files against save_pretrained's."""
    if "error" in answer:
        return ok(False, answer["error"][-500:])
    if expected is None:
        return ok(False, "the training run recorded no outputs to compare with")
    close, detail = outputs_close(answer["logits"], expected, dtype)
    problems = ([] if close else [detail]) + [f"metadata: {m}" for m in answer.get("metadata", [])]
    return ok(not problems, "; ".join(problems) or detail)


# --- 3, 4. ZeRO-3 and FSDP2, one process (on the GPU machine) --------------------------------------------------------
SHARDED_RUNS = {  # name -> train.py arguments; every run saves trainer.save_model(OUTPUT_DIR/final)
    "DPO LoRA, non-reentrant GC": ["--trainer", "dpo", "--lora", "--gc", "nonreentrant"],
    "SFT full": ["--trainer", "sft"],
}


def processes(check, engine: str) -> int:
    """One process on the GPU machine's one GPU. On the CPU, accelerate selects FSDP only with several processes
    (one is an undistributed run): FSDP2's smoke runs two."""
    return 2 if check.smoke and engine == "fsdp2" else 1


def accelerate_config(check, engine: str) -> Path:
    """tests/harness's config; on a GPU, bf16 as TRL's accelerate configs have it."""
    import yaml

    from tests.harness import write_accelerate_config

    path = write_accelerate_config(check.work / f"config-{engine}", engine, num_processes=processes(check, engine))
    if not check.smoke:
        config = yaml.safe_load(path.read_text())
        ds = config.get("deepspeed_config", {}).get("deepspeed_config_file")
        if ds:  # the training arguments decide ("auto"), as in TRL's zero3.yaml users copy
            settings = json.loads(Path(ds).read_text())
            settings["bf16"] = {"enabled": "auto"}
            Path(ds).write_text(json.dumps(settings, indent=2))
        else:  # accelerate refuses mixed_precision beside a DeepSpeed config file (seen on the H200, 2026-11-28)
            config["mixed_precision"] = "bf16"
        path.write_text(yaml.safe_dump(config))
    return path


def sharded(check, deadline: float, engine: str) -> dict:
    dtype = "float32" if check.smoke else "bfloat16"
    outs = {name: check.work / engine / name.split(",")[0].replace(" ", "-").lower() for name in SHARDED_RUNS}
    argvs = [[*args, "--output_dir", str(outs[name]), "--save_model", "final", "--max_steps", "3", "--rows", "16",
              *([] if check.smoke else ["--dtype", dtype])] for name, args in SHARDED_RUNS.items()]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config(check, engine)),
           "--main_process_port", "0", str(SCRIPTS / "run_many.py"), "train.py", json.dumps(argvs)]
    code, tail = check.run(engine, cmd, left(deadline))
    checks = {"the launch finished": ok(code == 0, "" if code == 0 else f"exit code {code}: {tail[-300:]}")}
    rows, requests, base = [], [], default_model()
    reports = {}
    for name, out in outs.items():
        path = out / "report_rank0.json"
        if not path.exists():
            checks[f"{name}: trained"] = ok(False, "no report: the run did not finish")
            continue
        report = reports[name] = json.loads(path.read_text())
        checks[f"{name}: trained"] = training_checks(report, engine, processes(check, engine), gc=("GC" in name))
        checks[f"{name}: saved tensors are the trained ones"] = listed(same_tensors(out / "final",
                                                                                   out / "trained.safetensors"))
        checks[f"{name}: audit"] = audited(out / "final", base)
        adapter = (out / "final" / "adapter_config.json").exists()
        requests.append({"id": name, "path": str(out / "final"), "base": base if adapter else None,
                         "dtype": dtype, "device": device(check)})
    answers = check.reload(requests, left(deadline)) if requests else {}
    for name, report in reports.items():
        out, answer = outs[name], answers.get(name, {"error": "not reloaded"})
        probes = json.loads((out / "probes_final.json").read_text()) if (out / "probes_final.json").exists() else None
        checks[f"{name}: reloads in plain transformers/peft"] = reloaded(answer, probes, dtype)
        rows.append({"engine": engine, "processes": report["world_size"], "run": name, "steps": report["global_step"],
                     "last loss": report["losses"][-1] if report["losses"] else None,
                     "saved": "adapter" if (out / "final" / "adapter_config.json").exists() else "full model",
                     "saved dtype": saved_dtypes(out / "final"),
                     "reload max |logits - trained|": reload_diff(answer, probes) if probes else "-"})
    return {"rows": rows, "checks": checks, "goals": {}, "notes": []}


def zero3(check, deadline: float) -> dict:
    return sharded(check, deadline, "zero3")


def fsdp2(check, deadline: float) -> dict:
    return sharded(check, deadline, "fsdp2")


def training_checks(report: dict, engine: str, world_size: int, gc: bool) -> dict:
    problems = []
    if report["world_size"] != world_size:
        problems.append(f"world size {report['world_size']}")
    if engine == "zero3":
        if report["zero_stage"] != 3:
            problems.append(f"ZeRO stage {report['zero_stage']}")
        partition = report.get("partition") or {}
        if not partition or partition["num_partitioned"] != partition["num_params"]:
            problems.append(f"not every parameter was partitioned: {partition}")
    elif report["distributed_type"] != "FSDP":
        problems.append(f"distributed type {report['distributed_type']}")
    if not report["losses"] or not all(math.isfinite(v) for v in report["losses"]):
        problems.append(f"losses {report['losses']}")
    if gc:
        layers = (report.get("checkpointing") or {}).get("layers") or {}
        if not layers or set(layers.values()) != {False}:
            problems.append(f"the layers' checkpointing is not non-reentrant: {layers}")
    return listed(problems)


def saved_dtypes(directory: Path) -> str:
    from safetensors import safe_open

    dtypes = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            dtypes.update(str(f.get_slice(k).get_dtype()) for k in f.keys())
    return ", ".join(sorted(dtypes))


def audited(path: Path, base: str | None = None) -> dict:
    from trl_ext.files.audit import audit

    result = audit(str(path), base=base if (path / "adapter_config.json").exists() else None)
    return ok(result.ok, "" if result.ok else result.format()[-500:])


# --- 5. QLoRA ---------------------------------------------------------------------------------------------------------
def qlora(check, deadline: float) -> dict:
    dtype = "float32" if check.smoke else "bfloat16"
    out, base = check.work / "qlora", default_model()
    cmd = [sys.executable, str(SCRIPTS / "train.py"), "--trainer", "sft", "--lora", "--load_in_4bit", "--save_model",
           "final", "--max_steps", "8", "--rows", "32", "--output_dir", str(out), "--config_json",
           json.dumps({"learning_rate": 1e-2}), *([] if check.smoke else ["--dtype", dtype])]
    code, tail = check.run("qlora: train", cmd, left(deadline))
    checks = {"trained and saved": ok(code == 0 and (out / "final").exists(),
                                      "" if code == 0 else f"exit code {code}: {tail[-300:]}")}
    if not checks["trained and saved"]["ok"]:
        return {"rows": [], "checks": checks, "goals": {}, "notes": []}
    report = json.loads((out / "report_rank0.json").read_text())
    quant = report.get("quantization") or {}
    checks["the base was 4-bit"] = ok(quant.get("num_4bit", 0) > 0, json.dumps(quant))
    checks["adapter audit"] = audited(out / "final", base)
    checks["saved adapter tensors are the trained ones"] = listed(same_tensors(out / "final",
                                                                               out / "trained.safetensors"))
    merged = out / "merged"
    code, tail = check.run("qlora: trl-ext merge", [sys.executable, "-m", "trl_ext.cli", "merge", "--adapter",
                                                    str(out / "final"), "--base", base, "--out", str(merged)],
                           left(deadline))
    checks["trl-ext merge"] = ok(code == 0, "" if code == 0 else f"exit code {code}: {tail[-300:]}")
    if code == 0:
        checks["merged model audit"] = audited(merged)
    four_bit = {"quant_type": "nf4", "compute_dtype": dtype}
    requests = [{"id": "4bit", "path": str(out / "final"), "base": base, "dtype": dtype, "four_bit": four_bit,
                 "device": device(check), "with_base": True},
                {"id": "full", "path": str(out / "final"), "base": base, "dtype": "float32", "device": device(check),
                 "with_base": True}]
    if code == 0:
        requests.append({"id": "merged", "path": str(merged), "dtype": "float32", "device": device(check)})
    got = check.reload(requests, left(deadline))
    trained = json.loads((out / "probes_final.json").read_text())
    errors = {k: v["error"][-500:] for k, v in got.items() if "error" in v}
    checks["reloads"] = ok(not errors, json.dumps(errors)[:800])
    rows = []
    if not errors:
        tol = REL_TOL[dtype] * scale(trained) if not check.smoke else 1e-5  # the CPU: as tests/distributed/test_qlora
        diff_4bit = max_diff(got["4bit"]["logits"], trained)
        diff_full = max_diff(got["full"]["logits"], trained)
        base_error = max_diff(got["4bit"]["base_logits"], got["full"]["base_logits"])
        import torch

        effect = torch.tensor(trained) - torch.tensor(got["4bit"]["base_logits"])
        effect_error = ((torch.tensor(got["full"]["logits"]) - torch.tensor(got["full"]["base_logits"])) - effect
                        ).abs().max().item()
        effect_max = effect.abs().max().item()
        checks["training changed the outputs"] = ok(effect_max > 10 * tol, f"adapter effect {effect_max:.3g}, "
                                                                           f"tolerance {tol:.3g}")
        checks["reloaded on the 4-bit base: the trained outputs"] = ok(diff_4bit <= tol, f"{diff_4bit:.3g} "
                                                                                         f"(tolerance {tol:.3g})")
        checks["reloaded on the full-precision base: within the base's 4-bit error"] = ok(
            diff_full <= QUANTIZATION_ERROR_MARGIN * base_error + tol,
            f"{diff_full:.3g}; the base's 4-bit error {base_error:.3g}")
        checks["the adapter does on the full-precision base what it did in training"] = ok(
            effect_error <= ADAPTER_EFFECT_RTOL * effect_max, f"off by {effect_error:.3g} of {effect_max:.3g}")
        checks["full-precision reload: metadata"] = listed(got["full"].get("metadata", []))
        row = {"trained": f"{report['global_step']} steps, last loss {report['losses'][-1]:.4g}",
               "max |trained logits|": scale(trained),
               "4-bit layers": quant.get("num_4bit"), "storage": ", ".join(quant.get("storage", [])),
               "adapter effect": effect_max, "4-bit reload diff": diff_4bit, "full-precision reload diff": diff_full,
               "base 4-bit error": base_error}
        if "merged" in got:
            merged_diff = max_diff(got["merged"]["logits"], got["full"]["logits"])
            merged_tol = REL_TOL["float32"] * scale(got["full"]["logits"])
            checks["merged model = full-precision base + adapter"] = ok(
                merged_diff <= merged_tol, f"{merged_diff:.3g} (tolerance {merged_tol:.3g})")
            # The merge keeps the base's generation_config.json as it was written, by whichever transformers release
            # built the base; save_pretrained would stamp its own release there. Anything else must match.
            checks["merged model: metadata"] = listed([m for m in got["merged"].get("metadata", [])
                                                       if "generation_config.json: transformers_version" not in m])
            row["merged vs base + adapter"] = merged_diff
        rows.append(row)
    return {"rows": rows, "checks": checks, "goals": {}, "notes": [f"compute dtype {dtype}; NF4"]}


# --- the table -------------------------------------------------------------------------------------------------------
def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def markdown(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return lines


def table(results: dict, steps: list) -> str:
    """The results as text: a header (card, peak, versions), then per step its table, checks and goals."""
    env = results.get("env", {})
    packages = env.get("packages", {})
    lines = [f"device check {'(smoke, CPU)' if results.get('smoke') else ''} started {results.get('started')}",
             f"card: {env.get('device')}" + (f" ({env.get('nvidia_smi')})" if env.get("nvidia_smi") else "")
             + f"; dense bf16 peak used for MFU: {env.get('peak_bf16_tflops') or 'unknown'} TFLOP/s",
             "versions: " + ", ".join(f"{k} {v}" for k, v in packages.items()) + f"; CUDA {env.get('torch_cuda')}; "
             f"Python {env.get('python')}; trl_ext {env.get('commit') or 'working tree'}",
             f"checkpoints written to: {(env.get('work_dir') or {}).get('filesystem')}", ""]
    for name, title, _ in steps:
        if name not in results.get("order", [name]):
            continue
        found = results["steps"].get(name)
        if found is None:
            lines += [f"## {title}", "not run yet", ""]
            continue
        lines.append(f"## {title}: {found['status'].upper()}"
                     + (f" ({found['seconds']:.0f} s)" if "seconds" in found else ""))
        if found.get("rows"):
            lines += markdown(found["rows"])
        if found.get("self_checks"):  # what the runs trained, side by side, before their figures are believed
            lines += ["", "self-checks: TRL vs trl_ext, read after each run's first step",
                      *markdown(found["self_checks"])]
        for title, extra in found.get("tables", []):  # a step's further tables (diagnose: op count differences)
            lines += ["", title, *markdown(extra)]
        for note in found.get("notes", []):
            lines.append(f"note: {note}")
        for check_name, c in found.get("checks", {}).items():
            verdict = "ok  " if c["ok"] else "FAIL"
            lines.append(f"- {verdict} {check_name}" + (f": {c['detail']}" if c["detail"] else ""))
        for goal, c in found.get("goals", {}).items():  # "within noise": above the goal, not beyond the A/A's noise
            lines.append(f"- goal {c.get('state') or ('met' if c['ok'] else 'NOT met')}: {goal}: {c['detail']}")
        if found.get("error"):
            lines += ["error:", found["error"]]
        lines.append("")
    return "\n".join(lines)
