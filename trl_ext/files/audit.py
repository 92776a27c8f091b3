"""Audit a saved checkpoint (adapter or full model) from its safetensors headers, without loading the model.

Catches the broken checkpoints users report after ZeRO-3 runs: empty ``[0]`` placeholder tensors, adapter keys that
still carry the adapter name (``.default``), a reward head that was LoRA-wrapped instead of saved (``score.weight``
missing) or has the wrong number of outputs, and an adapter whose shapes do not match its base model.
Used by ``trl-ext verify PATH [--base MODEL]``.
"""

import collections
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trl_ext import patches
from trl_ext.errors import NONFINITE, CheckpointError
from trl_ext.files.header import read_header
from trl_ext.files.shards import PREFIX_BYTES

ADAPTER_WEIGHTS = "adapter_model.safetensors"
FULL_WEIGHTS, FULL_INDEX = "model.safetensors", "model.safetensors.index.json"
HEAD_NAMES = ("score", "classifier", "v_head")  # reward / classification heads across architectures
EXPONENT_BITS = {"F64": (np.uint64, 0x7FF0000000000000), "F32": (np.uint32, 0x7F800000), "F16": (np.uint16, 0x7C00),
                 "BF16": (np.uint16, 0x7F80)}  # for the NaN/inf check
# What a file that is not valid safetensors raises while being read (bad JSON is a ValueError).
UNREADABLE = (OSError, ValueError, KeyError, TypeError, struct.error)


class Problem(str):
    """A problem's text for people, its ``kind`` for code (``errors.NONFINITE``, ...) and, for a summary of several
    problems, the ``detail`` line that decided the kind. A ``str``: reports join it, ranks exchange it (pickled)."""

    def __new__(cls, text: str, kind: str = "problem", detail: str | None = None):
        problem = super().__new__(cls, text)
        problem.kind, problem.detail = kind, detail
        return problem


@dataclass
class Report:
    path: str
    kind: str = "unknown"  # "adapter" or "full"
    num_tensors: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def format(self) -> str:
        lines = [f"{self.path}: {self.kind} checkpoint, {self.num_tensors} tensors"]
        lines += [f"  PROBLEM: {p}" for p in self.problems] or ["  OK: no problems found"]
        return "\n".join(lines)





def read_safetensors(path: Path) -> tuple[dict[str, tuple[list[int], str]], dict[str, bytes]]:
    """One file's tensors, {name: (shape, dtype code)}, and the first ``PREFIX_BYTES`` of each one's data.

    The header is checked as ``safe_open`` checks it (``header.read_header``); only the prefixes of the data are
    read. Raises one of ``UNREADABLE`` for a broken file.
    """
    with open(path, "rb", buffering=0) as f:
        header = read_header(f.fileno())
        tensors = {name: (e.shape, e.code) for name, e in header.entries.items()}
        prefixes = {name: os.pread(f.fileno(), min(e.end - e.begin, PREFIX_BYTES), e.begin)
                    for name, e in header.entries.items()}
    return tensors, prefixes


def _any_nonfinite(raw: bytes, code: str) -> bool:
    """NaN and inf are exactly the values whose exponent bits are all ones, in every IEEE format (bfloat16 too)."""
    kind, mask = EXPONENT_BITS[code]
    bits = np.frombuffer(raw, dtype=kind)
    return bits.size > 0 and int((bits & mask).max()) == mask


def _nonfinite(tensors: dict, prefixes: dict[str, bytes]) -> list[str]:
    """Floating-point tensors whose leading values hold NaN or inf: one pass per dtype over all the prefixes."""
    by_dtype = collections.defaultdict(list)
    for name, (_, code) in tensors.items():
        if code in EXPONENT_BITS:
            by_dtype[code].append(name)
    bad = []
    for code, names in by_dtype.items():
        if _any_nonfinite(b"".join(prefixes.get(n, b"") for n in names), code):
            bad += [n for n in names if _any_nonfinite(prefixes.get(n, b""), code)]
    return sorted(bad)


def _read_files(files: list[Path], report: Report) -> tuple[dict, dict]:
    tensors, prefixes = {}, {}
    for path in files:
        try:
            found, read = read_safetensors(path)
        except UNREADABLE as exc:  # a truncated or corrupted file
            report.problems.append(f"{path.name}: cannot be read as safetensors ({exc})")
            continue
        tensors.update(found)
        prefixes.update(read)
    return tensors, prefixes


