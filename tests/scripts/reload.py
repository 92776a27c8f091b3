"""Load a saved checkpoint with plain transformers + peft (no trl_ext, no DeepSpeed) and print its probe outputs.

Usage: python reload.py BASE {causal,reward,reward-autopeft} CHECKPOINT...
Prints a JSON object: ``{"outputs": {checkpoint: logits or rewards}, "metadata": {checkpoint: [difference, ...]}}``,
where the differences are the files other than the weights that are not what ``save_pretrained`` writes (see
``tests/metadata.py``). An adapter that PEFT loads with missing keys is an error.

``python reload.py --serve`` answers such requests one after another (``tests/reloading.py``: one such process per test
session, as its start-up costs more than the reloads): each a JSON line ``{"base", "kind", "checkpoints"}`` on stdin,
each answer one line ``RELOAD <that JSON object>`` on stdout, or ``RELOAD {"error": traceback}``.
"""

import json
import sys
import traceback
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's tests package
from tests.metadata import metadata_problems  # noqa: E402

PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]


def load(path: Path, base: str, kind: str):
    """The saved model as a user loads it with plain transformers or peft, and its tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if kind == "reward-autopeft":
        from peft import AutoPeftModelForSequenceClassification

        model = AutoPeftModelForSequenceClassification.from_pretrained(
            path, num_labels=1, pad_token_id=tokenizer.pad_token_id)
        return model, tokenizer
    if kind.startswith("reward"):
        def load_model(name):
            return AutoModelForSequenceClassification.from_pretrained(
                name, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    else:
        load_model = AutoModelForCausalLM.from_pretrained
    if (path / "adapter_config.json").exists():
        from peft import PeftModel

        model = PeftModel.from_pretrained(load_model(base), path)
    else:
        model = load_model(path)
    return model, tokenizer


def _run(model) -> list:
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().tolist()


def reload(base: str, kind: str, checkpoints: list[str]) -> dict:
    found = {"outputs": {}, "metadata": {}}
    for path in checkpoints:
        model, tokenizer = load(Path(path), base, kind)
        found["outputs"][path] = _run(model)
        found["metadata"][path] = metadata_problems(path, model, tokenizer)
    return found


def serve() -> None:
    seed = torch.initial_seed()  # what a fresh process starts with: weights a checkpoint lacks initialize the same
    for line in sys.stdin:
        request = json.loads(line)
        torch.manual_seed(seed)
        try:
            answer = reload(request["base"], request["kind"], request["checkpoints"])
        except Exception:  # noqa: BLE001 - the test reports it; the next request still gets an answer
            answer = {"error": traceback.format_exc()}
        print("RELOAD " + json.dumps(answer), flush=True)


def main():
    warnings.filterwarnings("error", message=".*missing adapter keys.*")  # a head or LoRA weight not restored
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        print(json.dumps(reload(sys.argv[1], sys.argv[2], sys.argv[3:])))


if __name__ == "__main__":
    main()
