"""A recipe run in which one checkpoint is slow to write, for the test of a requeue that lands mid-save.

``TRL_EXT_TEST_RECIPE`` names the recipe to run; in the job's first run (``SLURM_RESTART_COUNT`` unset or 0) the
writer of ``checkpoint-<TRL_EXT_TEST_SLOW_CHECKPOINT>`` sleeps before finishing its file, so that the requeue's
SIGTERM, and then its SIGKILL, find that checkpoint being written. The recipe re-launches this file in every rank
(it is ``sys.argv[0]``), so the ranks run it too.
"""

import os
import runpy
import time

from trl_ext.files import shards

if os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):
    slow, finish = f"checkpoint-{os.environ['TRL_EXT_TEST_SLOW_CHECKPOINT']}", shards.ShardStreamWriter.finish

    def slow_finish(self):
        if slow in str(self.directory):
            time.sleep(600)
        finish(self)

    shards.ShardStreamWriter.finish = slow_finish

runpy.run_path(os.environ["TRL_EXT_TEST_RECIPE"], run_name="__main__")
