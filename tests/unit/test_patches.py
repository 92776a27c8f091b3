"""Every change to another library's internals is declared in trl_ext.patches, with its guard, its upstream
reference and when it can go; every guard holds on the installed (tested) versions; a failed guard leaves the
library alone; patches.py holds the declarations and the guards only, and imports nothing of trl_ext; every module
that patches a library directly or reads its private names does so in a function that asks that patch's guard; and
each private read gives what the library holds, or its public fallback where the release moved it."""

import ast
from pathlib import Path

import deepspeed
import pytest
from packaging.version import Version

from trl_ext import patches

PACKAGE = Path(patches.__file__).parent
LIBRARIES = {"trl", "transformers", "accelerate", "peft", "deepspeed", "torch", "bitsandbytes", "safetensors",
             "datasets", "tokenizers"}
# Patches of something an older release in the supported range does not have yet, so there is nothing to fix there:
# DeepSpeed < 0.19.3 has no non-reentrant recompute of ZeRO-3 parameters (trl_ext checkpoints reentrant with it).
NOT_IN_THIS_RELEASE = {"recompute-owner": Version(deepspeed.__version__) < Version("0.19.3")}
# Patches of vLLM's internals: vLLM lives in the vLLM leg's venv (.ci/vllm.sh), whose tests check these guards.
VLLM_PATCHES = {name for name, patch in patches.PATCHES.items() if patch.target.startswith("vllm.")}


@pytest.mark.parametrize("name", sorted(patches.PATCHES))
def test_each_patch_is_declared_and_its_guard_holds_on_the_installed_versions(name):
    patch = patches.PATCHES[name]
    assert patch.target and patch.why and patch.upstream and patch.remove_when
    if NOT_IN_THIS_RELEASE.get(name):
        pytest.skip(f"{patch.target} does not exist in this release: nothing to fix")
    if name in VLLM_PATCHES:
        pytest.importorskip("vllm", reason="vLLM's patches are checked in the vLLM leg (.ci/vllm.sh)")
    assert patch.guard() is True, f"{name}: {patch.target} is not what the patch expects in the installed release"
    print(f"{name}: {patch.target} | upstream: {patch.upstream} | remove when: {patch.remove_when}")


def test_a_failed_guard_leaves_the_library_alone(monkeypatch, caplog):
    class Owner:
        attribute = "original"

    monkeypatch.setitem(patches.PATCHES, "moved", patches.Patch("lib.Owner.attribute", "why", "lib#1", "never",
                                                               guard=lambda: False))
    with caplog.at_level("WARNING", logger="trl_ext"), patches.swapped("moved", Owner, "attribute", "patched"):
        assert Owner.attribute == "original"
    assert not patches.setting("moved", Owner, "attribute", "patched") and Owner.attribute == "original"
    assert "skipping the 'moved' fix" in caplog.text
    patches.applies.cache_clear()


def test_swapped_restores_an_instance_to_its_class_attribute():
    class Owner:
        def method(self):
            return "class"

    owner = Owner()
    with patches.swapped("partial-checkpoint-dir", owner, "method", lambda: "patched"):
        assert owner.method() == "patched"
    assert owner.method() == "class" and "method" not in vars(owner)


def _library_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in LIBRARIES}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in LIBRARIES:
            names |= {a.asname or a.name for a in node.names}
    return names | {"trl_module"}  # a TRL trainer's module, passed in


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _units(tree: ast.Module) -> list[ast.AST]:
    """A module's top-level functions and its classes' methods, each with the functions inside it; and each other
    top-level statement (code that runs on import)."""
    units = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            units += node.body
        else:
            units.append(node)
    return units


def _patches_asked(unit: ast.AST) -> set[str]:
    """The patches a function asks the registry about: ``patches.applies/swapped/setting("<name>", ...)``."""
    return {node.args[0].value for node in ast.walk(unit) if isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("patches.applies", "patches.swapped", "patches.setting")
            and node.args and isinstance(node.args[0], ast.Constant)}


