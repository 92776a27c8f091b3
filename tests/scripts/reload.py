"""Load a saved checkpoint with plain transformers + peft (no trl_ext, no DeepSpeed) and print its probe outputs.

Usage: python reload.py BASE {causal,reward,reward-autopeft} CHECKPOINT...
Prints a JSON object: checkpoint -> logits or rewards. An adapter that PEFT loads with missing keys is an error.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]


def outputs(path: Path, base: str, kind: str) -> list:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if kind == "reward-autopeft":
        from peft import AutoPeftModelForSequenceClassification

        model = AutoPeftModelForSequenceClassification.from_pretrained(
            path, num_labels=1, pad_token_id=tokenizer.pad_token_id)
        return _run(model)
    if kind.startswith("reward"):
        def load(name):
            return AutoModelForSequenceClassification.from_pretrained(
                name, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    else:
        load = AutoModelForCausalLM.from_pretrained
    if (path / "adapter_config.json").exists():
        from peft import PeftModel

        model = PeftModel.from_pretrained(load(base), path)
    else:
        model = load(path)
    return _run(model)


def _run(model) -> list:
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().tolist()


def main():
    warnings.filterwarnings("error", message=".*missing adapter keys.*")  # a head or LoRA weight not restored
    base, kind, checkpoints = sys.argv[1], sys.argv[2], sys.argv[3:]
    print(json.dumps({path: outputs(Path(path), base, kind) for path in checkpoints}))


if __name__ == "__main__":
    main()
