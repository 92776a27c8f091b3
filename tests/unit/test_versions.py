"""The tested version range, declared in pyproject.toml, .ci/oldest.sh and docs/versions.md, is one range."""

import re
from importlib.metadata import version

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.harness import REPO

RANGED = ("trl", "transformers", "accelerate", "peft", "deepspeed")


def _declared() -> dict[str, Requirement]:
    # pyproject's quoted requirements (a regex: tomllib needs Python 3.11, and we support 3.10)
    quoted = re.findall(r'"([a-z_-]+[<>=!][^"]*)"', (REPO / "pyproject.toml").read_text())
    requirements = (Requirement(r) for r in quoted)
    return {r.name: r for r in requirements if r.name in RANGED}


def test_installed_versions_are_in_the_declared_range():
    for name, requirement in _declared().items():
        assert requirement.specifier.contains(version(name)), f"{name} {version(name)} is not in {requirement}"


def test_oldest_combination_is_the_lower_bounds_and_the_docs_say_it():
    pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', (REPO / ".ci" / "oldest.sh").read_text()))
    page = (REPO / "docs" / "versions.md").read_text()
    oldest = next(line for line in page.splitlines() if line.startswith("Oldest:"))
    for name, requirement in _declared().items():
        lower = next(Version(s.version) for s in requirement.specifier if s.operator == ">=")
        assert Version(pins[name]) == lower, f"{name}: .ci/oldest.sh tests {pins[name]}, pyproject says {requirement}"
        assert f"{name} {pins[name]}" in oldest, f"docs/versions.md's Oldest: line lacks {name} {pins[name]}"
        # the table's row: the range pyproject.toml declares, and the oldest version .ci/oldest.sh tests
        row = next((line for line in page.splitlines() if line.startswith(f"| {name} |")), "")
        cells = [cell.strip().strip("`") for cell in row.strip().strip("|").split("|")]
        assert len(cells) == 4, f"docs/versions.md has no table row for {name}"
        assert SpecifierSet(cells[1]) == requirement.specifier, (
            f"docs/versions.md: {name} {cells[1]}; pyproject: {requirement}")
        assert cells[3] == pins[name], f"docs/versions.md: oldest {name} {cells[3]}, .ci/oldest.sh: {pins[name]}"


# transformers' own adapter methods on a transformers model that 5.24 gates behind peft >= 0.22 (MIN_PEFT_VERSION).
GATED_ADAPTER_METHODS = {"add_adapter", "set_adapter", "enable_adapters", "disable_adapters", "active_adapters",
                         "get_adapter_state_dict", "delete_adapter"}


def test_trl_ext_calls_none_of_transformers_gated_adapter_methods():
    """PEFT's PeftModel has methods of these names too (and its LoRA layers an ``active_adapters`` property, which
    trl_ext reads); trl_ext calls none of these methods, on either kind of model."""
    import ast

    calls = []
    for path in (REPO / "trl_ext").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in GATED_ADAPTER_METHODS):
                calls.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.attr}()")
    assert not calls, calls


def test_a_saved_adapter_loads_through_transformers_with_the_installed_peft(tmp_path, tiny_model_path):
    """What the recipes' closing lines print for an adapter: transformers' from_pretrained and pipeline on its
    directory (transformers' load_adapter, which no release in range gates behind a newer peft)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4))
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert getattr(loaded, "_hf_peft_config_loaded", False)
    assert pipeline("text-generation", str(tmp_path))("1+1", max_new_tokens=2, do_sample=False)
