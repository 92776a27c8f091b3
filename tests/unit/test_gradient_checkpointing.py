import pytest
from peft import LoraConfig

import trl_ext
from trl_ext.assets import default_model_path, load_default_dataset
from trl_ext.engines import gradient_checkpointing


def test_recompute_fix_detected_from_the_installed_deepspeed():
    # Read from DeepSpeed's source; it must agree with the release that shipped the fix (the oldest supported
    # DeepSpeed, 0.19.2, lacks it: .ci/oldest.sh)
    import deepspeed
    from packaging.version import Version

    expected = Version(deepspeed.__version__) >= Version(gradient_checkpointing.DEEPSPEED_FIX_VERSION)
    assert gradient_checkpointing.deepspeed_keeps_frozen_params_on_recompute() is expected


def _trainer(tmp_path, **config):
    args = trl_ext.SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no", **config)
    data = load_default_dataset("sft")["train"].select(range(4))
    return trl_ext.SFTTrainer(model=default_model_path(), args=args, train_dataset=data,
                              peft_config=LoraConfig(r=4, target_modules=["q_proj"]))


def test_default_is_non_reentrant_without_input_hook(tmp_path):
    trainer = _trainer(tmp_path)
    assert trainer.args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert not [m for m in trainer.model.modules() if getattr(m, "_require_grads_hooks", None)]
    trainer.train()
    assert set(gradient_checkpointing.layer_settings(trainer.model).values()) == {False}
    assert not [m for m in trainer.model.modules() if getattr(m, "_require_grads_hooks", None)]


def test_explicit_reentrant_kept(tmp_path):
    trainer = _trainer(tmp_path, gradient_checkpointing_kwargs={"use_reentrant": True})
    trainer.train()
    assert set(gradient_checkpointing.layer_settings(trainer.model).values()) == {True}


def test_unfixed_deepspeed_falls_back_with_one_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(gradient_checkpointing, "deepspeed_keeps_frozen_params_on_recompute", lambda: False)
    args = type("Args", (), {"activation_checkpointing": True,
                             "deepspeed_plugin": type("P", (), {"zero_stage": 3})()})()
    frozen = type("M", (), {"parameters": lambda self: iter([type("P", (), {"requires_grad": False})()])})()
    assert gradient_checkpointing.decide(args, frozen, None) is True
    assert "deepspeed>=0.19.3" in caplog.text
    caplog.clear()
    assert gradient_checkpointing.decide(args, frozen, False) is False  # explicit choice wins
    args.deepspeed_plugin.zero_stage = 2
    assert gradient_checkpointing.decide(args, frozen, None) is False and caplog.text == ""


def test_overridden_setting_is_caught():
    layer = type("L", (), {})
    policy = gradient_checkpointing.CheckpointingPolicy(use_reentrant=False)
    args = type("Args", (), {"activation_checkpointing": True})()
    model = type("M", (), {"modules": lambda self: iter([]), "named_modules": lambda self: iter([("x", layer())])})()
    with pytest.raises(RuntimeError, match="no layer checkpoints"):
        policy.on_train_begin(args, None, None, model=model)


def test_dpo_adds_no_input_hook_at_any_step(tmp_path):
    """TRL's DPO re-enables checkpointing around every reference forward, and under PEFT each re-enable registers one
    more input-require-grads hook on the input embeddings (TRL 1.16, transformers 5.24: 7 after 5 steps, all run on
    every forward); trl_ext's DPO holds none, step after step."""
    from transformers import TrainerCallback

    counts = []

    class CountHooks(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            counts.append(len(model.get_base_model().get_input_embeddings()._forward_hooks))

    args = trl_ext.DPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to="none",
                             save_strategy="no", gradient_checkpointing=True)
    data = load_default_dataset("preference")["train"].select(range(6))
    trainer = trl_ext.DPOTrainer(model=default_model_path(), args=args, train_dataset=data,
                                 peft_config=LoraConfig(r=4, target_modules=["q_proj"]), callbacks=[CountHooks()])
    trainer.train()
    assert counts == [0, 0, 0]
