"""The tested version range, declared in pyproject.toml, .ci/oldest.sh and the README, is one range."""

import re
from importlib.metadata import version

from packaging.requirements import Requirement
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


def test_oldest_combination_is_the_lower_bounds_and_the_readme_says_it():
    pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', (REPO / ".ci" / "oldest.sh").read_text()))
    readme = (REPO / "README.md").read_text()
    oldest = next(line for line in readme.splitlines() if line.startswith("Oldest:"))
    for name, requirement in _declared().items():
        lower = next(Version(s.version) for s in requirement.specifier if s.operator == ">=")
        assert Version(pins[name]) == lower, f"{name}: .ci/oldest.sh tests {pins[name]}, pyproject says {requirement}"
        assert f"{name} {pins[name]}" in oldest, f"README's oldest combination does not name {name} {pins[name]}"
