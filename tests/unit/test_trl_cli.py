"""``trl-ext <command>``'s front: TRL's parser with trl_ext's configs, the checks before anything is launched, and
TRL's names given back afterwards. (``tests/distributed/test_trl_cli.py`` runs the commands.)"""

import json

import pytest
import trl

import trl_ext
from trl_ext import cli
from trl_ext.launching import trl_cli


def test_help_is_trls_with_trl_ext_fields(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["kto", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for option in ("--dataset_name", "--desirable_weight", "--use_peft", "--max_shard_size", "--save_in_background",
                   "--save_on_preemption", "--checkpoint_mirror", "--mirror_storage_options", "--mirror_grace_period",
                   "--mirror_exit_grace_period"):
        assert option in out, option
    assert trl.KTOTrainer is not trl_ext.KTOTrainer and trl.KTOConfig is not trl_ext.KTOConfig  # given back


def test_names_resolve_to_trl_ext_only_inside_the_block():
    with trl_cli.trl_ext_classes("sft"):
        from trl import SFTConfig, SFTTrainer

        assert (SFTTrainer, SFTConfig) == (trl_ext.SFTTrainer, trl_ext.SFTConfig)
    assert trl.SFTTrainer is trl_ext.SFTTrainer._trl_class


@pytest.mark.parametrize("label, problem", [("yes", "'label' is 'yes', expected True or False"),
                                            (None, "'label' is None, expected True or False")])
def test_bad_rows_are_refused_before_anything_is_launched(tiny_model_path, tmp_path, monkeypatch, label, problem):
    rows = [{"prompt": "What is 2+2?", "completion": " 4", "label": True}] * 3
    rows.append({"prompt": "What is 2+3?", "completion": " 6", "label": label})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    with pytest.raises(SystemExit) as exited:
        cli.main(["kto", "--model_name_or_path", tiny_model_path, "--dataset_name", str(tmp_path),
                  "--output_dir", str(tmp_path / "out")])
    assert problem in str(exited.value.code) and "row 3" in str(exited.value.code)
    assert not launched and not (tmp_path / "out").exists()


def test_embedded_names_reach_the_ranks_as_the_paths_the_check_loaded(tiny_model_path, tmp_path, monkeypatch):
    # TRL's script in each rank knows no embedded name: it is given the local paths, last (over a config file's too)
    from datasets import load_dataset

    from trl_ext.assets import load_dataset_by_name
    from trl_ext.launching import accelerate_run

    launched = []
    monkeypatch.setattr(accelerate_run, "run", lambda args: launched.append(args) or 0)
    cli.main(["dpo", "--model_name_or_path", "trl-ext/tiny-llama", "--dataset_name", "trl-ext/arithmetic-preference",
              "--output_dir", str(tmp_path / "out"), "--max_steps", "1"])
    (args,) = launched
    words = args.training_script_args
    model = words[len(words) - 1 - words[::-1].index("--model_name_or_path") + 1]
    dataset = words[len(words) - 1 - words[::-1].index("--dataset_name") + 1]
    assert model == tiny_model_path
    plain, bundled = load_dataset(dataset), load_dataset_by_name("trl-ext/arithmetic-preference")
    assert sorted(plain) == sorted(bundled) == ["test", "train"]
    assert all(plain[split].to_list() == bundled[split].to_list() for split in bundled)
