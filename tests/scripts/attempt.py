"""One attempt of a run, as a trainer begins it and ends: the attempt counted (``failure_limit.begin``, what the
trainer's constructor runs on the first process), the output directory claimed (as ``train()`` does), then, if asked,
a committed ``checkpoint-N`` (progress), and the exit code asked for (200: a lost peer, which the orchestrators
restart). A test that plays an orchestrator runs it again and again under that orchestrator's variables.

    python tests/scripts/attempt.py OUTPUT_DIR EXIT_CODE [CHECKPOINT_STEP]
"""

import sys
from pathlib import Path

from trl_ext.placement import failure_limit, ownership

out = sys.argv[1]
failure_limit.begin(out)  # raises GaveUp (exit 202) when the run failed too often in a row
ownership.claim(out)
if len(sys.argv) > 3:
    (Path(out) / f"checkpoint-{sys.argv[3]}").mkdir()
sys.exit(int(sys.argv[2]))
