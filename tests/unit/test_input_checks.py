"""Input checks take TRL's verdict: TRL's own preparation decides what is refused; the checks say why, in one line.

tests/test_bad_input.py holds the user-facing table; tests/test_formats.py proves that nothing TRL trains on is
refused. Here: when the check runs, which row it names, and that it stands aside where it cannot speak for TRL.
"""

import json

import pytest
import trl
from datasets import Dataset

import trl_ext
from trl_ext.data import input_checks
from trl_ext.data.input_checks import PROBE_ROWS
from trl_ext.errors import DatasetError

GOOD = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}
NO_CONTENT = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": None}]}


def sft_args(tmp_path, **fields):
    return trl_ext.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none",
                             **fields)


def test_bad_first_rows_are_refused_before_the_model_loads(tiny_model_path, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the dataset was checked")

    monkeypatch.setattr(trl.trainer.sft_trainer, "create_model_from_path", no_loading)
    with pytest.raises(DatasetError, match="first at row 1: 'messages' has a message from 'assistant' without"):
        trl_ext.SFTTrainer(model=tiny_model_path, args=sft_args(tmp_path),
                           train_dataset=Dataset.from_list([GOOD, NO_CONTENT, GOOD]))


def test_a_bad_row_after_the_probed_ones_is_refused_as_trl_prepares_it(tiny_model_path, tmp_path, monkeypatch):
    rows = [GOOD] * (PROBE_ROWS + 5) + [NO_CONTENT]
    probed = []
    probe = input_checks.probe_datasets
    monkeypatch.setattr(input_checks, "probe_datasets", lambda *a, **k: probed.append(probe(*a, **k)))
    with pytest.raises(DatasetError, match=rf"train_dataset: 1 bad field\(s\) in {len(rows)} rows, first at row "
                                           rf"{len(rows) - 1}: 'messages' has a message from 'assistant' without"):
        trl_ext.SFTTrainer(model=tiny_model_path, args=sft_args(tmp_path), train_dataset=Dataset.from_list(rows))
    assert probed == [None]  # the first rows passed


def test_a_failure_without_a_plain_words_reason_names_the_row_trl_fails_on(tiny_model_path, tmp_path):
    # ``tools`` given as JSON text that does not parse: nothing our description knows, TRL's json.loads fails.
    tools = json.dumps([{"type": "function", "function": {"name": "add"}}])
    rows = [{**GOOD, "tools": tools}] * (PROBE_ROWS + 8)
    rows[PROBE_ROWS + 3] = {**GOOD, "tools": "[{not json"}
    with pytest.raises(DatasetError) as caught:
        trl_ext.SFTTrainer(model=tiny_model_path, args=sft_args(tmp_path), train_dataset=Dataset.from_list(rows))
    message = str(caught.value)
    assert message.startswith(f"train_dataset: TRL cannot prepare row {PROBE_ROWS + 3} (JSONDecodeError: ")
    assert "\n" not in message


def test_eval_datasets_are_named_as_the_user_passed_them(tiny_model_path, tmp_path):
    with pytest.raises(DatasetError, match=r"^eval_dataset\['held_out'\]: 1 bad field"):
        trl_ext.SFTTrainer(model=tiny_model_path, args=sft_args(tmp_path), train_dataset=Dataset.from_list([GOOD]),
                           eval_dataset={"held_out": Dataset.from_list([GOOD, NO_CONTENT])})


def test_the_probe_stands_aside_where_it_cannot_speak_for_trl(tiny_model_path, tmp_path):
    class NewerSFTTrainer(trl.SFTTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            self.something_only_the_constructor_sets  # noqa: B018 - a TRL that reads more of its trainer
            return super()._prepare_dataset(dataset, *args, **kwargs)

    bad = Dataset.from_list([GOOD, NO_CONTENT])
    input_checks.probe_datasets(NewerSFTTrainer, {"train_dataset": bad}, sft_args(tmp_path), tiny_model_path)
    # A template TRL replaces, a tokenizer that does not load, a multimodal dataset: TRL's own run decides.
    input_checks.probe_datasets(trl.SFTTrainer, {"train_dataset": bad}, sft_args(tmp_path), tmp_path / "no-model")
    images = Dataset.from_list([{**NO_CONTENT, "images": []}])
    input_checks.probe_datasets(trl.SFTTrainer, {"train_dataset": images}, sft_args(tmp_path), tiny_model_path)
    with pytest.raises(DatasetError):  # the same rows, where the probe can run
        input_checks.probe_datasets(trl.SFTTrainer, {"train_dataset": bad}, sft_args(tmp_path), tiny_model_path)


def test_trls_own_argument_errors_pass_through_unchanged(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="Unsupported truncation mode: middle") as caught:
        trl_ext.SFTTrainer(model=tiny_model_path, args=sft_args(tmp_path, truncation_mode="middle", max_length=8),
                           train_dataset=Dataset.from_list([GOOD]))
    assert not isinstance(caught.value, DatasetError)


def test_each_dataset_is_checked_once_per_run(tiny_model_path, tmp_path, monkeypatch):
    """A recipe checks its dataset in the process the user starts; the ranks it launches (which inherit the
    environment) and their trainers do not scan the same rows again. Other data or another config is checked."""
    scans = []
    prepare = input_checks.prepare_or_explain
    monkeypatch.setattr(input_checks, "prepare_or_explain", lambda p, d, *a, **k: scans.append(len(d)) or
                        prepare(p, d, *a, **k))
    rows = Dataset.from_list([GOOD] * 40)
    input_checks.probe_datasets(trl.SFTTrainer, {"train": rows}, sft_args(tmp_path / "a"), tiny_model_path)
    assert scans == [40]
    # a launched rank: a new process that inherits only the environment, where passed checks are kept
    # ... whose config differs in what does not change the rows (the recipe's model_init_kwargs, say)
    rank_args = sft_args(tmp_path / "b", model_init_kwargs={"dtype": "float32"}, learning_rate=1e-3)
    input_checks.probe_datasets(trl.SFTTrainer, {"train": rows}, rank_args, tiny_model_path)
    trainer = trl_ext.SFTTrainer(model=tiny_model_path, args=rank_args, train_dataset=rows)
    assert scans == [40, 40]  # only the trainer's preparation of the whole dataset, never the probe again
    assert len(trainer.train_dataset) == 40
    input_checks.probe_datasets(trl.SFTTrainer, {"train": rows}, sft_args(tmp_path, max_length=8), tiny_model_path)
    input_checks.probe_datasets(trl.SFTTrainer, {"train": Dataset.from_list([GOOD] * 41)}, sft_args(tmp_path),
                                tiny_model_path)
    assert scans == [40, 40, 40, 41]
