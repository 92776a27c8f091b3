"""`trl-ext verify` on checkpoints from a real 2-process ZeRO-3 run (report F1 reproduced, not hand-made)."""

import pytest

from tests.harness import SCRIPTS, launch, write_accelerate_config
from trl_ext.assets import default_model_path
from trl_ext.verify import audit

pytestmark = pytest.mark.slow


def test_user_save_pretrained_after_zero3_is_caught(tmp_path):
    config = write_accelerate_config(tmp_path, "zero3")
    result = launch(SCRIPTS / "save_paths.py", [str(tmp_path / "out")], config, timeout=300)
    assert result.returncode == 0, result.output[-4000:]

    # transformers >= 5 gathers trainable params in Trainer.save_model: that adapter is sound.
    good = audit(str(tmp_path / "out" / "save_model"), base=default_model_path())
    assert good.ok, good.format()

    # A plain model.save_pretrained() under ZeRO-3 writes the [0] placeholders; verify names them.
    broken = audit(str(tmp_path / "out" / "user_save_pretrained"))
    assert not broken.ok
    assert "8 empty tensors" in broken.problems[0]
    assert "q_proj.lora_A.weight" in broken.problems[0]
