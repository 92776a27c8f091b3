"""trl_ext.GRPOTrainer with LoRA and transformers generation, on 2 processes under ZeRO-3 and under FSDP2 (parameters
partitioned or DTensor shards) and on one process: it trains, the saved adapter reloads with plain transformers + peft
to the trained policy's outputs, the weights the vLLM sync sends are ``merge_and_unload().save_pretrained()``'s, and a
run SIGKILLed after checkpoint-2 resumes to the uninterrupted run's weights and logs. Driven through
``tests/scripts/grpo_train.py``; the uninterrupted run and the killed one share a launch.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import SCRIPTS, accelerate_launch, run_command, write_accelerate_config
from trl_ext.assets import default_model_path

pytestmark = pytest.mark.slow

TRAIN = ["--max_steps", "4", "--save_steps", "2"]
BACKENDS = ["zero3", "fsdp2", "single"]


def grpo(tmp: Path, backend: str, runs: dict[str, list[str]]) -> object:
    """The runs (output directory name -> arguments), one after another in one launch (``run_many.py``)."""
    argvs = json.dumps([["--output_dir", str(tmp / out), *TRAIN, *args] for out, args in runs.items()])
    if backend == "single":
        result = run_command([sys.executable, str(SCRIPTS / "run_many.py"), "grpo_train.py", argvs], timeout=420)
    else:
        config = write_accelerate_config(tmp / "configs", backend)
        result = accelerate_launch(SCRIPTS / "run_many.py", ["grpo_train.py", argvs], config, 420)
    assert not result.timed_out, result.output[-4000:]
    return result


def logged(out: Path) -> list[dict]:
    history = json.loads((out / "report_rank0.json").read_text())["log_history"]
    return [{k: h[k] for k in ("step", "loss", "reward", "grad_norm") if k in h} for h in history if "loss" in h]


@pytest.fixture(scope="module", params=BACKENDS)
def reference(request, tmp_path_factory):
    """The uninterrupted run, and after it in the same launch a run SIGKILLed at step 3 (after checkpoint-2)."""
    tmp = tmp_path_factory.mktemp(f"grpo-{request.param}")
    result = grpo(tmp, request.param, {"reference": ["--save_model", "final"], "run": ["--kill_at_step", "3"]})
    assert result.returncode != 0 and (tmp / "reference" / "report_rank0.json").is_file(), result.output[-6000:]
    return request.param, tmp, tmp / "reference"


def test_trains_saves_and_reloads_to_the_trained_policy(reference):
    backend, _, out = reference
    report = json.loads((out / "report_rank0.json").read_text())
    if backend == "zero3":
        assert report["world_size"] == 2 and report["zero_stage"] == 3
        assert report["partition"]["num_partitioned"] == report["partition"]["num_params"]
    elif backend == "fsdp2":
        assert report["world_size"] == 2 and report["partition"]["num_dtensors"] == report["partition"]["num_params"]
    steps = logged(out)
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all(s["grad_norm"] > 0 for s in steps)

    result = run_command([sys.executable, str(SCRIPTS / "grpo_reload.py"), default_model_path(), str(out), "final"])
    assert result.returncode == 0, result.output[-4000:]
    reloaded = json.loads(result.output.strip().splitlines()[-1])
    trained = torch.tensor(json.loads((out / "probes_final.json").read_text()))
    torch.testing.assert_close(torch.tensor(reloaded["probes"]), trained, atol=1e-5, rtol=1e-5)
    untrained = torch.tensor(reloaded["base_probes"])
    assert (untrained - trained).abs().max() > 1e-3, "training must have changed the policy"
    # the vLLM sync under this backend: every name and value of the merged model, as save_pretrained writes it
    assert reloaded["sync_names_equal"], (reloaded["sync_only"], reloaded["save_only"])
    assert reloaded["sync_max_diff"] < 1e-5


def test_resume_after_sigkill_equals_the_uninterrupted_run(reference):
    backend, tmp, ref = reference
    out = tmp / "run"  # killed at step 3 (the fixture's launch)
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    resumed = grpo(tmp, backend, {"run": ["--resume"]})
    assert resumed.returncode == 0, resumed.output[-6000:]
    assert json.loads((out / "report_rank0.json").read_text())["steps_run_here"] == 2
    expected, got = load_file(ref / "trained.safetensors"), load_file(out / "trained.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)
    for got_step, expected_step in zip(logged(out)[-2:], logged(ref)[-2:], strict=True):  # same samples, same rewards
        assert got_step == pytest.approx(expected_step, rel=1e-5, abs=1e-6)
