"""Every change to another library's internals is declared in trl_ext.patches, with its guard, its upstream
reference and when it can go; every guard holds on the installed (tested) versions; a failed guard leaves the
library alone; no other module patches a library directly or reads its private names; and each private read gives what
the library holds, or its public fallback where the release moved it."""

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


def test_no_module_but_patches_changes_a_library_directly():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "patches.py":
            continue
        tree = ast.parse(path.read_text())
        libraries = _library_names(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and _root(target) in libraries:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} assigns {ast.unparse(target)}")
            if isinstance(node, ast.Call):
                call = ast.unparse(node.func)
                if call.startswith(("mock.patch", "patch.object")) or (
                        call == "setattr" and node.args and _root(node.args[0]) in libraries):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} calls {call}")
    assert not found, found


def test_a_recomputed_frozen_weight_goes_to_the_innermost_running_module_that_contains_it(monkeypatch):
    """ZeRO-3's recompute attribution (patch ``recompute-owner``), on a model shaped like a LoRA decoder layer: while
    ``mlp.down_proj.lora_B``'s backward triggers the recompute, a frozen attention weight belongs to the layer and the
    frozen ``down_proj`` weight to ``down_proj``, not to lora_B (DeepSpeed's choice, released before their backward)."""
    if NOT_IN_THIS_RELEASE["recompute-owner"]:
        pytest.skip("DeepSpeed < 0.19.3 has no recompute attribution to fix")
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    from torch import nn

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

    assert patches.keep_recomputed_params_for_their_module(model, coordinator)
    innermost = layer.mlp.down_proj.lora_B  # what DeepSpeed passes: the innermost running backward submodule
    coordinator_module.update_recompute_parameters(innermost, layer.attn.weight)
    coordinator_module.update_recompute_parameters(innermost, layer.mlp.down_proj.weight)
    assert layer.ds_recompute_parameters == {layer.attn.weight}
    assert layer.attn.weight.ds_active_sub_modules == {layer.ds_id}  # released when the layer's backward ends
    assert layer.mlp.down_proj.ds_recompute_parameters == {layer.mlp.down_proj.weight}
    assert innermost.ds_recompute_parameters == set()


# The private names of other libraries that trl_ext reads, each through its helper in patches.py; where one is still
# read elsewhere, the file named owes the change (listed here so that a new one is noticed).
PRIVATE_NAMES = ("_CHECKPOINT_PREFIX", "CheckpointWrapper", "_cdata", "_local_tensor", "_parameters", "_buffers",
                 "_non_persistent_buffers_set", "_from_config", "_original_sigterm_handler", "_actions",
                 "_run_exitfuncs", "_shutdown")
# process/ sits below patches/ (patches imports process): its guard is a getattr of the private name with a default,
# the name declared in a patch's target.
GUARDED_BELOW = {("process/clean_exit.py", "_run_exitfuncs"): "exit-callbacks-now",
                 ("process/clean_exit.py", "_shutdown"): "exit-threads-now"}


def _guarded_getattrs(tree: ast.AST) -> set[int]:
    """The ids of the name constants read as ``getattr(module, "_name", default)``: a guard, with a fallback."""
    return {id(node.args[1]) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and ast.unparse(node.func) == "getattr" and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)}


def test_no_module_but_patches_reads_another_librarys_private_names():
    found, guarded = set(), set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "patches.py":
            continue
        tree = ast.parse(path.read_text())
        guards = _guarded_getattrs(tree)
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else node.value if isinstance(node, ast.Constant) \
                else None
            if name in PRIVATE_NAMES and not (isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self"):
                (guarded if id(node) in guards else found).add((str(path.relative_to(PACKAGE)), name))
        found |= {(str(path.relative_to(PACKAGE)), "algorithms._checkpoint")
                  for line in path.read_text().splitlines() if "algorithms._checkpoint" in line}
    assert not found, sorted(found)
    assert guarded == set(GUARDED_BELOW), sorted(guarded ^ set(GUARDED_BELOW))
    for (where, name), patch in GUARDED_BELOW.items():
        assert where.startswith("process/") and name in patches.PATCHES[patch].target, (where, name, patch)


def test_the_private_reads_give_what_the_library_holds_and_fall_back_where_it_moved(monkeypatch):
    import argparse
    import dataclasses
    import signal
    from types import SimpleNamespace

    import torch

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.ones(2))
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps")
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

    assert patches.storage_key(a.untyped_storage()) == patches.storage_key(a[1:].untyped_storage())
    assert patches.storage_key(a.untyped_storage()) != patches.storage_key(torch.zeros(4).untyped_storage())
    assert patches.own_tensors(module) == ({"weight": module.weight}, {"kept": module.kept})
    assert patches.parser_destinations(parser) == {"help", "max_steps"}
    assert patches.jit_checkpoint_sigterm_handler(jit) is handler
    assert patches.model_from_config(Model, config) == ("_from_config", config)
    assert patches.checkpoint_wrapper_prefix() == "_checkpoint_wrapped_module."
    assert patches.non_reentrant_checkpoint_wrapped(module) == set()

    for name in ("storage-identity", "module-own-tensors", "parser-destinations", "jit-checkpoint-sigterm-handler",
                 "model-from-config", "checkpoint-wrapper"):
        monkeypatch.setitem(patches.PATCHES, name, dataclasses.replace(patches.PATCHES[name], guard=lambda: False))
    patches.applies.cache_clear()
    try:
        assert patches.storage_key(a.untyped_storage()) == a.data_ptr()
        assert patches.own_tensors(module) == ({"weight": module.weight}, {"kept": module.kept,
                                                                           "scratch": module.scratch})
        assert patches.parser_destinations(parser) is None
        assert patches.jit_checkpoint_sigterm_handler(jit) is None
        assert isinstance(patches.model_from_config(Model, config), Model)
        assert patches.checkpoint_wrapper_prefix() is None and patches.non_reentrant_checkpoint_wrapped(module) is None
    finally:
        patches.applies.cache_clear()
