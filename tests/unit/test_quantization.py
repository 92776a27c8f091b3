"""QLoRA settings under ZeRO, and the refusals: each one in the trainer's constructor, before anything is loaded or
written. The ZeRO stage is the one the training args report (``args.deepspeed_plugin``), set here without launching
DeepSpeed; the 2-process runs are in tests/distributed/test_qlora.py."""

import logging
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

import trl_ext
from trl_ext.assets import default_model_path, load_default_dataset
from trl_ext.engines import quantization

FOUR_BIT = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "float32"}
TRAINERS = {"sft": (trl_ext.SFTTrainer, trl_ext.SFTConfig, "sft"),
            "reward": (trl_ext.RewardTrainer, trl_ext.RewardConfig, "reward"),
            "dpo": (trl_ext.DPOTrainer, trl_ext.DPOConfig, "preference")}


def plugin(stage: int, bf16="auto"):
    return SimpleNamespace(zero_stage=stage, deepspeed_config={"bf16": {"enabled": bf16}})


def args_for(stage: int | None, model_init_kwargs=None, bf16=False):
    return SimpleNamespace(deepspeed_plugin=None if stage is None else plugin(stage), bf16=bf16, fp16=False,
                           model_init_kwargs=model_init_kwargs)


def bound_for(**arguments):
    return SimpleNamespace(arguments={"model": "some/model", "peft_config": LoraConfig(), **arguments})


@pytest.fixture
def notices(caplog):
    caplog.set_level(logging.WARNING, logger="trl_ext")
    return lambda: [r.getMessage() for r in caplog.records if "QLoRA" in r.getMessage()]


@pytest.mark.parametrize("given_as", ["object", "dict"])
def test_zero3_stores_4bit_weights_in_deepspeeds_dtype_and_says_so_once(given_as, notices):
    user_config = BitsAndBytesConfig(**FOUR_BIT) if given_as == "object" else dict(FOUR_BIT)
    args = args_for(3, {"dtype": "float32", "quantization_config": user_config})
    quantization.adjust_for_engine(args, bound_for())
    config = args.model_init_kwargs["quantization_config"]
    assert isinstance(config, BitsAndBytesConfig) and config.load_in_4bit
    assert config.bnb_4bit_quant_storage == torch.float32 and config.bnb_4bit_quant_type == "nf4"
    assert args.model_init_kwargs["dtype"] == "float32"
    if given_as == "object":  # the user's config is not modified
        assert user_config.bnb_4bit_quant_storage == torch.uint8
    assert len(notices()) == 1 and "ZeRO-3" in notices()[0] and "float32" in notices()[0]


def test_zero3_with_bf16_training_stores_bf16_and_the_trainer_argument_is_adjusted_too():
    args = args_for(3, bf16=True)
    bound = bound_for(quantization_config=BitsAndBytesConfig(**FOUR_BIT))
    quantization.adjust_for_engine(args, bound)
    assert bound.arguments["quantization_config"].bnb_4bit_quant_storage == torch.bfloat16
    assert args.model_init_kwargs is None


def test_zero2_keeps_integer_storage_and_fixes_a_float_storage_deepspeed_would_cast(notices):
    args = args_for(2, {"quantization_config": BitsAndBytesConfig(**FOUR_BIT)})
    quantization.adjust_for_engine(args, bound_for())
    assert args.model_init_kwargs["quantization_config"].bnb_4bit_quant_storage == torch.uint8
    assert notices() == []

    args = args_for(2, {"quantization_config": {**FOUR_BIT, "bnb_4bit_quant_storage": "bfloat16"}})
    quantization.adjust_for_engine(args, bound_for())
    assert args.model_init_kwargs["quantization_config"].bnb_4bit_quant_storage == torch.float32


def test_without_deepspeed_or_quantization_nothing_changes(notices):
    config = BitsAndBytesConfig(**FOUR_BIT, bnb_4bit_quant_storage="bfloat16")
    args = args_for(None, {"quantization_config": config})
    quantization.adjust_for_engine(args, bound_for())
    assert args.model_init_kwargs["quantization_config"] is config
    args = args_for(3, {"dtype": "float32"})
    quantization.adjust_for_engine(args, bound_for())
    assert args.model_init_kwargs == {"dtype": "float32"} and notices() == []


def test_deepspeed_dtype_follows_the_config_and_resolves_auto():
    args = args_for(3, bf16=True)
    assert quantization.deepspeed_dtype(args) == torch.bfloat16
    args.deepspeed_plugin.deepspeed_config = {"bf16": {"enabled": False}, "fp16": {"enabled": True}}
    assert quantization.deepspeed_dtype(args) == torch.float16
    args.deepspeed_plugin.deepspeed_config = {}
    assert quantization.deepspeed_dtype(args) == torch.float32


