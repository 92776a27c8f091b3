"""Every dataset format and argument type TRL accepts, with TRL and trl_ext side by side in one process.

One row per format or argument type. Each row builds the same trainer twice, once from ``trl`` and once from
``trl_ext``, with the same arguments (fresh objects for each side), and trains a few steps. Both train or both fail;
where both train, the per-step losses are equal (fp32 on CPU, same seed; TRL's configs with ``bf16=False``). The few
rows where trl_ext deliberately differs say so in ``difference`` and are listed in docs/differences.md
("Deliberate differences"). To add a row, append a ``Row`` to ``ROWS``.

The rows in ``FAST`` (each trainer's main formats, a failure each, LoRA, QLoRA and the deliberate differences) are in
the fast tier; the other variants run with the slow tests (each row trains twice, about a second).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

import trl_ext

STEPS = 3
TRAINERS = {"sft": (trl.SFTTrainer, trl_ext.SFTTrainer, trl.SFTConfig),
            "dpo": (trl.DPOTrainer, trl_ext.DPOTrainer, trl.DPOConfig),
            "reward": (trl.RewardTrainer, trl_ext.RewardTrainer, trl.RewardConfig),
            "kto": (trl.KTOTrainer, trl_ext.KTOTrainer, trl.KTOConfig)}


@dataclass
class Row:
    id: str
    trainer: str  # a key of TRAINERS
    rows: list[dict] | Callable  # or model path -> rows
    expect: str = "train"  # "train" or "fail", for both sides
    config: dict = field(default_factory=dict)  # extra config fields
    args: Callable | None = None  # output_dir -> args, instead of the trainer's TRL config
    model: Callable | None = None  # model path -> the ``model`` argument, instead of the path itself
    kwargs: Callable | None = None  # model path -> more trainer arguments (peft_config, formatting_func, ...)
    difference: str | None = None  # a deliberate difference: "TRL fails" (trl_ext trains), or "losses"
    why: str = ""


# ---------------------------------------------------------------- datasets (STEPS batches of 2 rows)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SUMS = [(a, b) for a, b in ((1, 2), (3, 4), (12, 30), (7, 8), (20, 5), (9, 9))]
TEXT = [{"text": f"{a}+{b}={a + b}"} for a, b in SUMS]
PROMPT_COMPLETION = [{"prompt": f"{a}+{b}=", "completion": f"{a + b}"} for a, b in SUMS]
PROMPT_COMPLETION_CHAT = [{"prompt": [user(f"{a}+{b}?")], "completion": [assistant(f"{a + b}")]} for a, b in SUMS]
MESSAGES = [{"messages": [user(f"{a}+{b}?"), assistant(f"{a + b}")]} for a, b in SUMS]
SYSTEM = [{"messages": [{"role": "system", "content": "You add numbers."}, user(f"{a}+{b}?"), assistant(f"{a + b}")]}
          for a, b in SUMS]
SHAREGPT = [{"conversations": [{"from": "human", "value": f"{a}+{b}?"}, {"from": "gpt", "value": f"{a + b}"}]}
            for a, b in SUMS]
EMPTY_ANSWER = [*MESSAGES[:5], {"messages": [user("0+0?"), assistant("")]}]
QA = [{"question": f"{a}+{b}?", "answer": f"{a + b}"} for a, b in SUMS]
ADD_TOOL = json.dumps([{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}])
# TRL's tool-calling format: the assistant's call has no content; the tool's answer follows; ``tools`` (JSON here)
# holds the schemas the chat template renders.
TOOL_CALLS = [{"messages": [user(f"{a}+{b}?"),
                            {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                                "name": "add", "arguments": {"a": a, "b": b}}}]},
                            {"role": "tool", "name": "add", "content": f"{a + b}"},
                            assistant(f"{a + b}")],
               "tools": ADD_TOOL} for a, b in SUMS]
PREFERENCE = [{"prompt": f"{a}+{b}=", "chosen": f"{a + b}", "rejected": f"{a * b}"} for a, b in SUMS]
PREFERENCE_IMPLICIT = [{"chosen": f"{a}+{b}={a + b}", "rejected": f"{a}+{b}={a * b}"} for a, b in SUMS]
PREFERENCE_CHAT = [{"prompt": [user(f"{a}+{b}?")], "chosen": [assistant(f"{a + b}")],
                    "rejected": [assistant(f"{a * b}")]} for a, b in SUMS]
PREFERENCE_CHAT_IMPLICIT = [{"chosen": [user(f"{a}+{b}?"), assistant(f"{a + b}")],
                             "rejected": [user(f"{a}+{b}?"), assistant(f"{a * b}")]} for a, b in SUMS]
UNPAIRED = [{"prompt": f"{a}+{b}=", "completion": f"{a + b if i % 2 else a * b}", "label": bool(i % 2)}
            for i, (a, b) in enumerate(SUMS)]
UNPAIRED_CHAT = [{"prompt": [user(f"{a}+{b}?")], "completion": [assistant(f"{a + b if i % 2 else a * b}")],
                  "label": bool(i % 2)} for i, (a, b) in enumerate(SUMS)]
EMPTY_CHOSEN = [*PREFERENCE[:5], {"prompt": "0+0=", "chosen": "", "rejected": "1"}]

# A ChatML template that renders tools and tool calls (the embedded model's own template renders neither).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenized(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    return [{"input_ids": tokenizer(row["text"])["input_ids"] + [tokenizer.eos_token_id]} for row in TEXT]


# ---------------------------------------------------------------- arguments


def model_object(path):
    return AutoModelForCausalLM.from_pretrained(path)


def peft_model(path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # LoRA's random init, the same on both sides
    return get_peft_model(model_object(path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def plain_training_arguments(output_dir):
    return TrainingArguments(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0)


def tool_tokenizer(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TOOL_TEMPLATE
    return {"processing_class": tokenizer}


def lora(task_type=None):
    from peft import LoraConfig

    return lambda path: {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                   task_type=task_type)}


def qlora(dtype):
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)
    return {"model_init_kwargs": {"dtype": dtype, "quantization_config": quantization}}


OFFLOADING = "TRL's activation offloading moves activations with an accelerator's streams: no CPU-only run has one"

ROWS = [
    # --- SFT: dataset formats
    Row("sft-language-modeling-text", "sft", TEXT),
    Row("sft-prompt-completion", "sft", PROMPT_COMPLETION),
    Row("sft-prompt-completion-conversational", "sft", PROMPT_COMPLETION_CHAT),
    Row("sft-messages", "sft", MESSAGES, config={"assistant_only_loss": True}),
    Row("sft-system-message", "sft", SYSTEM),
    Row("sft-sharegpt-conversations", "sft", SHAREGPT),
    Row("sft-tool-calls", "sft", TOOL_CALLS, kwargs=tool_tokenizer),
    Row("sft-tool-calls-template-cannot-render", "sft", TOOL_CALLS, expect="fail",
        why="the embedded model's template adds None (a tool call's content) to a string"),
    Row("sft-pre-tokenized", "sft", tokenized),
    Row("sft-formatting-func", "sft", QA,
        kwargs=lambda path: {"formatting_func": lambda row: f"{row['question']} {row['answer']}"}),
    Row("sft-empty-answer-in-one-row", "sft", EMPTY_ANSWER),
    Row("sft-no-known-columns", "sft", [{"question": "1+1?"}] * 6, expect="fail"),
    # --- SFT: argument types
    Row("sft-plain-training-arguments", "sft", TEXT, args=plain_training_arguments),
    Row("sft-model-object", "sft", TEXT, model=model_object),
    Row("sft-peft-model", "sft", TEXT, model=peft_model),
    Row("sft-lora-peft-config", "sft", TEXT, kwargs=lora()),
    Row("sft-model-init-kwargs-dtype", "sft", TEXT, config={"model_init_kwargs": {"dtype": "bfloat16"}}),
    Row("sft-qlora-bf16", "sft", TEXT, config=qlora(torch.bfloat16), kwargs=lora()),
    Row("sft-qlora-fp32", "sft", TEXT, config=qlora(torch.float32), kwargs=lora(), difference="losses",
        why="TRL casts a quantized model's adapter to bf16; trl_ext keeps it in the base's compute dtype (fp32)"),
    # --- SFT: options that change the training step
    Row("sft-padding-free", "sft", TEXT, config={"padding_free": True, "max_length": None}),
    Row("sft-packing-bfd", "sft", TEXT * 2, config={"packing": True, "packing_strategy": "bfd", "max_length": 16}),
    Row("sft-packing-bfd-split", "sft", TEXT * 2,
        config={"packing": True, "packing_strategy": "bfd_split", "max_length": 8}),
    Row("sft-packing-wrapped", "sft", TEXT * 2, config={"packing": True, "packing_strategy": "wrapped",
                                                       "max_length": 8}),
    Row("sft-completion-only-loss", "sft", PROMPT_COMPLETION, config={"completion_only_loss": True}),
    Row("sft-completion-and-prompt-loss", "sft", PROMPT_COMPLETION, config={"completion_only_loss": False}),
    Row("sft-loss-type-dft", "sft", TEXT, config={"loss_type": "dft"}),
    Row("sft-activation-offloading", "sft", TEXT, config={"activation_offloading": True}, expect="fail",
        why=OFFLOADING),
    Row("sft-activation-offloading-lora", "sft", TEXT, config={"activation_offloading": True}, kwargs=lora(),
        expect="fail", why=OFFLOADING),
    # --- DPO
    Row("dpo-loss-type-list", "dpo", PREFERENCE, config={"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
    Row("dpo-padding-free", "dpo", PREFERENCE, config={"padding_free": True}),
    Row("dpo-activation-offloading-lora", "dpo", PREFERENCE, config={"activation_offloading": True}, kwargs=lora(),
        expect="fail", why=OFFLOADING),
    Row("dpo-explicit-prompt", "dpo", PREFERENCE),
    Row("dpo-implicit-prompt", "dpo", PREFERENCE_IMPLICIT),
    Row("dpo-conversational-explicit-prompt", "dpo", PREFERENCE_CHAT),
    Row("dpo-conversational-implicit-prompt", "dpo", PREFERENCE_CHAT_IMPLICIT),
    Row("dpo-empty-chosen-in-one-row", "dpo", EMPTY_CHOSEN),
    Row("dpo-pre-tokenized", "dpo", [{"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8]}] * 6,
        expect="fail", why="TRL 1.16's DPOTrainer always extracts the prompt from 'chosen'"),
    Row("dpo-plain-training-arguments", "dpo", PREFERENCE, expect="fail", args=plain_training_arguments),
    Row("dpo-model-object", "dpo", PREFERENCE, model=model_object),
    # --- KTO
    Row("kto-unpaired", "kto", UNPAIRED),
    Row("kto-unpaired-conversational", "kto", UNPAIRED_CHAT),
    Row("kto-paired-explicit-prompt", "kto", PREFERENCE),  # TRL unpairs it
    Row("kto-paired-conversational-implicit-prompt", "kto", PREFERENCE_CHAT_IMPLICIT),
    Row("kto-label-not-a-bool", "kto", [{**row, "label": "yes"} for row in UNPAIRED], expect="fail",
        why="TRL fails when it batches the labels; trl_ext before loading the model"),
    Row("kto-lora", "kto", UNPAIRED, kwargs=lora()),
    Row("kto-model-object", "kto", UNPAIRED, model=model_object),
    # --- reward
    Row("reward-implicit-prompt", "reward", PREFERENCE_IMPLICIT),
    Row("reward-explicit-prompt", "reward", PREFERENCE),
    Row("reward-conversational", "reward", PREFERENCE_CHAT_IMPLICIT),
    Row("reward-pre-tokenized", "reward", [{"chosen_ids": [5, 6, 7], "rejected_ids": [5, 6, 8]}] * 6),
    Row("reward-plain-training-arguments", "reward", PREFERENCE_IMPLICIT, expect="fail",
        args=plain_training_arguments),
    Row("reward-lora-seq-cls", "reward", PREFERENCE_IMPLICIT, kwargs=lora("SEQ_CLS")),
    Row("reward-lora-without-task-type", "reward", PREFERENCE_IMPLICIT, kwargs=lora(), difference="losses",
        why="TRL LoRA-wraps the head and leaves its weights at their random init; trl_ext trains it whole"),
]
FAST = {"sft-language-modeling-text", "sft-prompt-completion", "sft-messages", "sft-pre-tokenized",
        "sft-no-known-columns", "sft-lora-peft-config", "sft-qlora-bf16", "sft-qlora-fp32", "sft-packing-bfd",
        "sft-completion-only-loss", "sft-activation-offloading", "dpo-explicit-prompt",
        "dpo-conversational-implicit-prompt", "dpo-pre-tokenized", "dpo-plain-training-arguments", "dpo-loss-type-list",
        "kto-unpaired", "kto-paired-explicit-prompt", "kto-label-not-a-bool", "kto-lora", "reward-implicit-prompt",
        "reward-conversational", "reward-lora-seq-cls", "reward-lora-without-task-type"}
SKIPPED = [
    pytest.param(None, id="sft-images", marks=pytest.mark.skip(reason="needs a vision-language model (VLM issue)")),
    pytest.param(None, id="dpo-images", marks=pytest.mark.skip(reason="needs a vision-language model (VLM issue)")),
]


def train(side: str, row: Row, path: str, output_dir: str):
    """The losses of ``STEPS`` steps, or the exception the trainer raised (building or training)."""
    theirs, ours, config_cls = TRAINERS[row.trainer]
    if row.args:
        args = row.args(output_dir)
    else:
        args = config_cls(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3,
                          logging_steps=1, save_strategy="no", report_to="none", seed=0, bf16=False, **row.config)
    rows = row.rows(path) if callable(row.rows) else row.rows
    try:
        trainer = (theirs if side == "trl" else ours)(
            model=row.model(path) if row.model else path, args=args, train_dataset=Dataset.from_list(rows),
            **(row.kwargs(path) if row.kwargs else {}))
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - a failure is a result here
        return exc
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.mark.parametrize("row", [
    *(pytest.param(r, id=r.id, marks=() if r.id in FAST else pytest.mark.slow) for r in ROWS), *SKIPPED])
def test_trains_or_fails_as_trl_does(row, tiny_model_path, tmp_path):
    expected = train("trl", row, tiny_model_path, str(tmp_path / "trl"))
    got = train("trl_ext", row, tiny_model_path, str(tmp_path / "trl_ext"))

    if row.difference == "TRL fails":
        assert isinstance(expected, Exception), f"TRL trains now ({row.why}): drop its row in docs/differences.md"
        assert not isinstance(got, Exception), got
        return
    outcome = {"trl": "fail" if isinstance(expected, Exception) else "train",
               "trl_ext": "fail" if isinstance(got, Exception) else "train"}
    assert outcome == {"trl": row.expect, "trl_ext": row.expect}, f"TRL: {expected!r}; trl_ext: {got!r}"
    if row.expect == "fail":
        assert "\n" not in str(got).strip(), f"not one line: {got}"
        return
    assert len(expected) == STEPS and expected[0] != expected[-1]  # it trained
    if row.difference == "losses":
        assert got != pytest.approx(expected, rel=1e-6, abs=1e-7), f"same losses now ({row.why})"
    else:
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
