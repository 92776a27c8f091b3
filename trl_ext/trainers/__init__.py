"""The trainers: TRL's classes plus ``TrlExtMixin``, and the configs they take. Each trainer is imported on first use,
with only its own TRL module: ``from trl_ext import DPOTrainer`` imports TRL's DPO trainer, not its GRPO trainer and
vLLM client.

A trainer is one file plus one line in the registration below. The file (``sft.py`` is the shortest) defines
``<Name>Config`` and ``<Name>Trainer``: the trainer subclasses ``TrlExtMixin`` and TRL's trainer (its TRL module and
class follow from that) and states its ``_config_class``, ``_default_run_suffix`` and ``_dataset_kind`` (the rows it
takes, a key of ``input_checks.FORMATS``; None for prompt datasets). Its registration line imports those two names from
the file. Everything else is derived from the registration: ``trl_ext.<Name>Trainer`` and ``dir(trl_ext)``, the command
``trl-ext <name>`` (TRL's ``trl/scripts/<name>.py``, ``<name>`` being ``<Name>`` in lower case), the recipes' and the
command's dataset checks (``trainer_for``), and the guard of the patch that wraps TRL's dataset preparation.
"""

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING

# The registration: one line per trainer file. Type checkers and editors read these imports as they read any; at run
# time nothing is imported here, the block is read as data (``_registered``) and each file is imported on first use
# (``noqa``: the names are this package's public ones, listed in ``__all__`` at run time only).
if TYPE_CHECKING:
    from trl_ext.trainers.dpo import DPOConfig, DPOTrainer  # noqa: F401
    from trl_ext.trainers.kto import KTOConfig, KTOTrainer  # noqa: F401
    from trl_ext.trainers.mixin import TrlExtMixin  # noqa: F401
    from trl_ext.trainers.online import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: F401
    from trl_ext.trainers.reward import RewardConfig, RewardTrainer  # noqa: F401
    from trl_ext.trainers.sft import SFTConfig, SFTTrainer  # noqa: F401


def _registered(source: str) -> dict[str, str]:
    """The names the registration block of ``source`` (a module's text) imports, each with its module.

    Args:
        source: the text of a module with an ``if TYPE_CHECKING:`` block of ``from trl_ext.trainers.<file> import``
            lines.

    Returns:
        ``{name: module}``, the module as it is imported (``trl_ext.trainers.sft``).
    """
    block = next(node for node in ast.parse(source).body
                 if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    return {alias.asname or alias.name: line.module for line in block.body if isinstance(line, ast.ImportFrom)
            for alias in line.names}


MODULES = _registered(Path(__file__).read_text(encoding="utf-8"))  # name -> the module that defines it
if not TYPE_CHECKING:  # type checkers, which read no data, take the registration's names as this package's public ones
    __all__ = sorted(MODULES)


def commands() -> dict[str, str]:
    """The trainers' commands (``trl-ext <command>``, TRL's ``trl/scripts/<command>.py``), without importing them.

    Returns:
        ``{command: prefix}``: each registered ``<Prefix>Trainer`` under its prefix in lower case
        (``{"sft": "SFT", ...}``).
    """
    prefixes = [name.removesuffix("Trainer") for name in MODULES if name.endswith("Trainer")]
    return {prefix.lower(): prefix for prefix in prefixes}


def trainer_for(command: str) -> type:
    """The trainer of a command, imported with its file (and only its TRL module).

    Args:
        command: a key of ``commands()`` (``"sft"``).

    Returns:
        trl_ext's trainer class: ``_trl_class`` is TRL's, ``_dataset_kind`` the rows it takes.
    """
    return __getattr__(f"{commands()[command]}Trainer")


def __getattr__(name: str):
    if name not in MODULES:
        raise AttributeError(f"module 'trl_ext.trainers' has no attribute {name!r}")
    value = getattr(importlib.import_module(MODULES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
