"""The recipes' checks before anything starts (``scripting.parse_recipe_args``): each bad input is one line, a non-zero
exit, and leaves every file as it was. Run in-process; tests/test_recipes.py runs the recipes end to end."""

import json

import pytest

from tests.harness import REPO
from trl_ext import DPOConfig, ModelConfig, ScriptArguments, TrlParser
from trl_ext.launch import UsageError
from trl_ext.scripting import parse_recipe_args

DPO_COLUMNS = [("prompt", "chosen", "rejected"), ("chosen", "rejected")]
DPO_CONFIG = str(REPO / "recipes" / "configs" / "dpo.yaml")


def parse(*argv):
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig))
    return parse_recipe_args(parser, "dpo", DPO_COLUMNS, ["--config", DPO_CONFIG, *argv])


def refused(*argv) -> str:
    with pytest.raises(UsageError) as err:
        parse(*argv)
    message = str(err.value)
    assert err.value.code != 0 and message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def snapshot(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_good_input_parses(tmp_path):
    script_args, training_args, _ = parse("--output_dir", str(tmp_path / "new"))
    assert script_args.dataset_name == "trl-ext/arithmetic-preference"
    assert training_args.output_dir == str(tmp_path / "new") and not (tmp_path / "new").exists()


def test_unknown_keys_in_config_and_on_command_line(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("learnin_rate: 1.0e-3\nmax_steps: 2\n")
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig))
    with pytest.raises(UsageError) as err:
        parse_recipe_args(parser, "dpo", DPO_COLUMNS, ["--config", str(config)])
    assert "learnin_rate (did you mean learning_rate?)" in str(err.value) and "typo.yaml" in str(err.value)
    assert "lora_rr (did you mean lora_r?)" in refused("--lora_rr", "8")


def test_output_dir_with_another_run_is_kept(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    before = snapshot(out)
    assert "already holds files" in refused("--output_dir", str(out))
    assert snapshot(out) == before
    _, training_args, _ = parse("--output_dir", str(out), "--overwrite_output_dir")  # the explicit way through
    assert training_args.output_dir == str(out) and snapshot(out) == before


def test_resume_finds_the_last_complete_checkpoint(tmp_path):
    out = tmp_path / "run"
    assert "holds no complete checkpoint-N" in refused("--output_dir", str(out), "--resume_from_checkpoint", "true")
    for step in (2, 4):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (out / ".checkpoint-6.trl_ext-partial").mkdir()  # a save killed half-way is never picked
    _, training_args, _ = parse("--output_dir", str(out), "--resume_from_checkpoint", "true")
    assert training_args.resume_from_checkpoint == str(out / "checkpoint-4")
    assert "is not a checkpoint" in refused("--output_dir", str(out), "--resume_from_checkpoint", str(tmp_path))


def test_dataset_without_the_needed_columns(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    message = refused("--dataset_name", str(data), "--output_dir", str(tmp_path / "out"))
    assert "columns ['answer', 'question']" in message and "prompt/chosen/rejected or chosen/rejected" in message
    assert not (tmp_path / "out").exists()


def test_missing_split_and_missing_dataset(tmp_path):
    assert "has no split 'validation'" in refused("--dataset_test_split", "validation")
    assert "cannot load dataset" in refused("--dataset_name", str(tmp_path / "nowhere"))


def test_missing_model_path(tmp_path):
    assert f"cannot load model '{tmp_path / 'no-model'}'" in refused("--model_name_or_path", str(tmp_path / "no-model"))


def test_num_processes_without_an_accelerate_config():
    assert "needs an accelerate config" in refused("--num_processes", "4")
