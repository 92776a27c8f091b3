"""The recipes' checks before anything starts (``scripting.parse_recipe_args``): what passes, and what they resolve
(resume, overwrite, evaluation). Every refusal is a row of tests/test_bad_input.py; test_recipes.py runs the scripts."""

import json

import pytest

from tests.harness import REPO
from trl_ext import DPOConfig, ModelConfig, ScriptArguments, TrlParser
from trl_ext.errors import UsageError
from trl_ext.launching.scripting import parse_recipe_args

DPO_CONFIG = str(REPO / "recipes" / "configs" / "dpo.yaml")


def parse(*argv):
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig))
    return parse_recipe_args(parser, "dpo", "preference", ["--config", DPO_CONFIG, *argv])


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


def test_no_evaluation_switches_off_the_evaluation_at_start():
    _, training_args, _ = parse("--eval_strategy", "no")  # the tiny config sets eval_on_start: true
    assert not training_args.eval_on_start


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


@pytest.mark.parametrize("name", ["data/my_prefs.jsonl", "prefs.csv", "./data", "/no/such/dir", "a/b/c"])
def test_a_local_dataset_path_that_does_not_exist_is_refused_at_once(name, tmp_path, monkeypatch):
    """No Hub retries (23 s offline, then "Couldn't reach ... on the Hub"): one line naming the path and the
    working directory."""
    from trl_ext.data.model_paths import check_dataset_path

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"dataset '{name}' does not exist \\(looked in {tmp_path}\\)"):
        check_dataset_path(name)
    (tmp_path / "prefs.csv").write_text("a\n1\n")
    check_dataset_path("prefs.csv")  # an existing file, and Hub ids, pass
    check_dataset_path("trl-lib/ultrafeedback_binarized")
