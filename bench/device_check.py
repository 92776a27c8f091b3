"""trl_ext's GPU-only paths, checked and measured in one run on a machine with one GPU (bench/device_check.sh starts it
there, after installing the carried wheels), or with ``--smoke`` the same code on the CPU (a test runs it in CI).

    python bench/device_check.py OUTDIR [--smoke] [--budget SECONDS] [--only STEP ...]

The steps, in this order, so that a short stretch of GPU time still yields the first ones (bench/_device_steps.py):
1. ``throughput``: bench/gpu.py on SFT and DPO x LoRA and full, gradient checkpointing on, TRL against trl_ext, a
   ~0.5B model in bf16, in 2 alternated repeats (TRL first, then trl_ext first) beside an A/A control (DPO full, TRL's
   trainer on both sides, the same alternation; bench/_pairing.py, as bench/overhead.py pairs): tokens/s, MFU against
   the card's dense bf16 peak, peak memory, step time over TRL's repeat by repeat, its median and range, the A/A's
   beside, and a verdict: a median above 1.02x by no more than the A/A strayed from 1.00 is "within noise", not a
   miss. First its self-checks (bench/_device_figures.py), printed side by side: what each side trained (trainable
   parameters, optimizer state, dtypes, gradient checkpointing mode, attention), equal or the difference named; on a
   GPU a workload whose peak memory is below its floor (weights + gradients + optimizer states) fails.
2. ``checkpoint``: whole checkpoints of a ~0.5B full fine-tune with AdamW (bench/_device_whole_checkpoints.py),
   foreground against ``save_in_background``: how long each holds training, steps with a save in flight against the
   others; the background checkpoints equal the foreground's, pass the audit, reload, and a resume from one is exact.
   Two cases against the foreground (bench/_checkpoint_cases.py): checkpoints due faster than the disk writes them
   (each waits for the previous write), and spaced at twice the measured write time (~40 s more on the H200); per
   checkpoint the time it held training, the final save apart.
3. ``zero3`` and 4. ``fsdp2``: one process each (NCCL on a GPU): a LoRA DPO run with non-reentrant gradient
   checkpointing and a full SFT run, bf16 (tests/scripts/train.py): the saves hold the trained tensors, pass the
   audit and reload in plain transformers/peft.
5. ``qlora``: 4-bit QLoRA (bitsandbytes): trains, saves, ``trl-ext merge``, and reloads on the 4-bit base, on the
   full-precision base and merged.
6. ``diagnose``: where step 1 found trl_ext's step above 1.02x TRL's (a miss, not within noise), and on a GPU, in
   the time left, where it is above 1.00 (a suspect): trl_ext beside TRL step by step (two trainers in one process
   taking turns), the same with reentrant gradient checkpointing and (LoRA) with TRL's input-require-grads hook kept,
   an A/A pair, and a short torch-profiler record of both sides (bench/_device_diagnose.py). On the CPU only a ratio
   made up with ``--made_up_ratio "DPO lora=1.10"`` counts as a miss, whatever the A/A control says (a test forces
   one).

Each step runs in processes of its own with its own time limit, never past the budget; saved models are reloaded in
one process that never imports trl_ext (bench/_device_reload.py), started at once so that its imports overlap the
first step. OUTDIR receives few files (the device machine returns at most 8): ``results.json`` and ``table.txt``,
rewritten after each step, and ``log.txt``, every process's output as it runs. The table is printed at the end.
Exit code 0 when every step ran and passed every check, 1 otherwise. Performance goals are reported, never failed.
"""

import argparse
import concurrent.futures
import datetime
import importlib.metadata
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))  # tests.harness
sys.path.insert(0, str(BENCH))  # _device_steps

import _device_steps  # noqa: E402

from tests.harness import kill_tree  # noqa: E402

# (name, title, time limit on a GPU in seconds): the order is the issue's
STEPS = [
    ("throughput", "Throughput: TRL vs trl_ext, ~0.5B bf16, gradient checkpointing on, repeats + A/A control", 200),
    ("checkpoint", "Whole checkpoints of a ~0.5B full fine-tune (AdamW): foreground vs save_in_background", 200),
    ("zero3", "DeepSpeed ZeRO-3 (one process on a GPU): saves verify and reload", 120),
    ("fsdp2", "FSDP2 (one process on a GPU): saves verify and reload", 80),
    ("qlora", "QLoRA, bitsandbytes 4-bit: trains, saves, merges, reloads", 60),
    # last: it only runs where a throughput ratio missed, in the time the others left
    ("diagnose", "Where a step ratio misses 1.02x (or, on a GPU, is above 1.00): trl_ext beside TRL step by step, "
     "with reentrant checkpointing, with TRL's input hook, an A/A pair; both sides profiled", 150),
]
SMOKE_LANES = [["throughput", "qlora", "diagnose"], ["checkpoint", "zero3", "fsdp2"]]  # on the CPU, two at a time
PACKAGES = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "bitsandbytes",
            "safetensors", "tokenizers", "huggingface_hub", "pyarrow", "numpy")