def weight_files(root: Path, report: Report) -> list[Path]:
    """The checkpoint's weight files (adapter, index shards, or one file), recording its kind on ``report``.

    Args:
        root: the checkpoint directory.
        report: the audit's report; missing files are added to its problems.

    Returns:
        The files that exist.
    """
    if (root / ADAPTER_WEIGHTS).exists():
        report.kind = "adapter"
        return [root / ADAPTER_WEIGHTS]
    if (root / FULL_INDEX).exists():
        report.kind = "full"
        weight_map = json.loads((root / FULL_INDEX).read_text()).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).exists()]
        if missing:
            report.problems.append(f"index lists shards that do not exist: {', '.join(missing)}")
        return [root / s for s in shards if (root / s).exists()]
    if (root / FULL_WEIGHTS).exists():
        report.kind = "full"
        return [root / FULL_WEIGHTS]
    report.problems.append(f"no {ADAPTER_WEIGHTS}, {FULL_WEIGHTS} or {FULL_INDEX} found")
    return []


def _strip_peft_prefix(name: str) -> str:
    return name.removeprefix("base_model.model.")


def _base_shapes(base: str, sequence_classification: bool, num_labels: int,
                 hub_layout: bool = False) -> dict[str, list[int]]:
    """Parameter shapes of the base model, built on the meta device (no weights are loaded).

    In-memory names (what adapters use), or with ``hub_layout`` the names and shapes ``save_pretrained`` writes.
    """
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(base)
    recorded = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    is_model = isinstance(recorded, type) and issubclass(recorded, transformers.PreTrainedModel)
    auto = recorded if is_model else AutoModelForCausalLM
    if sequence_classification:
        config.num_labels, auto = num_labels, AutoModelForSequenceClassification
    with torch.device("meta"):
        model = model_from_config(auto, config)
    if hub_layout:
        from trl_ext.files.hub_names import to_hub

        return {name: list(t.shape) for name, t in to_hub(model, dict(model.state_dict())).items()}
    return {name: list(p.shape) for name, p in model.named_parameters()}


def _check_adapter(root: Path, tensors: dict, report: Report, base: str | None, num_labels: int) -> None:
    config_path = root / "adapter_config.json"
    if not config_path.exists():
        report.problems.append("adapter_config.json is missing: PeftModel.from_pretrained cannot load this adapter")
        return
    config = json.loads(config_path.read_text())
    mapping = config.get("auto_mapping") or {}
    if mapping.get("parent_library", "").startswith("transformers"):  # AutoPeftModel imports the base class by name
        problem = _unknown_class_problem(mapping.get("base_model_class", ""), "adapter_config.json's auto_mapping",
                                         config_path)
        if problem:
            report.problems.append(problem)
    named = sorted(n for n in tensors if ".default." in n or n.endswith(".default"))
    if named:
        report.problems.append(
            f"{len(named)} keys carry the adapter name '.default' (e.g. {named[0]}); PEFT expects canonical keys "
            "without it. Save with PeftModel.save_pretrained or peft.get_peft_model_state_dict."
        )
    modules_to_save = set(config.get("modules_to_save") or [])
    is_seq_cls = config.get("task_type") == "SEQ_CLS"
    # Dotted, PEFT-prefix-free names of the fully saved (non-LoRA) tensors: ".score.weight", ".model.norm.weight".
    saved = {"." + _strip_peft_prefix(n): n for n in tensors if "lora_" not in n}

    def has(module: str, dotted_names) -> bool:
        return any(f".{module}." in name for name in dotted_names)

    for head in HEAD_NAMES:
        head_keys = [n for dotted, n in saved.items() if dotted.startswith(f".{head}.")]
        if not head_keys and any(f".{head}.lora_" in "." + n for n in tensors):
            report.problems.append(
                f"the head '{head}' was LoRA-wrapped and its own weights ({head}.weight) were not saved: it will "
                f"load randomly initialised. Train it through modules_to_save=['{head}'] (task_type='SEQ_CLS')."
            )
        elif is_seq_cls:
            for name in head_keys:
                if name.endswith("weight") and tensors[name][0] and tensors[name][0][0] != num_labels:
                    report.problems.append(
                        f"{name}: head has {tensors[name][0][0]} outputs, expected num_labels={num_labels}"
                    )
    if is_seq_cls and not any(_strip_peft_prefix(n).split(".")[0] in HEAD_NAMES for n in tensors):
        report.problems.append(
            "task_type is SEQ_CLS but no head weights (score/classifier) were saved; add the head to modules_to_save"
        )
    # PEFT lists candidate names (SEQ_CLS adds both "classifier" and "score"); only those the base has must be saved.
    base_shapes = _base_shapes(base, is_seq_cls, num_labels) if base is not None else None
    if base_shapes is not None:
        in_base = ["." + name for name in base_shapes]
        unsaved = sorted(m for m in modules_to_save if has(m, in_base) and not has(m, saved))
    elif not any(has(m, saved) for m in modules_to_save):
        unsaved = sorted(modules_to_save)
    else:
        unsaved = []
    for module in unsaved:
        report.problems.append(f"modules_to_save lists '{module}' but none of its weights were saved")
    _check_lora_targets(config, tensors, base_shapes, report)
    if base_shapes is not None:
        _check_against_base(tensors, base_shapes, report, adapter=True)


