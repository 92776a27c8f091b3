"""A recipe run with what a test needs to happen at a known point, in the runs it names, whatever this machine's speed:
slowed steps, a checkpoint write that stalls, a load or a save held until the test releases it, a bug.

``TRL_EXT_TEST_RECIPE`` names the recipe to run. ``TRL_EXT_TEST_RUNS``: the runs (``SLURM_RESTART_COUNT`` values, or
elsewhere the restart number the orchestrator gives, as ``placement.orchestrators`` reads it: torchrun's
``TORCHELASTIC_RESTART_COUNT``, a Ray worker group's;
comma-separated; default ``0``, the first) that the rest applies to:

- ``TRL_EXT_TEST_STEP_SECONDS``: every training step sleeps that long first, so training outlasts the moment a
  signal comes.
- ``TRL_EXT_TEST_SLOW_CHECKPOINT=N``: the writer of ``checkpoint-N`` sleeps before finishing its file, so that a
  requeue's SIGTERM, and then its SIGKILL, find that checkpoint being written.
- ``TRL_EXT_TEST_HOLD=what,...`` with ``TRL_EXT_TEST_HOLD_DIR``: ``load`` (DeepSpeed's checkpoint load when resuming),
  ``checkpoint-N`` (that checkpoint's weights file), ``final`` (the final model's) and ``step-N`` (training step N,
  before it runs) wait, after printing ``[test] holding <what>``, until the file ``release-<what>`` appears in the
  hold directory.
- ``TRL_EXT_TEST_RAISE_AT_STEP=N``: rank 0 raises ``ValueError`` in step N, a bug.

In every run, ``TRL_EXT_TEST_MEMORY_DIR`` (a path with ``{node}``, Slurm's ``SLURMD_NODENAME``) gives each node its own
memory tier (``TRL_EXT_MEMORY_DIR``), as each machine's /dev/shm is its own: the test's Slurm nodes share one host.

The recipe re-launches this file in every rank (it stays ``sys.argv[0]``), so the ranks run it too.
"""

import os
import time
from pathlib import Path

import transformers

from trl_ext.files import shards

RUNS = os.environ.get("TRL_EXT_TEST_RUNS", "0").split(",")
if "TRL_EXT_TEST_MEMORY_DIR" in os.environ:  # before the recipe re-launches its ranks, which inherit it
    os.environ["TRL_EXT_MEMORY_DIR"] = os.environ["TRL_EXT_TEST_MEMORY_DIR"].format(
        node=os.environ.get("SLURMD_NODENAME", "local"))
HOLD_SECONDS = 600  # a hold the test never releases ends the job by its own timeout, not this one's


def _hold(what: str) -> None:
    if what not in os.environ.get("TRL_EXT_TEST_HOLD", "").split(","):
        return
    release = Path(os.environ["TRL_EXT_TEST_HOLD_DIR"]) / f"release-{what}"
    if os.environ.get("RANK", "0") == "0":
        print(f"[test] holding {what}", flush=True)
    end = time.monotonic() + HOLD_SECONDS
    while not release.exists() and time.monotonic() < end:
        time.sleep(0.1)


def _restart() -> str:
    if os.environ.get("SLURM_RESTART_COUNT"):
        return os.environ["SLURM_RESTART_COUNT"]
    from trl_ext.placement import orchestrators

    job = orchestrators.current()
    return str(job.restart if job is not None else 0)


if _restart() in RUNS:
    finish = shards.ShardStreamWriter.finish
    slow = os.environ.get("TRL_EXT_TEST_SLOW_CHECKPOINT")

    def held_finish(self):
        directory = str(self.directory)
        if slow and f"checkpoint-{slow}" in directory:
            time.sleep(600)
        name = next((part for part in Path(directory).parts if "checkpoint-" in part), None)
        _hold(name.strip(".").split(".")[0] if name else "final")
        finish(self)

    shards.ShardStreamWriter.finish = held_finish

    steps_held = "step-" in os.environ.get("TRL_EXT_TEST_HOLD", "")
    if "TRL_EXT_TEST_STEP_SECONDS" in os.environ or "TRL_EXT_TEST_RAISE_AT_STEP" in os.environ or steps_held:
        seconds = float(os.environ.get("TRL_EXT_TEST_STEP_SECONDS", 0))
        training_step = transformers.Trainer.training_step
        bug_at = int(os.environ.get("TRL_EXT_TEST_RAISE_AT_STEP", 0))

        def slow_step(self, *args, **kwargs):
            if bug_at and self.state.global_step + 1 == bug_at and self.args.process_index == 0:
                raise ValueError(f"a bug at step {bug_at}")
            if steps_held:
                _hold(f"step-{self.state.global_step + 1}")
            time.sleep(seconds)
            return training_step(self, *args, **kwargs)

        transformers.Trainer.training_step = slow_step

    import transformers.trainer as trainer_module

    load = trainer_module.deepspeed_load_checkpoint

    def held_load(*args, **kwargs):
        _hold("load")
        return load(*args, **kwargs)

    trainer_module.deepspeed_load_checkpoint = held_load

recipe = os.environ["TRL_EXT_TEST_RECIPE"]  # run as __main__, sys.argv[0] left as this file (runpy would change it)
exec(compile(open(recipe).read(), recipe, "exec"), {"__name__": "__main__", "__file__": recipe})
