"""What ``from trl_ext import DPOTrainer`` imports beyond what ``from trl import DPOTrainer`` does: only trl_ext's own
modules that every training run uses, and nothing a DPO or SFT run does not use (vLLM and the weight sync, the other
trainers, s3fs without a mirror, DeepSpeed without a DeepSpeed config, the Slurm launcher, merging, launching). A
deterministic count, in a fresh process; the time it takes is bench/startup.py's."""

import json
import subprocess
import sys

from tests.harness import REPO

PROBE = """
import json, sys
from trl import {names}
before = set(sys.modules)
from trl_ext import {names}
print(json.dumps(sorted(set(sys.modules) - before)))
"""
# Rooms a training run does not use: imported when first used, never by the trainers' import.
NOT_IMPORTED = ("trl_ext.merge", "trl_ext.launching", "trl_ext.cli", "trl_ext.trainers.online",
                "trl_ext.trainers.weight_sync", "trl_ext.trainers.vllm_server",
                "trl_ext.launching.node", "trl_ext.launching.restart", "trl_ext.launching.rendezvous", "trl_ext.ray",
                "trl_ext.assets")


def _printed(code: str) -> list[str]:
    """The JSON list ``code`` prints last, run in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _added(names: str) -> list[str]:
    return _printed(PROBE.format(names=names))


def test_trl_ext_imports_only_its_own_modules_beyond_trls():
    added = _added("DPOTrainer")
    assert [m for m in added if m.split(".")[0] != "trl_ext"] == []  # no other library: not TRL's other trainers,
    # not requests (TRL's vLLM client), not s3fs, not deepspeed
    assert not [m for m in added if m.startswith(NOT_IMPORTED)], added
    assert "trl_ext.trainers.sft" not in added  # only the trainer asked for
    assert len(added) <= 90, len(added)  # trl_ext's own: a few dozen small modules (81 with a module per orchestrator)


_LIBRARIES = ("import json, sys; from trl_ext.mirror import {names}; "
              "print(json.dumps([m for m in ('torch', 'transformers', 'peft', 'trl') if m in sys.modules]))")


def _libraries(names: str) -> list[str]:
    return _printed(_LIBRARIES.format(names=names))


def test_the_mirror_without_its_trainer_object_imports_no_ml_library():
    """A process's exit with uploads queued and ``trl-ext verify URL`` use the mirror without training: the store, the
    lease and the uploader import none of torch, transformers, PEFT and TRL; verify only torch (the safetensors
    header's dtypes). trl_ext.mirror's trainer object, which imports transformers, is imported when first asked for."""
    assert _libraries("lease, outbox, store, uploader") == []
    assert _libraries("verify") == ["torch"]
