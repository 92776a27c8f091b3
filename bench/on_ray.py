"""Ray's cost to a run, and a lost node's cost, on a private 2-node Ray cluster on this host (tests/ray/cluster.py).

    python bench/on_ray.py [--repeats 2] [--steps 40] [--skip overhead|recovery] [--standby both|on|off]
                           [--health-check-ms 1000]

1. Without failures: the same DPO job (ZeRO-3, the embedded tiny model, 4 processes, no checkpoints) under
   ``accelerate launch`` (``python recipes/dpo.py --num_processes 4``, the recipe launching itself) and as a Ray job
   (``ray job submit -- python recipes/dpo.py ...``: 4 workers, 2 on each node), alternated, ``--repeats`` each: from
   the command to the first training step, in parts; the median step; the whole job. Both run the recipe through
   bench/_ray_timing.py, which prints when each part happens.
2. Recovery: the same job with ``--num_processes 2-4`` and a checkpoint every 10 steps; at the first checkpoint
   after checkpoint-20 once every standby process has done its imports (``trl_ext.launching.ray.standby``; a loss
   later in a run), the second node is killed (its raylet, log monitor and workers, SIGKILL). ``--standby both`` (the
   default) runs it without standby processes (``TRL_EXT_RAY_STANDBY=0``), then with them, the node brought back
   between the two. The parts, from the kill to
   the first step after the resume: Ray Train's controller reports the lost workers (its health check of them, then
   trl_ext's verdict); it decides on the workers left (the lost node reported dead by trl_ext once its raylet refuses
   connections, Ray's view of the cluster refreshed);
   it starts them (placement, actors, process group); each rank's recipe starts (trl_ext's worker imports the
   trainers: transformers, TRL); the trainer is built (the model); ``train()`` loads the checkpoint (DeepSpeed's
   universal checkpoint for the other number of processes); the first step. Then Ray Train's own account of that
   group start, part by part (the debug lines its controller writes to the session's ``logs/train`` directory). Per
   run also: the first group's median step and the job's CPU seconds (what the spares' imports cost beside training),
   the spares' import times and resident memory.

``--health-check-ms P``: the head started with Ray's node health check every P ms and 3 failures to mark a node dead
(``--system-config`` ``health_check_period_ms``, ``health_check_failure_threshold``; Ray's defaults: 3000 ms, 5), a
cluster's own setting that no job can change.

Events the job prints (``[timing]``) carry their own time; Ray's own events (the controller's lines) are timed when
the bench first sees them in the job's log, polled every 0.25 s. Times are wall clock on this machine: run it on an
idle machine.
"""

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import deepspeed_op  # noqa: E402
from tests.ray.cluster import RayCluster  # noqa: E402

DPO = ["bench/_ray_timing.py", "--config", "accelerate_configs/zero3.yaml", "--config", "recipes/configs/dpo.yaml",
       "--eval_strategy", "no", "--report_to", "none", "--per_device_train_batch_size", "4", "--logging_steps", "1000"]
TIMING = re.compile(r"\[timing\] (\w+) ([\d.]+) restart (\d+)")
# Ray folds lines that differ only in their numbers (its log deduplication): not the timings
ENV = {"TRL_EXT_BENCH_RECIPE": "recipes/dpo.py", "RAY_DEDUP_LOGS_ALLOW_REGEX": r"\[trl_ext\]|\[timing\]"}


def _events(log: str) -> dict[tuple[str, int], list[float]]:
    found: dict[tuple[str, int], list[float]] = {}
    for name, when, restart in TIMING.findall(log):
        found.setdefault((name, int(restart)), []).append(float(when))
    return found


def _median_step(events, restart: int = 0) -> float:
    steps = events[("step", restart)]
    return statistics.median(b - a for a, b in zip(steps[2:], steps[3:]))


