"""What ``trl-ext <command>`` launches on every process: TRL's own ``trl/scripts/<command>.py``, run as its
``__main__``, with ``trl.<Name>Trainer`` and ``trl.<Name>Config`` resolving to trl_ext's classes.

    accelerate launch trl_ext/launching/trl_script.py sft --model_name_or_path ... --dataset_name ...
"""

import runpy
import sys

from trl_ext.launching.trl_cli import trl_ext_classes

if __name__ == "__main__":
    command = sys.argv.pop(1)
    with trl_ext_classes(command):
        runpy.run_module(f"trl.scripts.{command}", run_name="__main__", alter_sys=True)
