"""The documentation stays buildable and true: the MkDocs site builds with --strict (links, anchors, nav, API pages
from the docstrings), every repository file and ``trl-ext`` subcommand the README and docs/ name exists, and the README
stays short."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 12_500
TABLE_ROW_MAX_CHARS = 320  # "about 300": a README table row longer than this belongs in docs/ as a list
# Repository files the pages name: recipes and their configs, accelerate configs, benchmarks, tests, the notebook.
# `recipes/X.py` and `accelerate_configs/X.yaml` stand for any file; `trl/accelerate_configs/...` is TRL's.
FILE_PATH = re.compile(r"(?<![\w/.-])((?:recipes|bench|tests)/[\w./-]*?\.py|(?:recipes/configs|accelerate_configs)/"
                       r"[\w.-]+?\.yaml|examples/[\w.-]+\.ipynb)(?![\w-])")
PLACEHOLDER = re.compile(r"/X\.(py|yaml)$")
SUBCOMMAND = re.compile(r"(?<![\w/-])trl-ext ((?:[a-z][\w-]*)(?:\|[a-z][\w-]*)*)")


def pages() -> dict[str, str]:
    found = {"README.md": (REPO / "README.md").read_text()}
    found.update({str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "docs").rglob("*.md"))})
    return found


def test_docs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, not about these pages
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "saving" / "index.html").is_file()


def test_named_files_exist():
    missing = []
    for page, text in pages().items():
        for path in set(FILE_PATH.findall(text)):
            if not PLACEHOLDER.search(path) and not (REPO / path).exists():
                missing.append(f"{page}: {path}")
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(sorted(missing))


def _cli_subcommands() -> set[str]:
    """The subcommands of the console script pyproject.toml declares, from its own --help."""
    pyproject = (REPO / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    target = re.search(r'^trl-ext\s*=\s*"([\w.]+):(\w+)"', scripts, re.M)
    assert target, "pyproject.toml declares no trl-ext console script"
    module, function = target.groups()
    code = f"import sys; sys.argv[0] = 'trl-ext'; from {module} import {function}; sys.exit({function}(['--help']))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    choices = re.search(r"\{([\w,-]+)\}", result.stdout)
    assert choices, result.stdout
    return set(choices.group(1).split(","))


def test_named_subcommands_exist():
    commands = _cli_subcommands()
    assert {"sft", "dpo", "verify", "merge"} <= commands, commands
    unknown = [f"{page}: trl-ext {name}" for page, text in pages().items()
               for named in SUBCOMMAND.findall(text) for name in named.split("|") if name not in commands]
    assert not unknown, f"the docs name subcommands trl-ext does not have ({sorted(commands)}):\n" + "\n".join(unknown)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs both make it for plain headings."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_resolve():
    # The README is read on GitHub and PyPI, outside the MkDocs build: its relative links and their anchors by hand.
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = REPO / path if path else REPO / "README.md"
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"README links that do not resolve: {broken}"


def test_readme_is_short():
    readme = REPO / "README.md"
    size = readme.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move details to docs/"
    long_rows = [line[:80] for line in readme.read_text().splitlines()
                 if line.startswith("|") and len(line) > TABLE_ROW_MAX_CHARS]
    assert not long_rows, f"README table rows longer than {TABLE_ROW_MAX_CHARS} characters: {long_rows}"
