"""``trl-ext <command>`` is ``trl <command>`` with trl_ext's trainers: the same command line gives the same losses, and
under ZeRO-3 (where ``trl`` itself cannot start on CPU: its configs ask for bf16 and NCCL) it trains the same
trajectory and saves an adapter that plain peft reloads, with save_pretrained's metadata.

The command lines are the ones a user types: the console scripts, a local dataset directory, ``--use_peft``,
``--accelerate_config <file>``. One fixture runs the six launches once.
"""

import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests import reloading
from tests.harness import run_command, write_accelerate_config
from trl_ext.assets import default_model_path
from trl_ext.assets.datasets import DATA_DIR
from trl_ext.files.audit import audit

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
# TRL's own configs need these two on CPU (trl_ext sets them itself); both commands get the same line
COMMON = ["--max_steps", "3", "--logging_steps", "1", "--save_steps", "3", "--report_to", "none", "--seed", "1",
          "--learning_rate", "1e-3", "--bf16", "false", "--main_process_port", "0"]
LORA = ["--use_peft", "--lora_target_modules", "all-linear"]


def _data(directory: Path, source: str, rows: int = 64) -> str:
    directory.mkdir(parents=True)
    lines = (DATA_DIR / source).read_text().splitlines()[:rows]
    (directory / "train.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory)


def _history(out: Path) -> list[dict]:
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_cli")
    model = default_model_path()
    sft = ["sft", "--model_name_or_path", model, "--dataset_name", _data(tmp / "sft", "sft_train.jsonl")]
    kto = ["kto", "--model_name_or_path", model, "--dataset_name", _data(tmp / "kto", "preference_train.jsonl"),
           *LORA]
    reward = ["reward", "--model_name_or_path", model, "--dataset_name", _data(tmp / "pairs", "preference_train.jsonl"),
              *LORA]  # LoRA on every linear layer, no task_type: the head must still be trained and saved whole
    zero3 = write_accelerate_config(tmp / "configs", "zero3")
    commands = {  # name: (command, its arguments); one process unless an accelerate config says otherwise
        "trl-sft": ("trl", [*sft, "--per_device_train_batch_size", "8", "--num_processes", "1"]),
        "trl-ext-sft": ("trl-ext", [*sft, "--per_device_train_batch_size", "8", "--num_processes", "1"]),
        "trl-kto": ("trl", [*kto, "--per_device_train_batch_size", "8", "--num_processes", "1"]),
        "trl-ext-kto": ("trl-ext", [*kto, "--per_device_train_batch_size", "8", "--num_processes", "1"]),
        "trl-ext-reward": ("trl-ext", [*reward, "--per_device_train_batch_size", "8", "--num_processes", "1"]),
        "trl-ext-kto-zero3": ("trl-ext", [*kto, "--per_device_train_batch_size", "4", "--accelerate_config",
                                          str(zero3), "--num_processes", "2"]),
    }
    launches = {}
    for name, (command, args) in commands.items():
        launches[name] = run_command([str(BIN / command), *args, *COMMON, "--output_dir", str(tmp / name)], 300)
    return tmp, launches


@pytest.mark.parametrize("command", ["sft", "kto"])
def test_trl_ext_command_gives_trls_losses(runs, command):
    tmp, launches = runs
    for name in (f"trl-{command}", f"trl-ext-{command}"):
        assert launches[name].returncode == 0, f"{name}:\n{launches[name].output[-4000:]}"
    theirs, ours = _history(tmp / f"trl-{command}"), _history(tmp / f"trl-ext-{command}")
    assert [h["step"] for h in ours] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        assert [h[key] for h in ours] == pytest.approx([h[key] for h in theirs], rel=1e-6, abs=1e-7), key


def test_trl_ext_kto_under_zero3_trains_the_same_trajectory_and_saves_what_peft_reloads(runs):
    tmp, launches = runs
    launch = launches["trl-ext-kto-zero3"]
    assert launch.returncode == 0, launch.output[-6000:]
    one, two = _history(tmp / "trl-ext-kto"), _history(tmp / "trl-ext-kto-zero3")
    # same global batch (8 = 1 x 8 = 2 x 4); the KL term's estimate is a per-process batch mean, so the loss moves
    # by a few 1e-4 between the two layouts
    assert [h["grad_norm"] for h in two] == pytest.approx([h["grad_norm"] for h in one], rel=1e-5)
    assert [h["loss"] for h in two] == pytest.approx([h["loss"] for h in one], abs=5e-4)

    saved = [str(tmp / "trl-ext-kto-zero3"), str(tmp / "trl-ext-kto-zero3" / "checkpoint-3"), str(tmp / "trl-kto"),
             default_model_path()]
    found = reloading.reload(default_model_path(), "causal", saved)
    assert found["metadata"][saved[0]] == [] and found["metadata"][saved[1]] == []
    final, checkpoint, trls, base = (found["outputs"][path] for path in saved)
    assert final == checkpoint  # the final save is the last checkpoint's model
    # within the trajectory's difference of what TRL's own one-process run saved, and far from the untrained model
    to_trl, to_base = _max_diff(final, trls), _max_diff(final, base)
    print(f"\nKTO ZeRO-3 adapter reloaded: max diff to TRL's one-process save {to_trl:.2e}, to the base {to_base:.2e}")
    assert to_trl < 1e-4 and to_base > 1e-2  # measured: 1e-6 and 0.16


def _max_diff(a, b) -> float:
    """Largest |a - b| over two batch x tokens x vocab lists."""
    return max(abs(x - y) for row_a, row_b in zip(a, b) for ta, tb in zip(row_a, row_b) for x, y in zip(ta, tb))


def test_trl_ext_reward_trains_and_saves_the_head_whole(runs):
    tmp, launches = runs
    assert launches["trl-ext-reward"].returncode == 0, launches["trl-ext-reward"].output[-4000:]
    report = audit(str(tmp / "trl-ext-reward"), base=default_model_path())
    assert report.ok, report.format()
    with safe_open(str(tmp / "trl-ext-reward" / "adapter_model.safetensors"), framework="pt") as f:
        assert "base_model.model.score.weight" in set(f.keys())  # trained and saved whole, one output
        assert f.get_slice("base_model.model.score.weight").get_shape()[0] == 1
