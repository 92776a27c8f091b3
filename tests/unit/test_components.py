"""What joins a trainer joins through ``trainer.join``, in the stated order (trl_ext.trainers.components): checkpoints,
preemption, then an orchestrator's own, made only for the trainers built inside its ``joining`` block; a callback that
joins ``first`` runs before TRL's own; a ``committed`` hook runs after each commit."""

from datasets import Dataset
from transformers import TrainerCallback

import trl_ext
from trl_ext.saving.checkpoints import CheckpointCallback
from trl_ext.trainers.components import joining
from trl_ext.trainers.preemption import Preemption

ROWS = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
        for i in range(4)]


class Mark(TrainerCallback):
    pass


def _trainer(tmp_path, tiny_model_path):
    args = trl_ext.SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none")
    return trl_ext.SFTTrainer(model=tiny_model_path, args=args, train_dataset=Dataset.from_list(ROWS))


def test_components_join_in_the_stated_order_and_an_orchestrators_only_inside_its_block(tmp_path, tiny_model_path):
    first, last = Mark(), Mark()

    def committed(path, step):
        pass

    def orchestrator(trainer):
        trainer.join(last, committed=committed)
        trainer.join(first, first=True)

    with joining(orchestrator):
        trainer = _trainer(tmp_path / "inside", tiny_model_path)
    callbacks = trainer.callback_handler.callbacks
    ours = [c for c in callbacks if isinstance(c, (CheckpointCallback, Preemption, Mark))]
    assert ours == [first, trainer.checkpoints.callback, trainer.preemption, last]
    assert callbacks[0] is first  # before TRL's own
    assert trainer.mirror is None and trainer.storage is None  # no mirror asked for; storage known once train() starts
    assert trainer.checkpoints.after_commit == [committed]

    outside = _trainer(tmp_path / "outside", tiny_model_path)  # the block has ended: nothing of it joins
    assert not any(isinstance(c, Mark) for c in outside.callback_handler.callbacks)
    assert outside.writes_files()  # one process: it writes
