"""Plain transformers + peft, in a fresh process: a GRPO run's saved adapter gives the trained policy's outputs, and
the weights its vLLM sync sent are what ``merge_and_unload().save_pretrained()`` writes, name for name.

Usage: python grpo_reload.py BASE RUN_DIR NAME
Prints {"probes", "base_probes" (adapter disabled), "sync_names_equal", "sync_max_diff", ...} as JSON.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]  # as tests/scripts/train.py


def main():
    base, run, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / name).eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS)
        probes = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().tolist()
        with model.disable_adapter():
            base_probes = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().tolist()
    synced = load_file(run / "synced.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        model.merge_and_unload().save_pretrained(tmp)
        expected = load_file(f"{tmp}/model.safetensors")
    same = synced.keys() == expected.keys()
    diff = max((synced[k] - expected[k]).abs().max().item() for k in expected) if same else None
    print(json.dumps({"probes": probes, "base_probes": base_probes, "sync_names_equal": same, "sync_max_diff": diff,
                      "sync_only": sorted(set(synced) - set(expected))[:3],
                      "save_only": sorted(set(expected) - set(synced))[:3]}))


if __name__ == "__main__":
    main()
