"""The package's rooms and the way imports run between them: down the declared floors only, never back up; the files
layer imports neither saving nor merging; merging imports nothing of the save pipeline; and the tests stand on their own
(nothing under tests/ imports bench/)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "trl_ext"
# Lowest first: a module may import from its own room and from the rooms before it, never from a later one.
FLOORS = ["process", "errors", "patches", "assets", "engines", "files", "scheduling", "data", "saving", "merge",
          "mirror", "resuming", "trainers", "launching", "ray", "cli", "__main__", "__init__"]


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """The trl_ext modules a file imports, at any depth of the file (imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            base = node.module
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m == "trl_ext" or m.startswith("trl_ext.")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _edges() -> list[tuple[str, str]]:
    edges = []
    for path in PACKAGE.rglob("*.py"):
        source = _module_name(path)
        for target in _imports(path):
            if target != "trl_ext":
                edges.append((source, target))
    return edges


def test_imports_run_down_the_floors_only():
    up = []
    for source, target in _edges():
        src, dst = _room(source), _room(target)
        if src != dst and FLOORS.index(dst) > FLOORS.index(src):
            up.append(f"{source} imports {target} ({src} is below {dst})")
    assert not up, "\n".join(sorted(up))


def test_the_files_layer_imports_neither_saving_nor_merging_and_merging_no_save_pipeline():
    wrong = [f"{s} imports {t}" for s, t in _edges()
             if (_room(s) == "files" and _room(t) in ("saving", "merge"))
             or (_room(s) == "merge" and _room(t) == "saving")]
    assert not wrong, wrong


def test_nothing_under_tests_imports_bench():
    bench = {p.stem for p in (REPO / "bench").glob("*.py")} | {"bench"}
    found = []
    for path in (REPO / "tests").rglob("*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in bench and not (REPO / "tests" / "scripts" / f"{n}.py").exists()]
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("sys.path.insert", "syspath_prepend")) \
                    and "bench" in ast.unparse(node):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} puts bench/ on sys.path")
    assert not found, found