def _check_lora_targets(config: dict, tensors: dict, base_shapes: dict | None, report: Report) -> None:
    """Every module the adapter config targets has its LoRA weights saved: PEFT would load a missing pair silently
    as zeros, i.e. the untrained base (PEFT's own key mapping drops them under activation-checkpoint wrappers)."""
    targets = config.get("target_modules")
    if config.get("peft_type") != "LORA" or not (targets or config.get("target_parameters")):
        return
    lora_modules = {"." + _strip_peft_prefix(n).split(".lora_")[0] for n in tensors if ".lora_" in n}
    if not lora_modules:
        report.problems.append(f"adapter_config.json targets {targets or config.get('target_parameters')} but the "
                               "file holds no LoRA weights: it would load as the untrained base model")
        return
    if (base_shapes is None or not isinstance(targets, list)
            or any(config.get(k) for k in ("exclude_modules", "layers_to_transform", "layers_pattern"))):
        return  # PEFT's own matching decides which modules are targeted; the shapes check covers the rest
    expected = {"." + name.rsplit(".", 1)[0] for name in base_shapes
                if name.endswith(".weight") and name.count(".") >= 1 and name.rsplit(".", 2)[-2] in targets}
    missing = sorted(m for m in expected if not any(m.endswith(l) or l.endswith(m) for l in lora_modules))
    if missing:
        report.problems.append(f"{len(missing)} targeted modules have no LoRA weights saved (e.g. "
                               f"{missing[0].lstrip('.')}): they would load untrained")


def _check_against_base(tensors: dict, base_shapes: dict, report: Report, adapter: bool) -> None:
    mismatched = []
    modules = {name.rpartition(".")[0] for name in base_shapes}
    for name, (shape, _) in tensors.items():
        key = _strip_peft_prefix(name)
        if adapter and ".lora_" in key:
            module, rest = key.split(".lora_", 1)
            module = module.replace(".base_layer", "")  # LoRA on several parameters of one module nests wrappers
            base_weight = base_shapes.get(f"{module}.weight")
            if base_weight is None and module in modules:
                continue  # LoRA on a module's parameters (target_parameters, MoE experts): its own layout
            if base_weight is None:
                mismatched.append(f"{name} targets '{module}', which the base model does not have")
            elif rest.startswith("A") and shape[-1:] != base_weight[-1:]:
                mismatched.append(f"{name} {shape} expects in_features {shape[-1]}, base has {base_weight[-1]}")
            elif rest.startswith("B") and shape[:1] != base_weight[:1]:
                mismatched.append(f"{name} {shape} expects out_features {shape[0]}, base has {base_weight[0]}")
        elif key in base_shapes and base_shapes[key] != shape:
            mismatched.append(f"{name} has shape {shape}, base has {base_shapes[key]}")
    if mismatched:
        report.problems.append(
            f"{len(mismatched)} tensors do not match the base model: " + "; ".join(mismatched[:3])
            + (" ..." if len(mismatched) > 3 else "")
        )


def _unknown_class_problem(name: str, where: str, fix_file: Path) -> str | None:
    """A class name that transformers does not export, with the one-line repair. Serving engines (vLLM, SGLang,
    llama.cpp) pick the model class by this name; ``from_pretrained`` goes by ``model_type`` and never notices."""
    import transformers

    if not name or hasattr(transformers, name):
        return None
    fixed = name.removeprefix("FSDP")  # FSDP2's fully_shard swaps in an FSDP<Class> subclass
    if fixed == name or not hasattr(transformers, fixed):
        return f"{where} names {name!r}, which transformers does not export: serving engines will refuse it"
    return (f"{where} names {name!r}, FSDP2's wrapper class of {fixed}: serving engines refuse it. "
            f"Fix: sed -i 's/\"{name}\"/\"{fixed}\"/' {fix_file}")


