"""Time to the first training step, by part: the README's main command (the recipe re-launches itself) against the same
job under ``accelerate launch``, a resumed run, and trl_ext's import against TRL's.

    python bench/startup.py [--repeats 3]

On this machine, alternated, medians:

- the recipe form: ``python recipes/dpo.py --config accelerate_configs/zero3.yaml --max_steps 1 --eval_strategy no``
  (2 CPU processes);
- the anchor: ``accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/dpo.py
  --config recipes/configs/dpo.yaml`` with the same options (accelerate's command, as users type it);
- the same through ``python -m accelerate.commands.launch``, which skips the ``accelerate`` command's other
  subcommands' imports (about 0.6 s here): the leanest start accelerate offers;
- a resumed run: the recipe form with ``--resume_from_checkpoint true`` on a run that saved checkpoint-1 (the
  checkpoint chosen and loaded);
- imports: ``from trl_ext import DPOTrainer, SFTTrainer`` against ``from trl import DPOTrainer, SFTTrainer``.

The parts, from the first rank (bench/_startup_worker.py): launcher (the command's start -> the rank's Python up),
imports (-> the trainer's construction starts), model load (-> TRL prepares the dataset), data preparation (-> the
trainer built), then ``train()`` -> the first step starts (checkpoint choice and load, the engine built) and the first
step. Prints each form's median total and parts, and the ratios to the anchor. Run it on an idle machine.
"""

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness import run_command  # noqa: E402

OPTIONS = ["--max_steps", "1", "--eval_strategy", "no", "--report_to", "none", "--save_strategy", "steps",
           "--save_steps", "1"]
TIMING = re.compile(r"\[timing\] (\w+) ([\d.]+)")
PARTS = [("launcher", "t0", "start"), ("imports", "start", "trainer"), ("model load", "trainer", "data"),
         ("data preparation", "data", "trainer_built"), ("train() -> first step starts", "train", "step"),
         ("first step", "step", "first_step")]
ENV = {"TRL_EXT_BENCH_RECIPE": "recipes/dpo.py"}


def _anchor_args(out: Path) -> list[str]:  # after `accelerate launch`
    return ["--config_file", "accelerate_configs/zero3.yaml", "--num_processes", "2", "--main_process_port", "0",
            "bench/_startup_worker.py", "--config", "recipes/configs/dpo.yaml", *OPTIONS, "--output_dir", str(out)]


def _events(output: str, started: float) -> dict[str, float]:
    events = {"t0": started}
    for name, when in TIMING.findall(output):
        events.setdefault(name, float(when))
    return events


def _run(cmd: list[str]) -> dict[str, float]:
    started = time.time()
    result = run_command(cmd, timeout=900, env=ENV)
    if result.returncode != 0 or "first_step" not in result.output:
        raise SystemExit(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.output[-4000:]}")
    events = _events(result.output, started)
    times = {name: events[end] - events[begin] for name, begin, end in PARTS}
    times["total"] = events["first_step"] - started
    return times


def _import_seconds(code: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trl-ext-startup-"))
    forms = {
        "recipe form": lambda out: [sys.executable, "bench/_startup_worker.py", "--config",
                                    "accelerate_configs/zero3.yaml", "--config", "recipes/configs/dpo.yaml", *OPTIONS,
                                    "--output_dir", str(out)],
        "accelerate launch": lambda out: [str(Path(sys.executable).parent / "accelerate"), "launch",
                                          *_anchor_args(out)],
        "python -m accelerate...launch": lambda out: [sys.executable, "-m", "accelerate.commands.launch",
                                                      *_anchor_args(out)],
    }
    results = {name: [] for name in [*forms, "resumed (recipe form)"]}
    imports = {"trl": [], "trl_ext": []}
    _run(forms["recipe form"](work / "warm"))  # builds the embedded model and DeepSpeed's op once
    for repeat in range(args.repeats):
        for name, command in forms.items():
            out = work / f"{name.replace(' ', '-')}-{repeat}"
            results[name].append(_run(command(out)))
        resumed = work / f"resumed-{repeat}"
        shutil.copytree(work / f"recipe-form-{repeat}", resumed)
        results["resumed (recipe form)"].append(_run([*forms["recipe form"](resumed), "--max_steps", "2",
                                                      "--resume_from_checkpoint", "true"]))
        for module in ("trl", "trl_ext"):
            imports[module].append(_import_seconds(f"from {module} import DPOTrainer, SFTTrainer"))
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    anchor = medians["accelerate launch"]
    print(f"time to the first step, medians of {args.repeats} (seconds; ratio to accelerate launch):")
    print(f"{'':<30}" + "".join(f"{name:>30}" for name in medians))
    for part in [*(name for name, _, _ in PARTS), "total"]:
        cells = "".join(f"{m[part]:>21.2f} ({m[part] / max(anchor[part], 1e-9):4.2f}x)" for m in medians.values())
        print(f"{part:<30}{cells}")
    trl, ours = statistics.median(imports["trl"]), statistics.median(imports["trl_ext"])
    print(f"imports (wall, median of {args.repeats}): from trl import DPOTrainer, SFTTrainer {trl:.2f} s; from "
          f"trl_ext ... {ours:.2f} s ({ours - trl:+.2f} s, {ours / trl:.2f}x)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
