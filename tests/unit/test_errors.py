"""One error module: every exception trl_ext defines lives in trl_ext.errors, keeps the built-in base users catch,
and carries a kind; a problem keeps its kind across ranks (pickled)."""

import ast
import pickle
from pathlib import Path

from trl_ext import errors
from trl_ext.saving.verify import Problem

PACKAGE = Path(errors.__file__).parent


def test_no_exception_class_outside_the_errors_module():
    defined = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(base, "id", getattr(base, "attr", "")).endswith(("Error", "Exception", "Exit"))
                    for base in node.bases):
                defined.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert all(d.startswith("errors.py:") for d in defined), defined


def test_every_error_has_a_kind_and_its_builtin_base():
    bases = {errors.CheckpointError: RuntimeError, errors.MergeError: RuntimeError, errors.AdapterError: ValueError,
             errors.PlanError: ValueError, errors.UnreadableCheckpoint: ValueError, errors.DatasetError: ValueError,
             errors.UsageError: SystemExit}
    kinds = {cls.kind for cls in bases}
    assert len(kinds) == len(bases) and "error" not in kinds
    for cls, base in bases.items():
        assert issubclass(cls, base)
    raised = errors.CheckpointError("saving failed", kind=errors.NONFINITE, detail="1 tensors contain NaN")
    assert (raised.kind, raised.detail) == (errors.NONFINITE, "1 tensors contain NaN")
    assert errors.CheckpointError("x").kind == "checkpoint"


def test_a_problem_keeps_its_kind_and_detail_when_exchanged_between_ranks():
    problem = Problem("the checkpoint failed verification", kind=errors.NONFINITE, detail="w: NaN")
    again = pickle.loads(pickle.dumps(problem))
    assert again == problem and (again.kind, again.detail) == (errors.NONFINITE, "w: NaN")