def _direct_changes(unit: ast.AST, libraries: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(unit):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else []
        found += [(node.lineno, f"assigns {ast.unparse(target)}") for target in targets
                  if isinstance(target, ast.Attribute) and _root(target) in libraries]
        if isinstance(node, ast.Call):
            call = ast.unparse(node.func)
            if call.startswith(("mock.patch", "patch.object")) or (
                    call == "setattr" and node.args and _root(node.args[0]) in libraries):
                found.append((node.lineno, f"calls {call}"))
    return found


def test_every_direct_change_to_a_library_asks_its_patchs_guard():
    """A fix lives beside its caller, in a function that asks the registry (``patches.applies``, ``swapped`` or
    ``setting``) about a declared patch: none is applied unguarded, on import, or reimplemented with a probe of its
    own."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "patches.py":
            continue
        tree = ast.parse(path.read_text())
        libraries = _library_names(tree)
        for unit in _units(tree):
            asked = _patches_asked(unit)
            assert asked <= set(patches.PATCHES), (path, asked - set(patches.PATCHES))
            if not asked:
                found += [f"{path.relative_to(PACKAGE)}:{line} {what}" for line, what in _direct_changes(unit,
                                                                                                        libraries)]
    assert not found, found


def test_patches_holds_declarations_and_guards_only():
    """patches.py defines the registry (``Patch``, ``PATCHES``, ``applies``, ``swapped``, ``setting``, its logger)
    and the guards' probe helpers and inputs (``DATASET_PREPARERS``, handed down by each trainer's class), nothing
    else: a fix's body lives beside its caller. It imports nothing of trl_ext, so that every room can use it."""
    tree = ast.parse(Path(patches.__file__).read_text())
    registry = {"Patch", "PATCHES", "applies", "swapped", "setting", "logger"}
    guard_helpers = {"_version", "_resolve", "_has", "_source_has", "_all", "DATASET_PREPARERS"}
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            defined |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                        if isinstance(t, ast.Name)}
    assert defined == registry | guard_helpers, sorted(defined ^ (registry | guard_helpers))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.split(".")[0] == "trl_ext"}, imported


def test_a_recomputed_frozen_weight_goes_to_the_innermost_running_module_that_contains_it(monkeypatch):
    """ZeRO-3's recompute attribution (patch ``recompute-owner``), on a model shaped like a LoRA decoder layer: while
    ``mlp.down_proj.lora_B``'s backward triggers the recompute, a frozen attention weight belongs to the layer and the
    frozen ``down_proj`` weight to ``down_proj``, not to lora_B (DeepSpeed's choice, released before their backward)."""
    if NOT_IN_THIS_RELEASE["recompute-owner"]:
        pytest.skip("DeepSpeed < 0.19.3 has no recompute attribution to fix")
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    from torch import nn

    from trl_ext.engines import gradient_checkpointing

    monkeypatch.setattr(coordinator_module, "update_recompute_parameters",
                        coordinator_module.update_recompute_parameters)  # restored after the test
    monkeypatch.setattr(coordinator_module, "print_rank_0", lambda *a, **k: None)  # needs a process group
    layer = nn.Module()
    layer.attn = nn.Linear(2, 2)
    layer.mlp = nn.Module()
    layer.mlp.down_proj = nn.Linear(2, 2)
    layer.mlp.down_proj.lora_B = nn.Linear(2, 2)
    model = nn.Sequential(layer)
    for ds_id, module in enumerate(model.modules()):
        module.ds_id, module.ds_recompute_parameters = ds_id, set()
    for ds_id, param in enumerate(model.parameters()):
        param.requires_grad_(False)
        param.ds_id, param.ds_active_sub_modules = ds_id, set()
    running = [model, layer, layer.mlp, layer.mlp.down_proj, layer.mlp.down_proj.lora_B]
    coordinator = type("Coordinator", (), {})()
    coordinator._PartitionedParameterCoordinator__active_backward_submodules = {m.ds_id: m for m in running}

    assert gradient_checkpointing.keep_recomputed_params_for_their_module(model, coordinator)
    innermost = layer.mlp.down_proj.lora_B  # what DeepSpeed passes: the innermost running backward submodule
    coordinator_module.update_recompute_parameters(innermost, layer.attn.weight)
    coordinator_module.update_recompute_parameters(innermost, layer.mlp.down_proj.weight)
    assert layer.ds_recompute_parameters == {layer.attn.weight}
    assert layer.attn.weight.ds_active_sub_modules == {layer.ds_id}  # released when the layer's backward ends
    assert layer.mlp.down_proj.ds_recompute_parameters == {layer.mlp.down_proj.weight}
    assert innermost.ds_recompute_parameters == set()


# The private names of other libraries that trl_ext reads, each declared in a patch's target and read in a function
# that asks that patch's guard (listed here so that a new one is noticed).
PRIVATE_NAMES = ("_CHECKPOINT_PREFIX", "CheckpointWrapper", "_cdata", "_local_tensor", "_parameters", "_buffers",
                 "_non_persistent_buffers_set", "_from_config", "_original_sigterm_handler", "_actions",
                 "_run_exitfuncs", "_shutdown", "_register_atexit", "algorithms._checkpoint")