MIN_STEP_S = 20  # a step with less time left than this is not started


class Check:
    """One run of the device check: where things go, the time left, the processes it starts, what it found."""

    def __init__(self, out: Path, work: Path, smoke: bool, budget: float, parallel: bool,
                 made_up_ratios: dict | None = None):
        self.out, self.work, self.smoke, self.parallel = out, work, smoke, parallel
        self.made_up_ratios = made_up_ratios or {}  # workload ("DPO lora") -> the step ratio that replaces its own
        self.deadline = time.monotonic() + budget
        self.lock = threading.Lock()  # the results and log.txt, written by both lanes of a smoke run
        self.reload_lock = threading.Lock()  # one request at a time to the reload process
        self.results = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "smoke": smoke,
                        "budget_s": budget, "env": {}, "steps": {}}
        self.log = out / "log.txt"
        self.reloader = None

    # --- processes -------------------------------------------------------------------------------------------------
    def env(self) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        if self.smoke:
            env["OMP_NUM_THREADS"] = "1"  # two steps at a time on a small machine
        return env

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, title: str, cmd: list[str], limit: float) -> tuple[int | None, str]:
        """Run ``cmd`` from the repository with its output going to log.txt (via a file of its own when steps run in
        parallel); kill its whole process tree after ``limit`` seconds. Returns (exit code, None if killed; the last
        4000 characters of its output)."""
        limit = max(1.0, min(limit, self.remaining()))
        target = self.work / f"log-{threading.get_ident()}-{time.monotonic_ns()}.txt" if self.parallel else self.log
        start = target.stat().st_size if target.exists() else 0
        with open(target, "a") as log:
            log.write(f"\n===== {title}: {' '.join(cmd)}  (limit {limit:.0f} s; {time.strftime('%H:%M:%S')})\n")
            log.flush()
            began = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                kill_tree(proc)
            log.write(f"===== {title}: {'killed' if code is None else f'exit code {code}'} after "
                      f"{time.monotonic() - began:.1f} s\n")
        text = Path(target).read_bytes()[start:].decode(errors="replace")
        if self.parallel:
            with self.lock, open(self.log, "a") as log:
                log.write(text)
            os.unlink(target)
        return code, text[-4000:]

    def reload(self, requests: list[dict], limit: float) -> dict:
        """Answers of the reload process (started on first use, restarted if it died), by request id."""
        with self.reload_lock:
            if self.reloader is None or self.reloader.proc.poll() is not None:
                self.reloader = Reloader(self.log, self.env())
            return self.reloader.ask(requests, max(5.0, min(limit, self.remaining())))

    def close(self) -> None:
        if self.reloader is not None:
            self.reloader.close()

    # --- results ---------------------------------------------------------------------------------------------------
    def record(self, name: str, found: dict) -> None:
        with self.lock:
            self.results["steps"][name] = found
            (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
            (self.out / "table.txt").write_text(_device_steps.table(self.results, STEPS))


class Reloader:
    """The process that reloads saved models with plain transformers + peft (bench/_device_reload.py)."""

    def __init__(self, log: Path, env: dict):
        self.stderr = open(log, "a")
        self.proc = subprocess.Popen([sys.executable, str(BENCH / "_device_reload.py")], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     start_new_session=True)
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("RELOAD "):
                self.answers.put(json.loads(line[7:]))
        self.answers.put(None)  # the process ended

    def ask(self, requests: list[dict], limit: float) -> dict:
        end = time.monotonic() + limit
        for request in requests:
            self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        found = {}
        while len(found) < len(requests):
            try:
                answer = self.answers.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                self.close()
                raise TimeoutError(f"the reload process did not answer within {limit:.0f} s") from None
            if answer is None:
                raise RuntimeError(f"the reload process ended (exit code {self.proc.poll()}): see log.txt")
            if answer.get("id") != "ready":
                found[answer["id"]] = answer
        return found

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.stderr.close()


def environment(check: Check) -> dict:
    """Versions, the card and the disk the checkpoints go to, for the table's header."""
    found = {"python": sys.version.split()[0], "packages": {}}
    for name in PACKAGES:
        try:
            found["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found["packages"][name] = None
    try:
        found["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                         text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        found["commit"] = None
    import torch

    found["torch_cuda"] = torch.version.cuda
    found["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() and not check.smoke else "cpu"
    if found["device"] != "cpu":
        props = torch.cuda.get_device_properties(0)
        found["gpu_memory_gib"] = props.total_memory / 2**30
        found["capability"] = f"{props.major}.{props.minor}"
        try:
            found["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            found["nvidia_smi"] = f"not available: {exc}"
    found["peak_bf16_tflops"] = _device_steps.peak_tflops(found["device"])
    usage = shutil.disk_usage(check.work)
    found["work_dir"] = {"path": str(check.work), "free_gib": usage.free / 2**30,
                         "filesystem": _device_steps.filesystem(check.work)}
    found["cpus"] = os.cpu_count()
    return found


def run_step(check: Check, name: str, limit: float) -> None:
    """One step, its failure recorded rather than raised (the next steps still run)."""
    if check.remaining() < MIN_STEP_S and _device_steps.needs_time(name, check):
        check.record(name, {"status": "skipped", "error": f"{check.remaining():.0f} s of the budget left"})
        print(f"[device_check] {name}: skipped (out of time)", flush=True)
        return
    print(f"[device_check] {name}: started ({check.remaining():.0f} s of the budget left)", flush=True)
    start = time.monotonic()
    step_deadline = min(check.deadline, start + (limit if not check.smoke else 1e9))
    try:
        found = getattr(_device_steps, name)(check, step_deadline)
        found["status"] = "passed" if all(c["ok"] for c in found["checks"].values()) else "failed"
    except Exception:  # noqa: BLE001 - recorded; the next steps still run
        found = {"status": "error", "error": traceback.format_exc()[-4000:]}
    found["seconds"] = time.monotonic() - start
    check.record(name, found)
    failed = [k for k, c in found.get("checks", {}).items() if not c["ok"]]
    print(f"[device_check] {name}: {found['status']} in {found['seconds']:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"\n{found['error']}" if found.get("error") else ""), flush=True)


def made_up(parser: argparse.ArgumentParser, values: list[str]) -> dict[str, float]:
    """``--made_up_ratio`` values as {workload as the table names it ("DPO lora"): ratio}."""
    names = {f"{t} {tu}".lower(): f"{t.upper()} {tu}" for t in ("sft", "dpo") for tu in ("lora", "full")}
    found = {}
    for value in values:
        workload, _, ratio = value.rpartition("=")
        key = workload.strip().replace("-", " ").lower()
        if key not in names:
            parser.error(f"--made_up_ratio {value}: the workload is one of {', '.join(names.values())}")
        found[names[key]] = float(ratio)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="a folder for results.json, table.txt and log.txt")
    parser.add_argument("--smoke", action="store_true", help="the same code on the CPU: tiny models, fp32, gloo")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for every step together (default 510 on a GPU, 900 with --smoke)")
    parser.add_argument("--only", nargs="+", choices=[s[0] for s in STEPS], help="run these steps only")
    parser.add_argument("--work", help="where the runs write their checkpoints (default: a new temporary folder)")
    parser.add_argument("--made_up_ratio", action="append", default=[], metavar="WORKLOAD=RATIO",
                        help='replace a workload\'s measured step ratio, e.g. "DPO lora=1.10": a forced miss, which '
                             "the diagnose step then explains (its test)")
    cli = parser.parse_args(argv)
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(cli.work or tempfile.mkdtemp(prefix="device-check-"))
    work.mkdir(parents=True, exist_ok=True)
    budget = cli.budget or (900 if cli.smoke else 510)
    names = [s[0] for s in STEPS if not cli.only or s[0] in cli.only]
    check = Check(out, work, cli.smoke, budget, parallel=cli.smoke, made_up_ratios=made_up(parser, cli.made_up_ratio))
    check.results["env"] = environment(check)
    env = check.results["env"]
    disk = env.get("work_dir", {})
    print(f"[device_check] {env['device']}; dense bf16 peak {env['peak_bf16_tflops']} TFLOP/s; "
          + ", ".join(f"{k} {v}" for k, v in env["packages"].items()) + f"; checkpoints to {work} "
          f"({disk.get('filesystem')}, {disk.get('free_gib', 0):.0f} GiB free)", flush=True)
    check.results["order"] = names
    limits = {name: limit for name, _, limit in STEPS}
    if check.remaining() >= MIN_STEP_S:
        try:
            check.reload([], 5)  # start the reload process now: its imports overlap the first steps
        except Exception as exc:  # noqa: BLE001 - each step asks again and reports its own failure
            print(f"[device_check] the reload process did not start: {exc}", flush=True)
    try:
        if check.parallel:
            lanes = [[n for n in lane if n in names] for lane in SMOKE_LANES]
            with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
                for future in [pool.submit(lambda lane=lane: [run_step(check, n, limits[n]) for n in lane])
                               for lane in lanes]:
                    future.result()
        else:
            for name in names:
                run_step(check, name, limits[name])
    finally:
        check.close()
    table = _device_steps.table(check.results, STEPS)
    (out / "table.txt").write_text(table)
    print("\n" + table, flush=True)
    statuses = {n: check.results["steps"].get(n, {}).get("status") for n in names}
    ok = all(s == "passed" for s in statuses.values())
    print(f"[device_check] {'every step passed' if ok else 'NOT PASSED: ' + json.dumps(statuses)}; results in {out}",
          flush=True)
    if not cli.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