def _check_architectures(config: dict, report: Report, config_path: Path) -> None:
    custom = json.dumps(config.get("auto_map") or {})  # remote code names its own classes
    for name in config.get("architectures") or []:
        problem = None if name in custom else _unknown_class_problem(name, "config.json's architectures",
                                                                       config_path)
        if problem:
            report.problems.append(problem)


def _check_full(root: Path, tensors: dict, report: Report, base: str | None, num_labels: int) -> None:
    config_path = root / "config.json"
    if not config_path.exists():
        report.problems.append("config.json is missing: from_pretrained cannot load this model")
        return
    config = json.loads(config_path.read_text())
    _check_architectures(config, report, config_path)
    is_seq_cls = any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    if is_seq_cls:
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if labels != num_labels:
            report.problems.append(
                f"config declares {labels} labels; a reward model needs num_labels={num_labels} "
                "(otherwise it reloads with a head of the wrong size)"
            )
        heads = [n for n in tensors if n.split(".")[0] in HEAD_NAMES]
        if not heads:
            report.problems.append("a sequence-classification model without head weights (score.weight missing)")
    if base is not None:
        _check_against_base(tensors, _base_shapes(base, is_seq_cls, num_labels, hub_layout=True), report,
                            adapter=False)


def check_contents(root: Path, tensors: dict, prefixes: dict, report: Report, base: str | None,
                   num_labels: int) -> None:
    """The audit of what the files hold: empty placeholders, NaN or inf, then the adapter or full-model checks.

    Args:
        root: the checkpoint directory.
        tensors: ``{name: (shape, dtype code)}`` of every weight file.
        prefixes: each tensor's first bytes.
        report: where the problems go.
        base: a base model to check shapes against, or None.
        num_labels: the outputs a classification head must have.
    """
    report.num_tensors = len(tensors)
    empty = sorted(n for n, (shape, _) in tensors.items() if math.prod(shape) == 0)
    if empty:
        report.problems.append(
            f"{len(empty)} empty tensors (e.g. {empty[0]} {tensors[empty[0]][0]}): ZeRO-3 placeholders saved without "
            "gathering the parameters first: " + ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else "")
        )
    nonfinite = _nonfinite(tensors, prefixes)
    if nonfinite:
        report.problems.append(Problem(f"{len(nonfinite)} tensors contain NaN or inf values: "
                                       + ", ".join(nonfinite[:5]) + (" ..." if len(nonfinite) > 5 else ""),
                                       kind=NONFINITE))
    if report.kind == "adapter":
        _check_adapter(root, tensors, report, base, num_labels)
    elif report.kind == "full":
        _check_full(root, tensors, report, base, num_labels)


def audit(path: str, base: str | None = None, num_labels: int = 1) -> Report:
    """Audit a saved checkpoint (adapter or full model): the files every loader needs, complete and consistent.

    Args:
        path: the checkpoint directory.
        base: a model id or path to check the tensor names and shapes against (optional).
        num_labels: the number of outputs a reward or classification head must have.

    Returns:
        A ``Report`` whose ``ok`` is True when nothing is wrong; ``format()`` lists the problems.
    """
    root = Path(path)
    report = Report(str(path))
    if not root.is_dir():
        report.problems.append("not a directory")
        return report
    tensors, prefixes = _read_files(weight_files(root, report), report)
    check_contents(root, tensors, prefixes, report, base, num_labels)
    return report


def verify_or_raise(path: str, **kwargs) -> Report:
    """``audit``, raising on any problem.

    Args:
        path: the checkpoint directory.
        **kwargs: ``base`` and ``num_labels``, as for ``audit``.

    Returns:
        The report of a checkpoint with no problem.

    Raises:
        CheckpointError: the report's problems, formatted.
    """
    report = audit(path, **kwargs)
    if not report.ok:
        raise CheckpointError(report.format())
    return report


def model_from_config(cls, config):
    """A model of ``cls`` built from ``config``: an Auto class's public ``from_config``, else the class's
    ``_from_config`` as ``from_pretrained`` builds it (patch ``model-from-config``), or ``cls(config)`` where the
    release moved it."""
    if cls.__name__.startswith("Auto"):
        return cls.from_config(config)
    return cls._from_config(config) if patches.applies("model-from-config") else cls(config)
