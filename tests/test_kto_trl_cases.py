"""TRL's own KTOTrainer test cases, run with ``trl.KTOTrainer`` and with ``trl_ext.KTOTrainer``.

The cases and assertions of ``TestKTOTrainer.test_train`` and ``test_evaluate_with_raw_dataset`` in TRL's
``tests/test_kto_trainer.py``: the same configs, dataset types, loss types and reference log-prob precomputation. TRL's
tests load Hub models and the ``trl-internal-testing/zen`` datasets, which cannot be fetched here; the embedded model
and the bundled arithmetic data, in the same dataset types, stand in for them. Each case passes TRL's assertions with
both classes, and the two give the same logs.
"""

import pytest
import torch
import trl
from transformers import AutoModelForCausalLM, AutoTokenizer

import trl_ext
from trl_ext.assets import load_default_dataset

pytestmark = pytest.mark.slow


def _text(messages) -> str:
    return " ".join(m["content"] for m in messages)


def zen_like(config_name: str):
    """The bundled data in the dataset type TRL's ``zen`` config of that name has (train and test, 16 rows each)."""
    if config_name == "standard_preference":
        data = load_default_dataset("preference")
        data = data.map(lambda r: {k: _text(r[k]) for k in ("prompt", "chosen", "rejected")})
    elif config_name == "standard_unpaired_preference":
        data = load_default_dataset("unpaired")
        data = data.map(lambda r: {"prompt": _text(r["prompt"]), "completion": _text(r["completion"])})
    elif config_name == "conversational_implicit_prompt_preference":
        data = load_default_dataset("reward")  # chosen/rejected conversations, prompt inside them
    else:
        raise KeyError(config_name)
    return {split: data[split].select(range(16)) for split in ("train", "test")}


def _run_test_train(trainer_class, model_path, tmp_path, config_name, loss_type, pre_compute, eval_dataset):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32")
    ref_model = AutoModelForCausalLM.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.pad_token = tokenizer.eos_token
    args = trl.KTOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, gradient_accumulation_steps=1,
        learning_rate=9e-1, eval_strategy="steps" if eval_dataset else "no", beta=0.1,
        precompute_ref_log_probs=pre_compute, loss_type=loss_type, report_to="none", bf16=False,
    )
    dataset = zen_like(config_name)
    trainer = trainer_class(model=model, ref_model=ref_model, args=args, processing_class=tokenizer,
                            train_dataset=dataset["train"], eval_dataset=dataset["test"] if eval_dataset else None)
    previous = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None  # TRL's assertions
    for name, param in previous.items():
        if param.sum() != 0:
            assert not torch.equal(param, trainer.model.get_parameter(name)), name
    return trainer.state.log_history


@pytest.mark.parametrize("config_name, loss_type, pre_compute, eval_dataset", [
    ("standard_preference", "kto", True, True),
    ("standard_unpaired_preference", "kto", False, True),
    ("conversational_implicit_prompt_preference", "apo_zero_unpaired", True, True),
    ("standard_unpaired_preference", "apo_zero_unpaired", False, True),
])
def test_train(config_name, loss_type, pre_compute, eval_dataset, tiny_model_path, tmp_path):
    case = (config_name, loss_type, pre_compute, eval_dataset)
    theirs = _run_test_train(trl.KTOTrainer, tiny_model_path, tmp_path / "trl", *case)
    ours = _run_test_train(trl_ext.KTOTrainer, tiny_model_path, tmp_path / "trl_ext", *case)
    assert [sorted(log) for log in ours] == [sorted(log) for log in theirs]
    numbers = {(i, k): v for i, log in enumerate(theirs) for k, v in log.items()
               if isinstance(v, float) and "runtime" not in k and "per_second" not in k}
    assert {key: ours[key[0]][key[1]] for key in numbers} == pytest.approx(numbers, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("precompute_ref_log_probs", [False, True])
def test_evaluate_with_raw_dataset(precompute_ref_log_probs, tiny_model_path, tmp_path):
    dataset = zen_like("standard_unpaired_preference")["train"]
    losses = []
    for trainer_class, out in ((trl.KTOTrainer, "trl"), (trl_ext.KTOTrainer, "trl_ext")):
        args = trl.KTOConfig(output_dir=str(tmp_path / out), precompute_ref_log_probs=precompute_ref_log_probs,
                             report_to="none", bf16=False)
        trainer = trainer_class(model=tiny_model_path, args=args, train_dataset=dataset)
        metrics = trainer.evaluate(eval_dataset=dataset)
        assert metrics["eval_loss"] is not None  # TRL's assertion
        losses.append(metrics["eval_loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
