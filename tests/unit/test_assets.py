import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_ext.assets import DEFAULT_MODEL_NAME, load_dataset_by_name, load_default_dataset, resolve_model
from trl_ext.assets.data_gen import build as build_data
from trl_ext.assets.tiny_model import build


def _digest(path: Path) -> str:
    files = (path / "model.safetensors", path / "tokenizer.json")
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


@pytest.mark.slow  # builds the model again in a fresh process
@pytest.mark.newest_only  # torch's kernels on each instruction set: the same torch in the oldest leg
def test_model_build_is_deterministic_on_every_cpu_instruction_set(tmp_path, tiny_model_path):
    """Built here and in a process restricted to ATen's baseline kernels (ATEN_CPU_CAPABILITY=default): the same bytes.
    torch's own random init differed between the two, so a cache built on another machine was another model."""
    build(tmp_path / "here")
    assert _digest(tmp_path / "here") == _digest(Path(tiny_model_path))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    subprocess.run([sys.executable, "-m", "trl_ext.assets.tiny_model", str(tmp_path / "baseline")], env=env, check=True,
                   capture_output=True)
    assert _digest(tmp_path / "baseline") == _digest(tmp_path / "here")


def test_embedded_model_resolves_and_loads_as_lm_and_reward_base(tiny_model_path):
    assert resolve_model(DEFAULT_MODEL_NAME) == tiny_model_path == resolve_model(None)
    assert resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert type(lm).__name__ == "LlamaForCausalLM"
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    assert rm.score.out_features == 1


def test_chat_template_marks_assistant_tokens(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    messages = [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}]
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "7<|im_end|>"  # the answer and its end-of-turn, nothing else
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|im_end|>"


def test_bundled_datasets_have_the_columns_trl_expects():
    expected = {"sft": {"messages"}, "preference": {"prompt", "chosen", "rejected"}, "reward": {"chosen", "rejected"}}
    for kind, columns in expected.items():
        data = load_default_dataset(kind)
        assert set(data) == {"train", "test"}
        assert set(data["train"].column_names) == columns
        assert len(data["train"]) > 5 * len(data["test"]) > 0
    assert load_dataset_by_name("trl-ext/arithmetic-preference")["test"].num_rows == data["test"].num_rows


def test_single_digit_prompts_hold_out_texts_not_skills():
    """The GRPO demo's data: single-digit sums only; no held-out text is a training (or SFT) text, and every held-out
    sum is asked in training under another wording (the held-out accuracy measures the skill across wordings)."""
    import re

    data = load_dataset_by_name("trl-ext/arithmetic-prompt-1digit")
    texts = {split: [row[0]["content"] for row in data[split]["prompt"]] for split in ("train", "test")}
    numbers = {split: [tuple(map(int, re.findall(r"\d+", t))) for t in texts[split]] for split in texts}
    assert all(len(n) == 2 and max(n) < 10 for split in numbers for n in numbers[split])
    assert (len(texts["train"]), len(texts["test"])) == (272, 28)
    sft_train = {row[0]["content"] for row in load_default_dataset("sft")["train"]["messages"]}
    assert not set(texts["test"]) & (set(texts["train"]) | sft_train)
    assert {frozenset(n) for n in numbers["test"]} <= {frozenset(n) for n in numbers["train"]}
    assert all(int(a) == sum(n) for a, n in zip(data["test"]["answer"], numbers["test"], strict=True))


def test_bundled_files_match_their_generator():
    built = build_data()
    pref = load_default_dataset("preference")["train"]
    assert pref[0] == built["preference"]["train"][0]
    assert pref.num_rows == len(built["preference"]["train"])
    row = pref[0]
    assert row["chosen"][0]["content"] != row["rejected"][0]["content"]


def test_warmed_model_resolves_loads_and_answers_held_out_sums(tiny_model_path):
    """The SFT-warmed embedded model is a plain checkpoint that already answers a good share of unseen prompts."""
    from trl_ext.assets import ARITH_MODEL_NAME
    from trl_ext.assets.tiny_arith import greedy_accuracy

    path = resolve_model(ARITH_MODEL_NAME)
    assert path != tiny_model_path and Path(path, "model.safetensors").is_file()
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    held_out = load_default_dataset("preference")["test"]
    accuracy = greedy_accuracy(model, tok, held_out["prompt"], [c[0]["content"] for c in held_out["chosen"]])
    assert 0.3 < accuracy < 0.9  # 0.625 when built (2026-12-03): it answers, and leaves DPO/GRPO room to improve
