"""The trl_ext modules one background checkpoint's path runs code in, from ``Trainer._save_checkpoint`` to the
committed directory (the training thread inside the save and at its waits, and the threads it starts), in one process
on the embedded model: a count, the same at every run.

    python bench/checkpoint_path.py
"""

import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.probes

from datasets import Dataset

import trl_ext
from tests.probes.modules_crossed import ModulesCrossed
from trl_ext.assets import default_model_path

ROWS = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
        for i in range(16)]


def main():
    with tempfile.TemporaryDirectory() as out:
        args = trl_ext.SFTConfig(output_dir=out, seed=0, per_device_train_batch_size=2, report_to="none", max_steps=3,
                                 save_steps=2, save_in_background=True)
        trainer = trl_ext.SFTTrainer(model=default_model_path(), args=args, train_dataset=Dataset.from_list(ROWS))
        probe = ModulesCrossed()
        save_checkpoint, checkpoints = trainer._save_checkpoint, trainer.checkpoints

        def only_checkpoint_2(*a, **k):  # checkpoint-3, the run's last, is written in the foreground
            probe.active = trainer.state.global_step == 2
            try:
                return save_checkpoint(*a, **k)
            finally:
                probe.active = False

        trainer._save_checkpoint = only_checkpoint_2
        for name in ("wait_for_copies", "poll"):  # its waits on the training thread, after _save_checkpoint
            probe.around(checkpoints, name)
        with probe:
            trainer.train()
    functions = defaultdict(set)
    for module, function in probe.calls:
        functions[module].add(function)
    for module in sorted(functions):
        print(f"{module}: {', '.join(sorted(functions[module]))}")
    print(f"{len(probe.modules)} modules")


if __name__ == "__main__":
    main()
