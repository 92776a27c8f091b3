"""The throughput step's self-checks (bench/device_check.py, step 1): what each run actually trained, read from the
trainer after its first step, TRL's side against trl_ext's, and a peak-memory floor that a measured peak can never be
below.

``collect`` reads a trainer (it needs torch); everything else is pure arithmetic on the figures it returns, so that
tests/unit/test_device_figures.py can try it with made-up numbers without a GPU. The tests do not import bench/
(tests/unit/test_layout.py): they run this file, which answers JSON requests on stdin (see ``main``).

Figures of one run (a dict, JSON-safe):
- ``trainable_params``: elements of the parameters that require a gradient.
- ``weights_bytes``: every parameter of the trained model, and of a separate reference model (DPO full) when the
  trainer holds one; ``ref_weights_bytes`` is that reference model's share.
- ``gradient_bytes``: the trainable parameters' bytes (a gradient has its parameter's dtype and shape; all of them
  exist together before the optimizer step).
- ``optimizer_state_bytes``: the tensors in the optimizer's state after the first step (AdamW: two moments each).
- ``param_dtypes``: the parameters' dtypes, sorted.
- ``gradient_checkpointing``: "off", or the mode the layers' checkpoint functions call (reentrant / non-reentrant),
  how many layers checkpoint, and whether activations are offloaded.
- ``attn_implementation``: ``model.config._attn_implementation``.
- ``optimizer``: the optimizer's class and its ``fused`` / ``foreach`` settings (a fused AdamW on one side alone would
  change a full fine-tune's step time).
- ``input_grad_hooks``: the forward hooks on the input embeddings. TRL registers transformers' input-require-grads
  hook for PEFT with checkpointing (and its DPO re-enables checkpointing around every reference forward); trl_ext
  removes it, which non-reentrant checkpointing does not need.
"""

import functools
import json
import sys

GIB = 2**30

# (figure key, label in the table). The table and tests/test_device_check.py use these labels.
COMPARED = [("trainable_params", "trainable params"), ("optimizer_state_bytes", "optimizer state after step 1"),
            ("param_dtypes", "parameter dtypes"), ("gradient_checkpointing", "gradient checkpointing"),
            ("attn_implementation", "attention"), ("weights_bytes", "weights (+ reference model)"),
            ("optimizer", "optimizer"), ("input_grad_hooks", "input-embedding forward hooks")]
FLOOR_LABEL = "peak memory floor"
PEAK_LABEL = "peak memory vs floor"

# Differences the comparison expects, by figure: (a test on trl_ext's value, why it differs)
EXPECTED_DIFFERENCES = {
    "gradient_checkpointing": (lambda ours: str(ours).startswith("non-reentrant"), "trl_ext's purpose: "
                               "non-reentrant checkpointing everywhere, trl_ext/engines/gradient_checkpointing.py"),
    "input_grad_hooks": (lambda ours: ours == 0, "trl_ext removes TRL's input-require-grads hook, which non-reentrant "
                         "checkpointing does not need: patch no-input-require-grads"),
}


def size(n_bytes: float | None) -> str:
    """Bytes, written in the unit that suits them (the smoke model's are KiB, the 0.5B model's GiB).

    Args:
        n_bytes: a number of bytes, or None.

    Returns:
        e.g. ``"3.68 GiB"``, ``"412.0 KiB"``, or ``"-"`` for None.
    """
    if n_bytes is None:
        return "-"
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= scale / 10:  # 0.92 GiB, not 942.3 MiB: the 0.5B model's figures in one unit
            return f"{n_bytes / scale:.2f} {unit}" if unit == "GiB" else f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes:.0f} B"


def show(key: str, value) -> str:
    """One figure as the table prints it."""
    if value is None:
        return "-"
    if key.endswith("_bytes"):
        return size(value)
    if key == "trainable_params":
        return f"{value:,}"
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    return str(value)


def memory_floor(figures: dict) -> int:
    """The least memory a training step can hold: weights, a gradient for each trainable parameter, optimizer states.

    Activations, the CUDA context's workspace and the allocator's slack come on top; a measured peak below this is a
    measurement that missed memory the run held.

    Args:
        figures: one run's figures (``weights_bytes``, ``gradient_bytes``, ``optimizer_state_bytes``).

    Returns:
        The floor in bytes.
    """
    return figures["weights_bytes"] + figures["gradient_bytes"] + figures["optimizer_state_bytes"]


def floor_verdict(peak_bytes: float | None, figures: dict) -> dict:
    """Whether a measured peak can be right: it must reach the run's memory floor.

    Args:
        peak_bytes: the run's measured peak (``torch.cuda.max_memory_allocated``), or None where none was measured
            (the CPU smoke run): the floor is then reported, not checked.
        figures: the run's figures (see the module docstring).

    Returns:
        ``{"ok": True | False | None, "floor_bytes": int, "reason": str}``: ``ok`` is None when nothing was checked;
        ``reason`` is one line.
    """
    floor = memory_floor(figures)
    parts = (f"weights {size(figures['weights_bytes'])} + gradients {size(figures['gradient_bytes'])} + optimizer "
             f"states {size(figures['optimizer_state_bytes'])}")
    if peak_bytes is None:
        return {"ok": None, "floor_bytes": floor, "reason": f"floor {size(floor)} ({parts}); not checked: no GPU peak"}
    if peak_bytes < floor:
        return {"ok": False, "floor_bytes": floor,
                "reason": f"peak {size(peak_bytes)} is below its floor {size(floor)} ({parts}): the measurement "
                          "missed memory the run held"}
    return {"ok": True, "floor_bytes": floor, "reason": f"peak {size(peak_bytes)} >= floor {size(floor)} ({parts})"}