def _private_reads(unit: ast.AST) -> set[tuple[int, str]]:
    found = set()
    for node in ast.walk(unit):
        if isinstance(node, ast.ImportFrom) and node.module and any(
                part.startswith("_") for part in node.module.split(".")):  # a library's private module
            found.add((node.lineno, node.module))
        name = node.attr if isinstance(node, ast.Attribute) else node.value if isinstance(node, ast.Constant) \
            else None
        if name in PRIVATE_NAMES and not (isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self"):
            found.add((node.lineno, name))
    return found


def test_every_private_read_asks_the_guard_of_the_patch_that_declares_it():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "patches.py":
            continue
        for unit in _units(ast.parse(path.read_text())):
            targets = " ".join(patches.PATCHES[name].target for name in _patches_asked(unit) if name in patches.PATCHES)
            found += [f"{path.relative_to(PACKAGE)}:{line} reads {name}" for line, name in _private_reads(unit)
                      if name not in targets]
    assert not found, sorted(found)


def test_the_private_reads_give_what_the_library_holds_and_fall_back_where_it_moved(monkeypatch):
    import argparse
    import dataclasses
    import signal
    from types import SimpleNamespace

    import torch

    from trl_ext.engines.gradient_checkpointing import non_reentrant_checkpoint_wrapped
    from trl_ext.engines.sharded import own_tensors
    from trl_ext.files.audit import model_from_config
    from trl_ext.launching.scripting import _unknown_arguments_message
    from trl_ext.saving.save_plan import checkpoint_wrapper_prefix
    from trl_ext.saving.snapshot import storage_key
    from trl_ext.trainers.preemption import jit_checkpoint_sigterm_handler

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.ones(2))
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps")
    unknown = "unrecognized arguments: '--max_step'"
    handler = signal.getsignal(signal.SIGTERM)
    jit = SimpleNamespace(jit_manager=SimpleNamespace(_original_sigterm_handler=handler))
    a = torch.zeros(4)
    config = SimpleNamespace()

    class Model:
        @classmethod
        def _from_config(cls, config):
            return ("_from_config", config)

        def __init__(self, config):
            self.config = config

    assert storage_key(a.untyped_storage()) == storage_key(a[1:].untyped_storage())
    assert storage_key(a.untyped_storage()) != storage_key(torch.zeros(4).untyped_storage())
    assert own_tensors(module) == ({"weight": module.weight}, {"kept": module.kept})
    assert "max_step (did you mean max_steps?)" in _unknown_arguments_message(parser, unknown, "")
    assert jit_checkpoint_sigterm_handler(jit) is handler
    assert model_from_config(Model, config) == ("_from_config", config)
    assert checkpoint_wrapper_prefix() == "_checkpoint_wrapped_module."
    assert non_reentrant_checkpoint_wrapped(module) == set()

    for name in ("storage-identity", "module-own-tensors", "parser-destinations", "jit-checkpoint-sigterm-handler",
                 "model-from-config", "checkpoint-wrapper"):
        monkeypatch.setitem(patches.PATCHES, name, dataclasses.replace(patches.PATCHES[name], guard=lambda: False))
    patches.applies.cache_clear()
    try:
        assert storage_key(a.untyped_storage()) == a.data_ptr()
        assert own_tensors(module) == ({"weight": module.weight}, {"kept": module.kept, "scratch": module.scratch})
        assert "did you mean" not in _unknown_arguments_message(parser, unknown, "")
        assert jit_checkpoint_sigterm_handler(jit) is None
        assert isinstance(model_from_config(Model, config), Model)
        assert checkpoint_wrapper_prefix() is None and non_reentrant_checkpoint_wrapped(module) is None
    finally:
        patches.applies.cache_clear()


def test_a_failed_guards_notice_is_said_by_the_process_that_says_notices(monkeypatch, caplog):
    """The registry logs its notice itself (it imports nothing of trl_ext); ``process.notices`` keeps it to the one
    process that says notices, once per process."""
    from trl_ext.process import notices

    monkeypatch.setitem(patches.PATCHES, "moved", patches.Patch("lib.Owner.attribute", "why", "lib#1", "never",
                                                               guard=lambda: False))
    try:
        with caplog.at_level("WARNING", logger="trl_ext"):
            monkeypatch.setattr(notices, "_speaks", [False])
            assert not patches.applies("moved")
            assert "skipping the 'moved' fix" not in caplog.text
            patches.applies.cache_clear()
            monkeypatch.setattr(notices, "_speaks", [True])
            assert not patches.applies("moved") and not patches.applies("moved")
        assert caplog.text.count("[trl_ext] lib.Owner.attribute is not what trl_ext expects") == 1
    finally:
        patches.applies.cache_clear()
