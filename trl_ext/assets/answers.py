"""What a trained arithmetic model answers, checked as a user would: in a fresh process, loaded with plain
transformers (or peft for an adapter).

``python -m trl_ext.assets.answers START_MODEL TRAINED_MODEL`` prints one JSON line: the held-out greedy accuracy of
both models on ``trl-ext/arithmetic-preference`` (test split) and the try-it pipeline's output for ``TRY_IT_PROMPT``.
A recipe's own process cannot do this itself: under ZeRO-3 its ``from_pretrained`` would partition the models.
"""

import json
import sys
from pathlib import Path

TRY_IT_PROMPT = "Compute 2 + 13."  # a held-out prompt of the bundled arithmetic (test split; the answer is 15)


def check(start_model: str, trained_model: str) -> dict:
    """Held-out greedy accuracy before and after training, and the trained model's reply to ``TRY_IT_PROMPT``.

    Args:
        start_model: The local path the run started from.
        trained_model: The saved output directory (a full model or a LoRA adapter).

    Returns:
        ``{"before": float, "after": float, "prompts": int, "reply": str}``; ``reply`` is what the printed try-it
        command prints.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from trl_ext.assets.datasets import load_default_dataset
    from trl_ext.assets.tiny_arith import greedy_accuracy

    if (Path(trained_model) / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM as trained_class
    else:
        trained_class = AutoModelForCausalLM
    rows = load_default_dataset("preference")["test"]
    answers = [chosen[-1]["content"] for chosen in rows["chosen"]]
    tokenizer = AutoTokenizer.from_pretrained(trained_model)
    before, after = (greedy_accuracy(model_class.from_pretrained(path), tokenizer, rows["prompt"], answers)
                     for model_class, path in ((AutoModelForCausalLM, start_model), (trained_class, trained_model)))
    chat = [{"role": "user", "content": TRY_IT_PROMPT}]
    # greedy, as the printed command: the model's generation config may sample, and the line must be reproducible
    reply = pipeline("text-generation", trained_model)(chat, max_new_tokens=8, do_sample=False,
                                                       return_full_text=False)
    return {"before": before, "after": after, "prompts": len(answers), "reply": str(reply)}


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], sys.argv[2])))