def _accelerate(out: Path, steps: int) -> tuple[dict, dict]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    done = subprocess.run([sys.executable, *DPO, "--max_steps", str(steps), "--save_strategy", "no",
                           "--num_processes", "4", "--output_dir", str(out)], cwd=REPO, env={**os.environ, **ENV},
                          capture_output=True, text=True, timeout=1800)
    ended = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = _events(done.stdout + done.stderr)
    parts = {"the command -> the launcher's Python up": events[("launch", 0)][0] - started,
             "-> accelerate launch started the ranks' Python": events[("start", 0)][0] - events[("launch", 0)][0],
             "-> the trainer built (imports: transformers, TRL; the model)":
                 events[("trainer_built", 0)][0] - events[("start", 0)][0],
             "-> the first step done": events[("first_step", 0)][0] - events[("trainer_built", 0)][0]}
    totals = {"command -> first step (s)": events[("first_step", 0)][0] - started,
              "median step (s)": _median_step(events), "whole job (s)": ended - started,
              "CPU (s)": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)}
    return parts, totals


class _Log:
    """A Ray job's log, polled: when each text was first seen."""

    def __init__(self, cluster: RayCluster, job: str):
        self.cluster, self.job, self.seen, self.text = cluster, job, {}, ""

    def poll(self, *texts: str) -> None:
        self.text = self.cluster.logs(self.job)
        now = time.time()
        for text in texts:
            if text not in self.seen and text in self.text:
                self.seen[text] = now

    def wait(self, text: str, timeout: float = 900) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.poll(text)
            if text in self.seen:
                return self.seen[text]
            time.sleep(0.25)
        raise TimeoutError(f"{text!r} not in job {self.job}'s log:\n{self.text[-3000:]}")


def _ray(cluster: RayCluster, out: Path, steps: int, name: str) -> tuple[dict, dict]:
    cpu = cluster.cpu_seconds()
    started = time.time()
    cluster.submit([*DPO, "--max_steps", str(steps), "--save_strategy", "no", "--output_dir", str(out)], name, ENV)
    log = _Log(cluster, name)
    group = log.wait("Started training worker group of size 4")
    assert cluster.wait_job(name, timeout=1800) == "SUCCEEDED", cluster.logs(name)[-4000:]
    ended = time.time()
    events = _events(cluster.logs(name))
    parts = {"the command -> the driver's Python up (ray job submit)": events[("launch", 0)][0] - started,
             "-> Ray Train started the group (placement, 4 actors, process group)": group - events[("launch", 0)][0],
             "-> the ranks' recipe starts (trl_ext's worker: transformers, TRL)": events[("start", 0)][0] - group,
             "-> the trainer built (the model)": events[("trainer_built", 0)][0] - events[("start", 0)][0],
             "-> the first step done": events[("first_step", 0)][0] - events[("trainer_built", 0)][0]}
    totals = {"command -> first step (s)": events[("first_step", 0)][0] - started,
              "median step (s)": _median_step(events), "whole job (s)": ended - started,
              "CPU (s)": cluster.cpu_seconds() - cpu}
    return parts, totals


def overhead(cluster: RayCluster, work: Path, repeats: int, steps: int) -> None:
    runs = {"accelerate launch": [], "ray job submit": []}
    for i in range(repeats):
        runs["accelerate launch"].append(_accelerate(work / f"acc{i}", steps))
        runs["ray job submit"].append(_ray(cluster, work / f"ray{i}", steps, f"overhead-{i}"))
    print(f"\nwithout failures: DPO, ZeRO-3, 4 processes, {steps} steps, no checkpoints; medians of {repeats}")
    for variant, results in runs.items():
        print(f"  {variant}: the start, in parts")
        for key in results[0][0]:
            print(f"    {key:<72} {statistics.median(r[0][key] for r in results):7.2f} s")
    print(f"  {'':<30} {'accelerate launch':>18} {'ray job submit':>16} {'ratio':>7}")
    for key in runs["accelerate launch"][0][1]:
        a = statistics.median(r[1][key] for r in runs["accelerate launch"])
        r = statistics.median(x[1][key] for x in runs["ray job submit"])
        print(f"  {key:<30} {a:>18.2f} {r:>16.2f} {r / a:>6.2f}x")


