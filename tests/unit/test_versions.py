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
