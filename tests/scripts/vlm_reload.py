"""Reload a saved tiny-VLM run with plain transformers/peft in a fresh process; print the largest difference between
its logits on the image+text probes and the ones the training processes recorded (``probe_logits.pt``)."""

import json
import sys
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForImageTextToText, AutoProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vlm_train import probe_batch  # noqa: E402

from trl_ext.assets import vlm_model_path  # noqa: E402  (the base's path; loading is plain transformers)

out = Path(sys.argv[1])
if (out / "adapter_config.json").exists():
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(vlm_model_path()), out)
else:
    model = AutoModelForImageTextToText.from_pretrained(out)
model.eval()
with torch.no_grad():
    logits = model(**probe_batch(AutoProcessor.from_pretrained(vlm_model_path()))).logits.float()
trained = torch.load(out / "probe_logits.pt")
print(json.dumps({"max_diff": (logits - trained).abs().max().item(), "class": type(model).__name__}))