def _group_start_breakdown(cluster: RayCluster) -> list[str]:
    """Ray Train's own account of its last worker group start: the debug lines its controller writes to the session's
    ``logs/train/ray-train-sys-controller-*.log`` (JSON, one record a line) whatever the job's log level."""
    lines = []
    for log in sorted(Path(cluster.temp).glob("session_*/logs/train/ray-train-sys-controller-*.log"),
                      key=os.path.getmtime):  # the newest job's last
        for line in log.read_text().splitlines():
            try:
                message = json.loads(line).get("message", "")
            except ValueError:
                continue
            if message.startswith("Attempting to start training worker group"):
                lines = []  # a later start's account replaces an earlier one's
            if message.startswith("[Worker Group Initialization]"):
                lines.append(message.removeprefix("[Worker Group Initialization] "))
    return lines


def _spares_ready(cluster: RayCluster, job: str, standby: bool, timeout: float = 300) -> str:
    """Waits until every standby process of the job (trl_ext.launching.ray.standby) has done its imports: a lost
    node costs a run on its first minutes what it costs later. Returns what they were."""
    if not standby:
        return "off (TRL_EXT_RAY_STANDBY=0)"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if "standby process(es) on this node" in cluster.logs(job):
            files = list(Path(tempfile.gettempdir()).glob("trl_ext-ray-standby/*/*/spare-*"))
            texts = [f.read_text() for f in files if f.exists()]
            if files and all(len(t.split()) == 2 for t in texts):
                rss = [psutil.Process(int(f.name[6:])).memory_info().rss / 2**30 for f in files]
                return (f"{len(texts)} ready, their imports {', '.join(t.split()[0] for t in texts)} s, "
                        f"{', '.join(f'{r:.2f}' for r in rss)} GiB resident each")
        time.sleep(0.5)
    return "not ready within the wait"


def _wait_for_nodes(cluster: RayCluster, count: int, timeout: float = 120) -> None:
    """Until Ray's GCS counts ``count`` nodes alive (a node's ``ray start`` returns before it does)."""
    from ray._raylet import GcsClient

    client, end = GcsClient(address=cluster.address), time.monotonic() + timeout
    while sum(info.state == 0 for info in client.get_all_node_info().values()) < count:  # 0: ALIVE
        assert time.monotonic() < end, f"fewer than {count} nodes alive after {timeout:.0f} s"
        time.sleep(0.5)


def _steps(out: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if p.name.split("-")[1].isdigit()}


def _next_checkpoint(out: Path) -> int:
    """The step of the next checkpoint the run commits (its directory appears)."""
    done = _steps(out)
    while True:
        now = _steps(out)
        if now - done:
            return max(now - done)
        time.sleep(0.05)


