"""The main suite's units of work for pytest-xdist (tests/conftest.py): every module that reads the session's shared
training runs (tests/distributed/conftest.py) is in the shared unit, so that each shared run is made once, on one
worker; and no other module is, so that the workers can share the rest."""

import ast
from pathlib import Path

from tests.conftest import COST_S, EXTRA, GATE_KEEPS, SHARED_RUNS, SHARED_RUNS_MODULES, work_unit

DISTRIBUTED = Path(__file__).parent / "distributed"


def session_fixtures() -> set[str]:
    """The session-scoped fixtures of tests/distributed/conftest.py."""
    tree = ast.parse((DISTRIBUTED / "conftest.py").read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and any(
        isinstance(d, ast.Call) and any(k.arg == "scope" and getattr(k.value, "value", None) == "session"
                                        for k in d.keywords) for d in node.decorator_list)}


def readers(fixtures: set[str]) -> set[str]:
    """The distributed test modules with a test or fixture that takes one of ``fixtures``."""
    found = set()
    for module in DISTRIBUTED.glob("test_*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.FunctionDef) and fixtures & {a.arg for a in node.args.args}:
                found.add(module.stem)
    return found


def test_the_modules_that_read_shared_runs_are_one_unit():
    fixtures = session_fixtures()
    assert {"shared_runs", "zero3_run", "roundtrip"} <= fixtures
    assert readers(fixtures) == SHARED_RUNS_MODULES


def test_each_module_is_one_unit_and_the_shared_ones_one_together():
    assert work_unit("tests/distributed/test_saving.py::test_x[a-b]") == SHARED_RUNS
    assert work_unit("tests/distributed/test_merge.py::test_y") == SHARED_RUNS
    families = "tests/distributed/test_families.py"
    assert work_unit(f"{families}::test_z[llama:sft:lora]") == families
    assert work_unit("tests/unit/test_saving.py::test_x") == "tests/unit/test_saving.py"
    assert max(COST_S, key=COST_S.get) == SHARED_RUNS  # handed out first


def test_every_test_ci_leaves_out_exists():
    """A renamed test drops out of EXTRA silently: each prefix names a module, and a test in it."""
    root = Path(__file__).parent.parent
    for prefix in EXTRA + GATE_KEEPS:
        path, _, name = prefix.partition("::")
        assert (root / path).is_file(), prefix
        tests = {node.name for node in ast.walk(ast.parse((root / path).read_text()))
                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
        assert not name or any(test.startswith(name.split("[")[0]) for test in tests), prefix
