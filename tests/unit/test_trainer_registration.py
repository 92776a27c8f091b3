"""A trainer is one file plus one registration line (``trl_ext/trainers/__init__.py``): a trainer added that way is
seen by everything that names trainers, with nothing else edited; and the registration and the trainer files agree."""

import ast
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import trl_ext
from tests.harness import REPO
from trl_ext import patches, trainers
from trl_ext.data.input_checks import FORMATS
from trl_ext.launching import trl_cli

NEW_TRAINER = '''"""``TinySFTConfig`` and ``TinySFTTrainer``: a trainer added as a developer adds one."""

from dataclasses import dataclass

import trl

from trl_ext.trainers import configs
from trl_ext.trainers.mixin import TrlExtMixin


@dataclass
class TinySFTConfig(configs.HardwareAware, configs.SaveFields, trl.SFTConfig):
    __doc__ = trl.SFTConfig.__doc__


class TinySFTTrainer(TrlExtMixin, trl.SFTTrainer):
    __doc__ = trl.SFTTrainer.__doc__
    _config_class, _default_run_suffix = TinySFTConfig, "TinySFT"
    _dataset_kind = "sft"
'''
REGISTRATION = "    from trl_ext.trainers.tiny_sft import TinySFTConfig, TinySFTTrainer  # noqa: F401\n"

PROBE = '''
import contextlib, io, json, sys
from types import SimpleNamespace

import trl_ext
imported_trl = "trl" in sys.modules  # before any trainer is asked for
from trl_ext import cli, patches, trainers
from trl_ext.launching import scripting, trl_cli

import trl

trainer = trl_ext.TinySFTTrainer
with trl_cli.trl_ext_classes("tinysft"):
    swapped = trl.TinySFTTrainer is trainer and trl.TinySFTConfig is trl_ext.TinySFTConfig
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    cli.main(["--help"])
script_args = SimpleNamespace(dataset_name="trl-ext/arithmetic-sft", dataset_config=None, dataset_train_split="train",
                              dataset_test_split="test")
scripting.check_dataset(script_args, trainers.TinySFTConfig(output_dir=sys.argv[1], eval_strategy="no"),
                        SimpleNamespace(model_name_or_path="trl-ext/tiny-llama"), "tinysft", "sft")
print(json.dumps({
    "file": trl_ext.__file__, "imported_trl": imported_trl, "in_all": "TinySFTTrainer" in trl_ext.__all__,
    "in_dir": {"TinySFTTrainer", "TinySFTConfig"} <= set(dir(trl_ext)), "module": trainer.__module__,
    "config": trainers.TinySFTConfig is trainer._config_class, "command": trl_cli.COMMANDS.get("tinysft"),
    "cli_help": "tinysft" in help_text.getvalue(), "swapped": swapped,
    "kind": trainers.trainer_for("tinysft")._dataset_kind, "trl_class": trainer._trl_class is trl.SFTTrainer,
    "guard": "trl.trainer.sft_trainer.SFTTrainer" in patches.DATASET_PREPARERS,
}))
'''


def _with_new_trainer(root):
    """A copy of the package with one trainer added as a developer adds it: its file, and its registration line."""
    package = root / "trl_ext"
    shutil.copytree(REPO / "trl_ext", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "trainers" / "tiny_sft.py").write_text(NEW_TRAINER)
    registration = package / "trainers" / "__init__.py"
    text = registration.read_text()
    last = "    from trl_ext.trainers.sft import SFTConfig, SFTTrainer  # noqa: F401\n"
    assert last in text  # the registration block's last line
    registration.write_text(text.replace(last, last + REGISTRATION))
    return package


def test_a_trainer_added_by_its_file_and_one_registration_line_is_seen_everywhere(tmp_path):
    package = _with_new_trainer(tmp_path / "src")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "out")], capture_output=True, text=True,
                         cwd=tmp_path / "src", env={**os.environ, "PYTHONPATH": str(tmp_path / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen.pop("file") == str(package / "__init__.py")
    assert seen == {"imported_trl": False,  # `import trl_ext` imports no trainer, the new one included
                    "in_all": True, "in_dir": True, "module": "trl_ext.trainers.tiny_sft", "config": True,
                    "command": "TinySFT", "cli_help": True, "swapped": True,  # trl-ext tinysft, TRL's names mapped
                    "kind": "sft", "trl_class": True,  # the recipes' and the command's dataset check
                    "guard": True}  # the dataset-preparation patch probes its TRL class


def _registration_block() -> ast.If:
    source = (REPO / "trl_ext" / "trainers" / "__init__.py").read_text()
    return next(node for node in ast.parse(source).body
                if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")


def test_the_registration_is_import_lines_only_and_each_file_defines_what_its_line_names():
    block = _registration_block()
    assert all(isinstance(line, ast.ImportFrom) and line.module.startswith("trl_ext.trainers.") for line in block.body)
    assert trainers.MODULES == {alias.name: line.module for line in block.body for alias in line.names}
    for name, module in trainers.MODULES.items():
        assert getattr(importlib.import_module(module), name).__name__ == name, (module, name)
    assert sorted(trl_ext.__all__, key=str.lower) == trl_ext.__all__
    assert set(trainers.__all__) <= set(trl_ext.__all__) and set(trainers.__all__) <= set(dir(trl_ext))


def test_each_registered_trainer_declares_its_config_command_and_dataset_kind():
    assert set(trl_cli.COMMANDS) == {"sft", "dpo", "reward", "kto", "grpo", "rloo"}  # trl-ext's commands, unchanged
    for command, prefix in trl_cli.COMMANDS.items():
        trainer = trainers.trainer_for(command)
        assert trainer is getattr(trl_ext, f"{prefix}Trainer")
        assert trainer._config_class is getattr(trl_ext, f"{prefix}Config")
        assert trainer._trl_class.__name__ == f"{prefix}Trainer"  # TRL's class of the same name, ...
        assert importlib.util.find_spec(f"trl.scripts.{command}") is not None  # ... and TRL's script of the command
        assert trainer._dataset_kind is None or trainer._dataset_kind in FORMATS, command
        trl_class = f"{trainer._trl_class.__module__}.{trainer._trl_class.__qualname__}"
        assert (trl_class in patches.DATASET_PREPARERS) == (trainer._dataset_kind is not None), command
    assert patches.PATCHES["dataset-preparation-refusal"].guard() is True
    kinds = {command: trainers.trainer_for(command)._dataset_kind for command in trl_cli.COMMANDS}
    assert kinds == {"sft": "sft", "dpo": "preference", "reward": "preference", "kto": "unpaired_preference",
                     "grpo": None, "rloo": None}  # what the command's and the recipes' dataset checks take, unchanged
