"""Load a saved checkpoint with plain transformers + peft (no trl_ext, no DeepSpeed) and print its probe outputs.

Usage: python reload.py BASE {causal,reward} CHECKPOINT... Prints a JSON object: checkpoint -> logits or rewards.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]


def outputs(path: Path, base: str, kind: str) -> list:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if kind == "reward":
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
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().tolist()


def main():
    base, kind, checkpoints = sys.argv[1], sys.argv[2], sys.argv[3:]
    print(json.dumps({path: outputs(Path(path), base, kind) for path in checkpoints}))


if __name__ == "__main__":
    main()