def recovery(cluster: RayCluster, work: Path, steps: int, standby: bool = True) -> None:
    cpu = cluster.cpu_seconds()
    name = f"recovery-{'standby' if standby else 'none'}"
    out = work / name
    env = {**ENV, "TRL_EXT_BENCH_STEP_SECONDS": "0.5", "TRL_EXT_RAY_STANDBY": "1" if standby else "0"}
    cluster.submit([*DPO, "--max_steps", str(steps), "--save_strategy", "steps", "--save_steps", "10",
                    "--num_processes", "2-4", "--output_dir", str(out)], name, env)
    log = _Log(cluster, name)
    log.wait("Started training worker group of size 4")
    while not (out / "checkpoint-20").is_dir():
        time.sleep(0.05)
    spares = _spares_ready(cluster, name, standby)
    at = _next_checkpoint(out)
    killed = cluster.kill_node()
    noticed = log.wait("Ray lost rank")
    marked, attempt = "Ray marked node(s)", "Attempting to start training worker group of size 2"
    deadline = time.monotonic() + 900
    while attempt not in log.seen and time.monotonic() < deadline:
        log.poll(marked, attempt)
        time.sleep(0.25)
    attempting = log.wait(attempt, timeout=1)
    # trl_ext's line once Ray marked the lost node dead; none where Ray had marked it before the verdict ran
    dead = log.seen.get(marked, noticed)
    restarted = log.wait("Started training worker group of size 2")
    assert cluster.wait_job(name, timeout=1800) == "SUCCEEDED", cluster.logs(name)[-4000:]
    events = _events(cluster.logs(name))
    first = events[("first_step", 1)][0]
    parts = [
        ("failure noticed: the kill -> Ray Train's controller reports the lost workers", noticed - killed),
        ("-> the lost node marked dead (trl_ext's report, else Ray's health checks)", dead - noticed),
        ("-> Ray Train decides on 2 workers (Ray's view of the cluster refreshed)", attempting - dead),
        ("-> Ray Train started them (placement, actors, process group)", restarted - attempting),
        ("-> the ranks' recipe starts (trl_ext's worker: transformers, TRL)", events[("start", 1)][0] - restarted),
        ("-> the trainer built (the model)", events[("trainer_built", 1)][0] - events[("start", 1)][0]),
        ("train() -> the checkpoint loaded (universal checkpoint, 4 -> 2)",
         events[("resumed", 1)][0] - events[("train", 1)][0]),
        ("-> the first step done", first - events[("resumed", 1)][0]),
    ]
    print(f"\nrecovery: DPO, ZeRO-3, --num_processes 2-4, the second node killed at checkpoint-{at} of {steps} steps; "
          f"standby processes: {spares}")
    for text, seconds in parts:
        print(f"  {text:<80} {seconds:7.1f} s")
    print(f"  {'between the parts (trainer built -> train())':<80} "
          f"{events[('train', 1)][0] - events[('trainer_built', 1)][0]:7.1f} s")
    print(f"from the kill to the first step after the resume: {first - killed:.1f} s")
    print(f"the first group's median step (0.5 s of it a sleep): {_median_step(events):.2f} s; the job's CPU, both "
          f"nodes: {cluster.cpu_seconds() - cpu:.0f} s")
    used = re.findall(r"\[trl_ext\] (Ray: rank\(s\) .* started on standby processes.*)", cluster.logs(name))
    print(f"the restarted group: {used[-1] if used else 'no rank started on a standby process'}")
    print("Ray Train's own account of starting the 2 workers (its controller's debug log):")
    for line in _group_start_breakdown(cluster):
        print("  " + line.replace("\n", "\n  "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", choices=["overhead", "recovery"], default=None)
    parser.add_argument("--health-check-ms", type=int, default=None, help="the head's health_check_period_ms (3 "
                        "failures mark a node dead); Ray's defaults: 3000 ms, 5 failures")
    parser.add_argument("--standby", choices=["both", "on", "off"], default="both",
                        help="the recovery with standby processes (TRL_EXT_RAY_STANDBY), without, or both, in turn")
    args = parser.parse_args()
    checks = ({"health_check_period_ms": args.health_check_ms, "health_check_failure_threshold": 3}
              if args.health_check_ms else None)
    env = {"PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": deepspeed_op.build(), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    work = Path(tempfile.mkdtemp(prefix="trl-ext-ray-bench-"))
    started = time.monotonic()
    with RayCluster(cpus_per_node=2, env=env, cwd=str(REPO), system_config=checks) as cluster:
        print(f"the cluster started in {time.monotonic() - started:.1f} s (ray start --head, then the second node)")
        if args.skip != "overhead":
            overhead(cluster, work, args.repeats, args.steps)
        if args.skip != "recovery":
            for i, standby in enumerate({"both": (False, True), "on": (True,), "off": (False,)}[args.standby]):
                if i:  # the lost node back for the next run, which must start on both nodes
                    cluster.start_node()
                    _wait_for_nodes(cluster, 2)
                    time.sleep(25)  # Ray Train sizes a new group from a view of the nodes refreshed every 20 s
                recovery(cluster, work, max(args.steps, 40), standby)


if __name__ == "__main__":
    main()