def load_4bit(storage="uint8"):
    config = BitsAndBytesConfig(**FOUR_BIT, bnb_4bit_quant_storage=storage)
    return AutoModelForCausalLM.from_pretrained(default_model_path(), quantization_config=config, dtype=torch.float32)


def test_adapter_takes_the_bases_dtype_instead_of_trls_bf16():
    model = get_peft_model(load_4bit(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    for param in model.parameters():  # what TRL 1.16 does to every trainable parameter of a quantized model
        if param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    quantization.match_adapter_dtype(args_for(None), model)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))  # a bf16 lm_head copy on fp32 hidden states would raise here


# --- refusals: in the trainer's constructor, one line, nothing loaded, nothing written ------------------------------

def construct(tmp_path, monkeypatch, trainer, stage, model=None, quant=None, peft=True, **kwargs):
    """Build ``trainer`` as a user would, with the args reporting ZeRO-``stage``; return the error it raises."""
    loads = []
    real = PreTrainedModel.from_pretrained.__func__
    monkeypatch.setattr(PreTrainedModel, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a) or real(cls, *a, **k)))
    trainer_cls, config_cls, data = TRAINERS[trainer]
    out = tmp_path / "out"
    args = config_cls(output_dir=str(out), report_to="none",
                      model_init_kwargs={"quantization_config": quant, **kwargs} if quant else None)
    args.deepspeed_plugin = plugin(stage)
    with pytest.raises(ValueError) as error:
        trainer_cls(model=model or default_model_path(), args=args, peft_config=LoraConfig(r=4) if peft else None,
                    train_dataset=load_default_dataset(data)["train"].select(range(4)))
    message = str(error.value)
    assert message.startswith("QLoRA: ") and "\n" not in message
    assert loads == [], "a model was loaded before the refusal"
    assert not out.exists(), "the output directory was written"
    return message


def test_8bit_under_zero3_is_refused(tmp_path, monkeypatch):
    message = construct(tmp_path, monkeypatch, "sft", 3, quant=BitsAndBytesConfig(load_in_8bit=True))
    assert "8-bit" in message and "load_in_4bit=True" in message


def test_quantized_model_with_a_splitting_device_map_under_deepspeed_is_refused(tmp_path, monkeypatch):
    message = construct(tmp_path, monkeypatch, "reward", 2, quant=dict(FOUR_BIT), device_map="auto")
    assert "device_map='auto'" in message and "without device_map" in message


def test_missing_bitsandbytes_is_refused(tmp_path, monkeypatch):
    real = quantization.importlib.util.find_spec
    monkeypatch.setattr(quantization.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    message = construct(tmp_path, monkeypatch, "dpo", 3, quant=BitsAndBytesConfig(**FOUR_BIT))
    assert "pip install 'bitsandbytes>=0.46'" in message


def test_quantized_model_without_an_adapter_is_refused(tmp_path, monkeypatch):
    message = construct(tmp_path, monkeypatch, "sft", 2, quant=BitsAndBytesConfig(**FOUR_BIT), peft=False)
    assert "peft_config" in message


def test_users_4bit_model_with_the_wrong_storage_for_zero3_is_refused(tmp_path, monkeypatch):
    message = construct(tmp_path, monkeypatch, "sft", 3, model=load_4bit("uint8"))
    assert "stores its weights as uint8" in message and "bnb_4bit_quant_storage=torch.float32" in message


def test_users_4bit_model_split_over_devices_is_refused(tmp_path, monkeypatch):
    model = load_4bit("float32")
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 1}
    message = construct(tmp_path, monkeypatch, "dpo", 3, model=model)
    assert "device_map" in message


def test_trainers_keep_4bit_layers_off_the_cpu_packed_path(tmp_path):
    """An eval pass without grad, then a save (state_dict), must leave the 4-bit model computing what it did.

    On a CPU with AVX512-BF16, bitsandbytes' packed path rounds the scales to bf16 and its inverse keeps them so:
    without the trainer's switch the outputs move (measured 0.03 on the tiny model). Elsewhere this holds anyway.
    """
    trainer_cls, config_cls, data = TRAINERS["sft"]
    args = config_cls(output_dir=str(tmp_path / "out"), report_to="none",
                      model_init_kwargs={"quantization_config": BitsAndBytesConfig(**FOUR_BIT), "dtype": "float32"})
    trainer = trainer_cls(model=default_model_path(), args=args, peft_config=LoraConfig(r=4),
                          train_dataset=load_default_dataset(data)["train"].select(range(4)))
    model, ids = trainer.model, torch.tensor([[10 + i for i in range(12)]])
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    model.train()
    before = model(input_ids=ids).logits.detach()
    model.eval()
    with torch.no_grad():
        during_eval = model(input_ids=ids).logits
    model.state_dict()  # what every save does
    model.train()
    after = model(input_ids=ids).logits.detach()
    assert torch.equal(before, during_eval) and torch.equal(before, after)
