"""settings/trainer_options.py: trl_ext's config options, each default defined once and read through its group."""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import trl

import trl_ext
from trl_ext.settings import trainer_options
from trl_ext.settings.trainer_options import (
    GROUPS,
    NAMES,
    MirrorOptions,
    SaveOptions,
    VLLMServerOptions,
    VLLMSyncCheckOptions,
)

PACKAGE = Path(trl_ext.__file__).parent
HOME = Path(trainer_options.__file__)
CONFIGS = {trl_ext.SFTConfig: (SaveOptions, MirrorOptions), trl_ext.RewardConfig: (SaveOptions, MirrorOptions),
           trl_ext.DPOConfig: (SaveOptions, MirrorOptions), trl_ext.KTOConfig: (SaveOptions, MirrorOptions),
           trl_ext.GRPOConfig: GROUPS, trl_ext.RLOOConfig: GROUPS}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != HOME:
            yield path, ast.parse(path.read_text(), filename=str(path))


def test_no_option_is_read_with_a_default_of_its_own_outside_its_group():
    """``getattr(args, "<option>", default)`` elsewhere would be a second default (and a second place to change)."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in NAMES):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} getattr(..., {node.args[1].value!r})")
    assert not found, found


def test_no_option_is_declared_as_a_field_outside_its_group():
    """A config or class that declared ``max_shard_size: str = "50GB"`` again would define its default twice."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found += [f"{path.relative_to(PACKAGE)}:{item.lineno} {node.name}.{item.target.id}"
                          for item in node.body if isinstance(item, ast.AnnAssign)
                          and isinstance(item.target, ast.Name) and item.target.id in NAMES]
    assert not found, found


@pytest.mark.parametrize("config", list(CONFIGS), ids=lambda c: c.__name__)
def test_every_config_takes_its_groups_fields_names_defaults_and_help(config):
    fields = {f.name: f for f in dataclasses.fields(config)}
    for group in CONFIGS[config]:
        for option in dataclasses.fields(group):
            got = fields[option.name]
            assert (got.default, got.metadata["help"]) == (option.default, option.metadata["help"]), option.name
    assert {f for f in fields if f in NAMES} == {f.name for g in CONFIGS[config] for f in dataclasses.fields(g)}


def test_a_plain_trl_config_reads_as_the_defaults_and_a_trl_ext_one_as_set(tmp_path):
    plain = trl.DPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False)
    assert SaveOptions.of(plain) == SaveOptions() and MirrorOptions.of(plain) == MirrorOptions()
    assert VLLMServerOptions.of(None) == VLLMServerOptions()
    ours = trl_ext.GRPOConfig(output_dir=str(tmp_path), report_to="none", max_shard_size="1GB",
                              mirror_grace_period=5.0, vllm_check_sync_every=3)
    assert SaveOptions.of(ours).max_shard_size == "1GB" and MirrorOptions.of(ours).mirror_grace_period == 5.0
    assert VLLMSyncCheckOptions.of(ours) == VLLMSyncCheckOptions(vllm_check_sync_every=3)
    ours.save_in_background = True  # an edit after the config is built (before train()) counts where it is read
    assert SaveOptions.of(ours).save_in_background


def test_the_components_defaults_are_the_groups():
    """Constructors that default an option's value take it from its group, not a number of their own."""
    from trl_ext.mirror.uploader import Uploader
    from trl_ext.saving import DEFAULT_MAX_SHARD_SIZE
    from trl_ext.trainers.vllm_server import BoundedVLLMClient
    from trl_ext.trainers.weight_sync import BoundedVLLMGeneration

    def defaults(fn):
        return {name: p.default for name, p in inspect.signature(fn).parameters.items()}

    assert DEFAULT_MAX_SHARD_SIZE == SaveOptions().max_shard_size
    assert defaults(Uploader)["exit_grace"] == MirrorOptions().mirror_exit_grace_period
    assert defaults(Uploader)["signal_grace"] == MirrorOptions().mirror_grace_period
    assert defaults(BoundedVLLMClient)["request_timeout"] == VLLMServerOptions().vllm_request_timeout
    sync = defaults(BoundedVLLMGeneration)
    assert (sync["request_timeout"], sync["check_every"], sync["check_atol"]) == (
        VLLMServerOptions().vllm_request_timeout, VLLMSyncCheckOptions().vllm_check_sync_every,
        VLLMSyncCheckOptions().vllm_check_sync_atol)
