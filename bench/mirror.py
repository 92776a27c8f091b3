"""The checkpoint mirror against a real S3 server on this machine (``rclone serve s3``, from ``.[test]``).

    python bench/mirror.py [--repeats 3] [--mib 256] [--hidden 256 --layers 2 --steps 12 --save_steps 6]

1. Transfers: a checkpoint-shaped folder of ``--mib`` MiB (one safetensors file of 40%, an optimizer file of 50%, and
   small files) uploaded by the mirror's uploader (hard links, 4 files in parallel, checksums, manifest, lease check)
   and downloaded by its downloader (checked against the manifest, fsynced, committed), against s3fs's own ``put``
   and ``get`` of the same files on the same server (the anchor), alternating, in one run: MiB/s and ratios.
2. Step time: a one-process full fine-tune of a random Llama saving every ``--save_steps`` steps, mirror off and on:
   the median and mean step and the run's time; and the CPU time the server (rclone) used meanwhile, since here the
   server, the uploads and training share the same cores.
3. A fresh machine: a new process and an empty output directory resuming from the mirror's newest checkpoint, from
   its start to its first resumed step (the download included), against the same resume from a local copy.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.harness, tests.s3_server

import psutil  # noqa: E402

from tests.harness import REPO, print_ratio_table  # noqa: E402
from tests.s3_server import S3Server  # noqa: E402

WORKER = Path(__file__).with_name("_mirror_worker.py")


def make_checkpoint(directory: Path, mib: int) -> int:
    """A folder shaped like a checkpoint-N; returns its bytes."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    weights = int(mib * 0.4 * 2**20) // 4
    save_file({f"layer{i}.weight": torch.randn(weights // 8) for i in range(8)}, directory / "model.safetensors")
    (directory / "optimizer.pt").write_bytes(os.urandom(int(mib * 0.5 * 2**20)))
    for name, size in (("rng_state.pth", 16 << 10), ("scheduler.pt", 1 << 10), ("trainer_state.json", 4 << 10),
                       ("training_args.bin", 8 << 10), ("tokenizer.json", 2 << 20), ("config.json", 1 << 10)):
        (directory / name).write_bytes(os.urandom(size))
    return sum(p.stat().st_size for p in directory.iterdir())


def cpu_seconds(pid: int) -> float:
    try:
        process = psutil.Process(pid)
        return sum(process.cpu_times()[:2]) + sum(sum(c.cpu_times()[:2]) for c in process.children(recursive=True))
    except psutil.NoSuchProcess:
        return 0.0


def transfers(server: S3Server, repeats: int, mib: int, work: Path) -> None:
    import fsspec

    from trl_ext.mirror import downloader, lease, outbox, uploader
    from trl_ext.mirror.store import Store

    bucket = server.bucket()
    source = work / "source" / "checkpoint-1"
    size = make_checkpoint(source, mib)
    files = sorted(p.name for p in source.iterdir())
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    store = Store(f"s3://{bucket}/ours")
    holder = lease.Holder(output_dir=str(work))
    lease.claim(store, holder, resuming=False, say=lambda line: None)
    results = {"s3fs put/get": [], "trl_ext mirror": []}
    for i in range(repeats):
        for variant in (list(results) if i % 2 == 0 else list(results)[::-1]):
            down = work / f"down-{variant[:3]}-{i}"
            if variant == "s3fs put/get":
                remote = f"{bucket}/anchor-{i}"
                start = time.perf_counter()
                fs.put([str(source / f) for f in files], [f"{remote}/{f}" for f in files])
                up = time.perf_counter() - start
                down.mkdir(parents=True)
                start = time.perf_counter()
                fs.get([f"{remote}/{f}" for f in files], [str(down / f) for f in files])
                get = time.perf_counter() - start
            else:
                run = work / f"run-{i}"
                shutil.copytree(source, run / "checkpoint-1")
                up_ = uploader.Uploader(store, holder, run / outbox.DIR, None, set, lambda line: None)
                start = time.perf_counter()
                up_.submit(outbox.put(run / "checkpoint-1", up_.outbox_root / "checkpoint-1", "checkpoint-1", 1))
                assert up_.wait(None) and not up_.failed, up_.failed
                up = time.perf_counter() - start
                start = time.perf_counter()
                downloader.download(store, 1, down)
                get = time.perf_counter() - start
                store.delete("checkpoint-1")
                shutil.rmtree(run)
            shutil.rmtree(down)
            results[variant].append({"up": size / 2**20 / up, "down": size / 2**20 / get})
    print(f"\ntransfers of a {size / 2**20:.0f} MiB checkpoint ({len(files)} files), {repeats} repeats, MiB/s "
          "(higher is better):")
    print_ratio_table(results, {"up": "upload (MiB/s)", "down": "download (MiB/s)"}, "s3fs put/get")


def worker(model: str, out: Path, env: dict, *extra: str) -> dict:
    started = time.time()
    proc = subprocess.run([sys.executable, str(WORKER), "--model", model, "--output_dir", str(out),
                           "--started", str(started), *extra], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        raise RuntimeError(f"the worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(line[len("BENCH "):])


def training(server: S3Server, repeats: int, cli, work: Path) -> None:
    from save import build_model  # bench/, beside this file

    model = work / "model"
    build_model(model, cli.layers, False, cli.hidden)
    steps = ["--steps", str(cli.steps), "--save_steps", str(cli.save_steps)]
    results, server_cpu, mirrors = {"mirror off": [], "mirror on": []}, [], []
    for i in range(repeats):
        for variant in (list(results) if i % 2 == 0 else list(results)[::-1]):
            extra = []
            if variant == "mirror on":
                mirrors.append(f"s3://{server.bucket()}/run")
                extra = ["--mirror", mirrors[-1]]
            before = cpu_seconds(server.proc.pid)
            got = worker(str(model), work / f"{variant.split()[-1]}-{i}", server.env, *steps, *extra)
            if variant == "mirror on":
                server_cpu.append(cpu_seconds(server.proc.pid) - before)
            results[variant].append({"median": statistics.median(got["steps"]), "mean": statistics.mean(got["steps"]),
                                     "train": got["train_s"], "wait": got["upload_wait_s"]})
    print(f"\nstep time, one process, {cli.steps} steps, a checkpoint every {cli.save_steps} "
          f"({model_bytes(model) / 2**20:.0f} MiB of weights), seconds:")
    print_ratio_table(results, {"median": "median step (s)", "mean": "mean step (s)", "train": "training (s)"},
                      "mirror off")
    print(f"uploads still running when training ended, waited for: "
          f"{statistics.median(r['wait'] for r in results['mirror on']):.2f} s (median)")
    extra_s = (statistics.median(r["train"] for r in results["mirror on"]) -
               statistics.median(r["train"] for r in results["mirror off"]))
    print(f"the server's own CPU time during a mirrored run: {statistics.median(server_cpu):.2f} s (median), against "
          f"{extra_s:.2f} s more training time with the mirror on")
    # a fresh machine: a new process and an empty output directory resume from the mirror's newest checkpoint
    fresh, local = [], []
    resume = ["--steps", str(cli.steps + 2), "--save_steps", str(cli.steps + 2), "--resume"]
    for i in range(repeats):
        got = worker(str(model), work / f"fresh-{i}", server.env, *resume, "--mirror", mirrors[0])
        fresh.append({"first": got["start_to_first_step_s"], "download": got["download_s"]})
        copy = work / f"local-{i}"
        shutil.copytree(work / "on-0", copy, ignore=shutil.ignore_patterns(".trl_ext-mirror"))
        got = worker(str(model), copy, server.env, *resume)
        local.append({"first": got["start_to_first_step_s"], "download": 0.0})
    print("\na fresh machine: process start to its first resumed step, seconds:")
    print_ratio_table({"resume from a local copy": local, "resume from the mirror": fresh},
                      {"first": "start to first step (s)"}, "resume from a local copy")
    print(f"of which the download from the mirror: {statistics.median(r['download'] for r in fresh):.2f} s (median)")


def model_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save_steps", type=int, default=6)
    parser.add_argument("--skip", nargs="*", default=[], choices=["transfers", "training"])
    cli = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="trl_ext-bench-mirror-") as tmp, S3Server(Path(tmp) / "s3") as server:
        os.environ.update(server.env)
        if "transfers" not in cli.skip:
            transfers(server, cli.repeats, cli.mib, Path(tmp) / "transfers")
        if "training" not in cli.skip:
            training(server, cli.repeats, cli, Path(tmp) / "training")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
