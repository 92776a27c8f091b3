"""Several ``train.py`` runs, one after another, in one launch: start-up costs more than a run on the tiny model.

Usage (under ``accelerate launch``, see ``tests/harness.py``): ``train_many.py ARGS_JSON``, a JSON list of
``train.py`` argument lists. For plain runs only: ``train.py``'s fault options patch the process for good.
"""

import json
import sys

import train  # tests/scripts/train.py, beside this script
from accelerate.state import AcceleratorState, GradientState

FAULTS = ("--kill_at_step", "--kill_during_save", "--fail_save")

if __name__ == "__main__":
    for argv in json.loads(sys.argv[1]):
        assert not set(FAULTS) & set(argv), f"a fault option ends the process: launch train.py alone for {argv}"
        train.main(argv)
        for cls in (AcceleratorState, GradientState):  # the next trainer builds its own accelerator
            cls._shared_state.clear()