def compare(trl: dict, ours: dict) -> list[dict]:
    """TRL's figures against trl_ext's, one entry per compared figure: equal, or the difference named.

    Args:
        trl: TRL's run's figures.
        ours: trl_ext's run's figures.

    Returns:
        ``[{"figure", "trl", "trl_ext", "equal": bool, "expected": bool, "verdict": str}]``: ``verdict`` is "equal",
        or names the difference ("gradient checkpointing: TRL reentrant, trl_ext non-reentrant (why)"); a
        difference with no known reason is marked UNEXPLAINED (the two runs did not train the same thing).
    """
    found = []
    for key, label in COMPARED:
        a, b = trl.get(key), ours.get(key)
        equal = a == b
        test, why = EXPECTED_DIFFERENCES.get(key, (None, None))
        expected = not equal and test is not None and test(b)
        if equal:
            verdict = "equal"
        else:
            verdict = (f"{label}: TRL {show(key, a)}, trl_ext {show(key, b)} "
                       + (f"({why})" if expected else "(UNEXPLAINED: not a difference trl_ext makes on purpose)"))
        found.append({"figure": label, "trl": show(key, a), "trl_ext": show(key, b), "equal": equal,
                      "expected": expected, "verdict": verdict})
    return found


def unexplained(comparison: list[dict]) -> list[str]:
    """The verdicts of ``compare`` that name a difference with no known reason.

    Args:
        comparison: what ``compare`` returned.

    Returns:
        Their verdicts (empty: the two sides trained the same thing, but for the differences named on purpose).
    """
    return [c["verdict"] for c in comparison if not c["equal"] and not c["expected"]]


# --- reading a trainer (needs torch) ---------------------------------------------------------------------------------
def checkpointing_mode(model) -> str:
    """The gradient checkpointing the model's layers will run, read from their checkpoint functions (what
    transformers' ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` installed, with the kwargs
    that TRL, trl_ext or the config passed), not from the config that asked for it.

    Args:
        model: the trained model (a peft model is looked through).

    Returns:
        "off", or e.g. "non-reentrant (24/24 layers)"; "+ offload" when the function saves activations on the host.
    """
    import torch.utils.checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    on = [m for m in layers if m.gradient_checkpointing]
    if not on:
        return "off"
    modes, offload = set(), False
    for layer in on:
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if isinstance(func, functools.partial):
            reentrant = func.keywords.get("use_reentrant")
            offload |= func.func is not torch.utils.checkpoint.checkpoint  # transformers' offloading wrapper
        else:
            reentrant = "unknown"
        modes.add({True: "reentrant", False: "non-reentrant", None: "use_reentrant unset"}.get(reentrant, "unknown"))
    return f"{', '.join(sorted(modes))} ({len(on)}/{len(layers)} layers)" + (" + offload" if offload else "")


def collect(model, optimizer, ref_model=None) -> dict:
    """One run's figures (see the module docstring), read after its first optimizer step.

    Args:
        model: ``trainer.model``.
        optimizer: ``trainer.optimizer`` (accelerate's wrapper is looked through).
        ref_model: ``trainer.ref_model`` when the trainer holds a separate reference model (DPO full), else None.

    Returns:
        The figures, JSON-safe.
    """
    import torch

    params = list(model.parameters())  # each tied parameter once
    trainable = [p for p in params if p.requires_grad]
    seen = {id(p) for p in params}
    ref = [p for p in (ref_model.parameters() if ref_model is not None else []) if id(p) not in seen]
    inner = getattr(optimizer, "optimizer", optimizer)
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    ref_bytes = sum(p.numel() * p.element_size() for p in ref)
    return {
        "trainable_params": sum(p.numel() for p in trainable),
        "weights_bytes": sum(p.numel() * p.element_size() for p in params) + ref_bytes,
        "ref_weights_bytes": ref_bytes,
        "gradient_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "optimizer_state_bytes": state,
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
        "gradient_checkpointing": checkpointing_mode(model),
        "attn_implementation": base.config._attn_implementation,
        "optimizer": f"{type(inner).__name__} (fused={inner.defaults.get('fused')}, "
                     f"foreach={inner.defaults.get('foreach')})",
        "input_grad_hooks": len(base.get_input_embeddings()._forward_hooks),
    }


def main() -> None:
    """Answer one JSON request on stdin (what tests/unit/test_device_figures.py sends) with JSON on stdout:
    ``{"floor": [[peak_bytes, figures], ...], "compare": [[trl, trl_ext], ...]}`` ->
    ``{"floor": [floor_verdict, ...], "compare": [{"rows": compare, "unexplained": [...]}, ...]}``."""
    request = json.load(sys.stdin)
    print(json.dumps({"floor": [floor_verdict(peak, figures) for peak, figures in request.get("floor", [])],
                      "compare": [{"rows": (rows := compare(a, b)), "unexplained": unexplained(rows)}
                                  for a, b in request.get("compare", [])]}))


if __name__ == "__main__":
    main()
