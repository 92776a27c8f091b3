"""`trl-ext verify` on checkpoints from a real 2-process ZeRO-3 run (empty ZeRO-3 placeholders reproduced, not
hand-made)."""

import pytest

from tests.harness import SCRIPTS, accelerate_launch, write_accelerate_config
from tests.upstream import still_needed
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit

pytestmark = pytest.mark.slow


def test_user_save_paths_after_zero3_are_refused_or_caught(tmp_path):
    config = write_accelerate_config(tmp_path, "zero3")
    result = accelerate_launch(SCRIPTS / "save_paths.py", [str(tmp_path / "out")], config, timeout=300)
    assert result.returncode == 0, result.output[-4000:]

    good = audit(str(tmp_path / "out" / "save_model"), base=default_model_path())
    assert good.ok, good.format()

    # A plain model.save_pretrained() under ZeRO-3 is refused with the fix, instead of writing empty tensors.
    assert not (tmp_path / "out" / "user_save_pretrained").exists()
    assert "trainer.save_model" in (tmp_path / "out" / "user_save_pretrained.error").read_text()
    # What it writes without the guard (patch 'save-pretrained-guard' works around it): empty placeholders.
    upstream = audit(str(tmp_path / "out" / "upstream_save_pretrained"))
    still_needed("save-pretrained-guard", not upstream.ok and "empty tensors" in " ".join(upstream.problems),
                 f"PEFT's save_pretrained of a ZeRO-3 model: {upstream.format()}")

    # Saving the rank's own state_dict writes the [0] placeholders; verify names them.
    broken = audit(str(tmp_path / "out" / "raw_state_dict"))
    assert not broken.ok
    assert "8 empty tensors" in broken.problems[0]
    assert "q_proj.lora_A.weight" in broken.problems[0]
