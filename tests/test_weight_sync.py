"""The vLLM weight sync (GRPO, RLOO) against an engine stand-in: TRL's own ``sync_weights`` runs unchanged, with our
bounded walk; after one sync the engine computes exactly what the trained (merged) policy computes.

See ``tests/engine_standin.py`` for what the stand-in checks. The policy has LoRA on every linear layer (MoE experts
included), adapters initialised away from zero, and a ``modules_to_save`` head that differs from the base's, so a
missing, misnamed or unmerged weight shows in the outputs.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from trl.generation.vllm_generation import VLLMGeneration

from tests.engine_standin import EngineStandIn, fake_generation
from tests.families import FAMILIES, family_path

SYNC_FAMILIES = ["llama", "qwen3_moe", "llava", "gemma3", "qwen2_vl"]  # gemma3: tied; qwen2_vl: vLLM's CPU build
# does not run it here (its processor needs torchvision), so the stand-in is its test


def _policy(family: str):
    model_class = AutoModelForImageTextToText if FAMILIES[family][0] == "vlm" else AutoModelForCausalLM
    path = family_path(family)
    torch.manual_seed(0)
    model = model_class.from_pretrained(path, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # LoRA on the fused experts, as PEFT allows
    extra = {"target_parameters": experts} if family == "qwen3_moe" else {}
    tied = getattr(model.config, "tie_word_embeddings", False)  # trained as one matrix, as vllm_checks asks
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                        modules_to_save=["embed_tokens" if tied else "lm_head"],
                        init_lora_weights=False, ensure_weight_tying=tied, **extra)
    policy = get_peft_model(model, config).eval()
    with torch.no_grad():  # the trained head differs from the base's
        for name, param in policy.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    return policy, model_class, path


def _inputs(policy):
    ids = torch.arange(3, 3 + 24).view(2, 12) % policy.get_base_model().config.get_text_config().vocab_size
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module", params=SYNC_FAMILIES)
def synced(request):
    policy, model_class, path = _policy(request.param)
    log: list = []
    engine = EngineStandIn(model_class, path, log)
    with torch.no_grad():
        before = engine.model(**_inputs(policy)).logits
        expected = policy(**_inputs(policy)).logits
    generation = fake_generation(policy, engine, sleep_mode=True)
    generation.sync_weights()  # TRL's own: wake-up, walk, load_weights per tensor, prefix-cache reset
    engine.apply()
    with torch.no_grad():
        got = engine.model(**_inputs(policy)).logits
    return request.param, policy, engine, log, before, expected, got


def test_engine_computes_the_trained_policy_after_one_sync(synced):
    family, _, engine, _, before, expected, got = synced
    assert (before - expected).abs().max() > 1e-3, "the adapter must change the outputs for the test to mean anything"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_every_checkpoint_weight_is_sent_once_under_its_checkpoint_name(synced):
    _, _, engine, log, *_ = synced
    sent = [entry[1] for entry in log if entry[0] == "load_weights"]
    assert len(sent) == len(set(sent)), "a weight was sent twice"
    assert set(sent) == set(engine.shapes)


def test_sleeping_weights_are_woken_before_the_first_load(synced):
    log = synced[3]
    calls = [entry[0] for entry in log]
    assert calls[0] == "wake_up" and log[0][1] == ("weights",), calls[:3]
    assert calls[-1] == "reset_prefix_cache"


def test_the_policy_is_left_unmerged(synced):
    policy, expected = synced[1], synced[5]
    with torch.no_grad():
        torch.testing.assert_close(policy(**_inputs(policy)).logits, expected, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "llava"])
def test_trl_walk_sends_names_vllm_does_not_know(family):
    """Why the walk is replaced: TRL 1.16's string rules give in-memory names for MoE and VLM families."""
    policy, model_class, path = _policy(family)
    engine = EngineStandIn(model_class, path, [])
    generation = fake_generation(policy, engine, generation_class=VLLMGeneration, sleep_mode=False)
    with pytest.raises(KeyError, match="no parameter named"):
        generation.sync_weights()


def test_sends_in_the_engine_dtype():
    policy, model_class, path = _policy("llama")
    engine = EngineStandIn(model_class, path, [])
    generation = fake_generation(policy, engine, dtype=torch.bfloat16)
    assert {t.dtype for _, t in generation._iter_named_params()} == {torch.bfloat16}
