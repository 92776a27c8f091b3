"""Several runs of one test script, one after another, in one launch: start-up costs more than a run on the tiny
models.

Usage (under ``accelerate launch``, see ``tests/harness.py``, or in one process): ``run_many.py SCRIPT ARGS_JSON``,
where SCRIPT is ``train.py``, ``save_roundtrip.py``, ``vlm_train.py`` or ``grpo_train.py`` and ARGS_JSON a JSON list
of its argument lists. For plain runs only, but for the last: the scripts' fault options (kills, failing writes, the
gather-whole switch) patch the process for good.
"""

import importlib
import json
import sys
from pathlib import Path

import launched  # tests/scripts/, beside this file
from accelerate.state import AcceleratorState, GradientState

# Options that patch the process for good (--hold_save does too, but does nothing once its step has passed).
PATCHING = ("--kill_at_step", "--kill_at", "--kill_during_save", "--kill_during_states_save", "--fail_save",
            "--gather_whole", "--signal_during_save", "--kill_during_upload")

if __name__ == "__main__":
    script = importlib.import_module(Path(sys.argv[1]).stem)  # beside this file, on sys.path
    argvs = json.loads(sys.argv[2])
    launched.freeze_imports()  # see launched.py
    for i, argv in enumerate(argvs):
        last = i == len(argvs) - 1  # a fault that ends the launch (a kill) may come last
        assert last or not set(PATCHING) & set(argv), f"an option that patches the process, not last: {argv}"
        script.main(argv)
        for cls in (AcceleratorState, GradientState):  # the next trainer builds its own accelerator
            cls._shared_state.clear()
    launched.finish()  # see launched.py
