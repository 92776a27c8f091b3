"""Compare every file a save wrote, other than the weights, with what plain transformers and peft write.

Serving engines (vLLM, SGLang, llama.cpp) pick the model class from ``config.json``'s ``architectures[0]`` and read
the other metadata files as they are, while ``from_pretrained`` forgives a lot (it goes by ``model_type``). So a
reload alone cannot catch a wrong name: each file is compared with the one that the reloaded model's (or tokenizer's)
own ``save_pretrained`` writes, JSON field by field. Used by the fresh-process reload scripts (no trl_ext imported).
"""

import json
import os
import tempfile

import transformers

WEIGHTS = (".safetensors", ".safetensors.index.json")
# The kinds of file save_pretrained writes beside the weights; a checkpoint also holds the Trainer's own files
# (optimizer and RNG states, trainer_state.json, DeepSpeed's and DCP's folders), which nothing here compares.
METADATA = (".json", ".jinja", ".txt", ".model", ".md", ".py")
TRAINER_FILES = {"trainer_state.json", "zero_to_fp32.py", "zero_to_torch.py"}  # DeepSpeed copies its scripts in
# PEFT keeps the first two as sets and writes them in iteration order (it changes with PYTHONHASHSEED); trl_ext writes
# them sorted, so that every rank and every run writes the same file (docs/saving.md). PEFT applies
# target_parameters in sorted order and does not keep the order it read when it saves again. Each load of a SEQ_CLS
# adapter appends "classifier" and "score" to modules_to_save again: compared as sets.
UNORDERED = {"target_modules", "modules_to_save", "target_parameters"}
# The model card records the directory it was first written to (PEFT: base_model, tags); it is compared without them.
CARD = "README.md"


def _fields(path: str) -> dict:
    return json.load(open(path))


def _card_body(path: str) -> str:
    text = open(path).read()
    return text.split("---", 2)[-1] if text.startswith("---") else text


def compare_files(saved: str, reference: str) -> list[str]:
    """The differences between the non-weight files of two directories.

    Args:
        saved: the directory a save wrote.
        reference: the directory that ``save_pretrained`` of the reloaded objects wrote.

    Returns:
        One line per difference: a file only one side has, a JSON field that differs, or other bytes that differ.
    """
    def metadata(directory):
        return {name for name in os.listdir(directory) if name.endswith(METADATA) and not name.endswith(WEIGHTS)
                and name not in TRAINER_FILES and os.path.isfile(os.path.join(directory, name))}

    ours, theirs = metadata(saved), metadata(reference)
    problems = [f"{name}: written, but save_pretrained does not write it" for name in sorted(ours - theirs)]
    problems += [f"{name}: save_pretrained writes it, the save did not" for name in sorted(theirs - ours)]
    for name in sorted(ours & theirs):
        a, b = os.path.join(saved, name), os.path.join(reference, name)
        if name.endswith(".json"):
            mine, expected = _fields(a), _fields(b)
            for key in UNORDERED & set(mine) & set(expected):
                if isinstance(mine[key], list) and isinstance(expected[key], list):
                    mine[key], expected[key] = sorted(set(mine[key])), sorted(set(expected[key]))
            for key in sorted(set(mine) | set(expected)):
                if mine.get(key, "<absent>") != expected.get(key, "<absent>"):
                    problems.append(f"{name}: {key} is {mine.get(key, '<absent>')!r}, save_pretrained writes "
                                    f"{expected.get(key, '<absent>')!r}")
        elif name == CARD:
            if _card_body(a) != _card_body(b):
                problems.append(f"{name}: the model card's text differs from the one save_pretrained writes")
        elif open(a, "rb").read() != open(b, "rb").read():
            problems.append(f"{name}: bytes differ from the file save_pretrained writes")
    return problems


def architecture_problems(saved: str, expected_class: str) -> list[str]:
    """``config.json``'s ``architectures[0]`` must be the class that loaded it, and one that transformers exports:
    engines serve by that name."""
    config_path = os.path.join(saved, "config.json")
    if not os.path.exists(config_path):
        return []
    names = _fields(config_path).get("architectures") or []
    if not names:
        return ["config.json has no architectures"]
    problems = []
    if not hasattr(transformers, names[0]):
        problems.append(f"config.json: architectures[0] {names[0]!r} is not a class transformers exports")
    if names[0] != expected_class:
        problems.append(f"config.json: architectures[0] is {names[0]!r}, save_pretrained writes {expected_class!r}")
    return problems


def metadata_problems(saved: str, model, processing_class=None, reference: str | None = None) -> list[str]:
    """Everything that differs between ``saved`` and what ``save_pretrained`` writes.

    Args:
        saved: the saved directory (a full model or an adapter).
        model: the model loaded from it with plain transformers (or a ``PeftModel`` for an adapter).
        processing_class: the tokenizer or processor loaded from it, if the save has one.
        reference: what the trained model's own ``save_pretrained`` wrote in the training process, if recorded.
            Without it the reference is ``model`` and ``processing_class`` saved again, which a file that
            transformers reads and writes back unchanged passes (architectures, dtype and the rest that
            ``save_pretrained`` sets are still caught). transformers drops a top-level ``use_cache`` of some
            vision-language configs on load, so those need the recorded reference.

    Returns:
        One line per difference; empty when the save's metadata is exactly save_pretrained's.
    """
    if reference is not None:
        problems = compare_files(saved, reference)
    else:
        with tempfile.TemporaryDirectory() as again:
            model.save_pretrained(again)
            if processing_class is not None:
                processing_class.save_pretrained(again)
            problems = compare_files(saved, again)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(model, "peft_config"):
        problems += architecture_problems(saved, type(base).__name__)
    return problems
