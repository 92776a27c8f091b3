"""One error module: every exception trl_ext defines lives in trl_ext.errors, keeps the built-in base users catch, and
carries a kind; no bare built-in exception is raised anywhere in the package; an error raised on one rank arrives on
every rank with its class, kind and detail (two real gloo processes)."""

import ast
import builtins
import pickle
from pathlib import Path

from tests.harness import forked_ranks
from trl_ext import errors
from trl_ext.files.audit import Problem

PACKAGE = Path(errors.__file__).parent
BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                      if isinstance(obj, type) and issubclass(obj, BaseException)}
# Raises of a built-in that are Python protocols, not errors for a user: a module's __getattr__ says "no such name".
PROTOCOL_RAISES = {("__init__.py", "AttributeError")}  # module __getattr__


def test_no_exception_class_outside_the_errors_module():
    defined = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(base, "id", getattr(base, "attr", "")).endswith(("Error", "Exception", "Exit"))
                    for base in node.bases):
                defined.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert all(d.startswith("errors.py:") for d in defined), defined


def test_no_bare_builtin_exception_is_raised():
    """Every raise names one of errors.py's classes (or re-raises what it caught): a user can catch trl_ext's errors by
    class and code can test their kind."""
    bare = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = getattr(raised, "id", None)
            if name in BUILTIN_EXCEPTIONS and (path.name, name) not in PROTOCOL_RAISES:
                bare.append(f"{path.relative_to(PACKAGE)}:{node.lineno} raises {name}")
    assert not bare, bare


def test_every_error_has_a_kind_and_its_builtin_base():
    bases = {errors.CheckpointError: RuntimeError, errors.ResumeError: (RuntimeError, ValueError),
             errors.MergeError: RuntimeError, errors.AdapterError: ValueError, errors.PlanError: ValueError,
             errors.UnreadableCheckpoint: ValueError, errors.DatasetError: ValueError, errors.ConfigError: ValueError,
             errors.ConfigTypeError: (ValueError, TypeError), errors.SetupError: RuntimeError,
             errors.NotFoundError: FileNotFoundError, errors.ServerError: ConnectionError,
             errors.MirrorError: RuntimeError, errors.UsageError: SystemExit}
    kinds = {cls.kind for cls in bases}
    assert len(kinds) == len(bases) and "error" not in kinds
    for cls, base in bases.items():
        assert issubclass(cls, base)
    raised = errors.CheckpointError("saving failed", kind=errors.NONFINITE, detail="1 tensors contain NaN")
    assert (raised.kind, raised.detail) == (errors.NONFINITE, "1 tensors contain NaN")
    assert errors.CheckpointError("x").kind == "checkpoint"
    assert str(errors.NotFoundError("model path 'x' does not exist")) == "model path 'x' does not exist"


def test_a_problem_keeps_its_kind_and_detail_when_exchanged_between_ranks():
    problem = Problem("the checkpoint failed verification", kind=errors.NONFINITE, detail="w: NaN")
    again = pickle.loads(pickle.dumps(problem))
    assert again == problem and (again.kind, again.detail) == (errors.NONFINITE, "w: NaN")
    error = pickle.loads(pickle.dumps(errors.ResumeError("cannot resume", kind="batch", detail="4 % 3")))
    assert type(error) is errors.ResumeError and (str(error), error.kind, error.detail) == (
        "cannot resume", "batch", "4 % 3")


def test_several_ranks_failures_become_one_error_of_the_deciding_kind():
    plain = errors.CheckpointError("saving failed: disk full", kind="save")
    diverged = errors.CheckpointError("saving failed: NaN", kind=errors.NONFINITE, detail="w: NaN")
    one = errors.combined([plain, diverged], prefer=(errors.NONFINITE,))
    assert type(one) is errors.CheckpointError and (one.kind, one.detail) == (errors.NONFINITE, "w: NaN")
    assert str(one) == "saving failed: disk full\nsaving failed: NaN"
    assert errors.combined([plain, plain]) is plain


def _agree_on_rank(rank: int, store: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mine = errors.ResumeError("rank 1 cannot read its checkpoint", kind="missing", detail="rank 1") if rank \
            else None
        errors.agree(mine)
        results.put((rank, None))
    except errors.TrlExtError as exc:
        results.put((rank, (type(exc).__name__, str(exc), exc.kind, exc.detail)))
    finally:
        dist.destroy_process_group()


def test_an_error_raised_on_one_rank_arrives_with_its_class_on_every_rank(tmp_path):
    got = dict(forked_ranks(_agree_on_rank, lambda rank, results: (rank, str(tmp_path / "store"), results)))
    expected = ("ResumeError", "rank 1 cannot read its checkpoint", "missing", "rank 1")
    assert got == {0: expected, 1: expected}
