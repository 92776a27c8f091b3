"""A recipe run slowed down in its first run (``SLURM_RESTART_COUNT`` unset or 0), so that a requeue or the
time-limit warning surely lands where a test wants it, whatever this machine's speed.

``TRL_EXT_TEST_RECIPE`` names the recipe to run. ``TRL_EXT_TEST_STEP_SECONDS``: every training step sleeps that
long first, so training outlasts the moment the signal comes. ``TRL_EXT_TEST_SLOW_CHECKPOINT=N``: the writer of
``checkpoint-N`` sleeps before finishing its file, so that the requeue's SIGTERM, and then its SIGKILL, find that
checkpoint being written. The recipe re-launches this file in every rank (it stays ``sys.argv[0]``), so the ranks
run it too.
"""

import os
import time

import transformers

from trl_ext.files import shards

if os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):
    if "TRL_EXT_TEST_SLOW_CHECKPOINT" in os.environ:
        slow, finish = f"checkpoint-{os.environ['TRL_EXT_TEST_SLOW_CHECKPOINT']}", shards.ShardStreamWriter.finish

        def slow_finish(self):
            if slow in str(self.directory):
                time.sleep(600)
            finish(self)

        shards.ShardStreamWriter.finish = slow_finish
    if "TRL_EXT_TEST_STEP_SECONDS" in os.environ:
        seconds, training_step = float(os.environ["TRL_EXT_TEST_STEP_SECONDS"]), transformers.Trainer.training_step

        def slow_step(self, *args, **kwargs):
            time.sleep(seconds)
            return training_step(self, *args, **kwargs)

        transformers.Trainer.training_step = slow_step

recipe = os.environ["TRL_EXT_TEST_RECIPE"]  # run as __main__, sys.argv[0] left as this file (runpy would change it)
exec(compile(open(recipe).read(), recipe, "exec"), {"__name__": "__main__", "__file__": recipe})
