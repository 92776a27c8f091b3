"""The package's rooms and the way imports run between them: down the declared floors only, never back up; the files
layer imports neither saving nor merging; merging imports nothing of the save pipeline; and the tests stand on their own
(nothing under tests/ imports bench/)."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "trl_ext"
# Lowest first: a module may import from its own room and from the rooms before it, never from a later one.
FLOORS = ["patches", "process", "errors", "settings", "assets", "engines", "files", "placement", "data", "saving",
          "merge", "mirror", "resuming", "trainers", "launching", "ray", "cli", "__main__", "__init__"]


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


def _names_an_orchestrators_variable(text) -> bool:
    from trl_ext.placement import orchestrators

    return isinstance(text, str) and bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", text)) and (
        text in orchestrators.VARIABLES or text.startswith(orchestrators.PREFIXES))


def _environ_keys(tree: ast.AST) -> list[tuple[int, ast.expr]]:
    """Every key this code reads from (or sets in) the environment: ``os.environ.get(KEY)``, ``os.environ[KEY]``,
    ``os.getenv(KEY)``, ``KEY in os.environ``, ``os.environ.pop/setdefault(KEY)``."""
    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" or isinstance(node, ast.Name) and \
            node.id == "environ"

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) and (
                (node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value))
                or node.func.attr == "getenv"):
            keys.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            keys.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and \
                any(is_environ(c) for c in node.comparators):
            keys.append((node.lineno, node.left))
    return keys


def _orchestrator_variables_named(source: str, where: str) -> list[str]:
    """Where ``source`` names an orchestrator's variable: as a string (a read, a write, a list of them), or as the key
    of an environment read through a name (``os.environ.get(orchestrators.NODE_ENV)``)."""
    from trl_ext.placement import orchestrators

    tree = ast.parse(source)
    found = [(node.lineno, node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and _names_an_orchestrators_variable(node.value)]
    for line, key in _environ_keys(tree):
        name = key.attr if isinstance(key, ast.Attribute) else key.id if isinstance(key, ast.Name) else None
        if name is not None and _names_an_orchestrators_variable(getattr(orchestrators, name, None)):
            found.append((line, f"{ast.unparse(key)} ({getattr(orchestrators, name)})"))
    return [f"{where}:{line} names {text}" for line, text in sorted(found)]


def test_only_the_orchestrators_reader_names_their_variables():
    """Every orchestrator's variable (``orchestrators.VARIABLES`` and ``PREFIXES``: Slurm's, torchrun's and
    TorchElastic's, Kubeflow's ``PET_*``, JobSet's, LeaderWorkerSet's, SkyPilot's, Ray's job, ``TRL_EXT_RUN_ID``...) is
    named, and so read or set, in ``placement/orchestrators/`` only: everything else asks the ``Job`` it reads. The
    ``TRL_EXT_*`` ones are declared in ``settings/environment.py``, where every such name is listed."""
    reader = PACKAGE / "placement" / "orchestrators"
    declared = PACKAGE / "settings" / "environment.py"
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if reader not in path.parents and path != declared
             for line in _orchestrator_variables_named(path.read_text(), str(path.relative_to(REPO)))]
    assert not found, "\n".join(found)


def test_the_orchestrators_variable_scan_sees_every_kind_of_read():
    source = ('import os\nfrom trl_ext.placement import orchestrators\nrank = os.environ.get("SLURM_NODEID")\n'
              'port = os.environ["MASTER_PORT"]\nnode = os.environ.get(orchestrators.NODE_ENV)\n'
              'here = "RANK" in os.environ\nhome = os.environ.get("HOME")\n')
    found = _orchestrator_variables_named(source, "probe.py")
    assert found == ["probe.py:3 names SLURM_NODEID", "probe.py:4 names MASTER_PORT",
                     "probe.py:5 names orchestrators.NODE_ENV (TRL_EXT_NODE)", "probe.py:6 names RANK"], found


def test_one_name_one_thing_across_the_rooms():
    """No class and no module name is defined twice in the package (``__init__`` and ``__main__`` aside): a reader
    who meets ``Job`` or ``options`` in one room never has to ask which one it is."""
    classes, modules = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(REPO))
        if path.stem not in ("__init__", "__main__"):
            modules.setdefault(path.stem, []).append(where)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(where)
    twice = {name: at for name, at in {**classes, **modules}.items() if len(at) > 1}
    assert not twice, twice


def _starts_or_hooks(path: Path) -> list[str]:
    """What in one file starts a process or hooks into training: a ``__main__`` block, a process that outlives the call
    (``Popen``, an exec, a spawn, multiprocessing), a ``TrainerCallback``. A command that answers a question and ends
    (``subprocess.run(["scontrol", ...])``) starts no process role."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and ast.unparse(node) == "__name__ == '__main__'":
            found.append(f"{path.name}:{node.lineno} is a python -m entry point")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if "multiprocessing" in {str(n).split(".")[0] for n in names}:
                found.append(f"{path.name}:{node.lineno} imports {', '.join(map(str, names))}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith(("exec", "spawn", "fork", "Popen")):
            found.append(f"{path.name}:{node.lineno} calls {ast.unparse(node)}")
        elif isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("TrainerCallback") for b in node.bases):
            found.append(f"{path.name}:{node.lineno} defines a trainer callback")
    return sorted(found, key=lambda hit: int(hit.split(":")[1].split()[0]))


def test_where_am_i_starts_nothing_and_every_process_role_is_in_launching():
    """placement/ answers which job, machine, rank and run this is, and starts nothing; every ``python -m`` entry
    point of a process role is in launching/ (the command line's and ``trl_ext.ray``'s faces, and the asset builders,
    aside)."""
    low = [hit for path in sorted((PACKAGE / "placement").rglob("*.py")) for hit in _starts_or_hooks(path)]
    assert not low, low
    faces = {PACKAGE / "__main__.py", PACKAGE / "cli.py", PACKAGE / "ray" / "__main__.py"}
    entry_points = [str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
                    if path not in faces and "assets" not in path.parts
                    and any("python -m" in hit for hit in _starts_or_hooks(path))]
    assert entry_points and all(p.startswith("launching/") for p in entry_points), entry_points


def test_the_start_and_hook_scan_sees_each_kind():
    probe = REPO / "tests" / "unit" / "_probe_starts.py"
    source = ("import multiprocessing\nimport os\nfrom transformers import TrainerCallback\n"
              "class C(TrainerCallback):\n    pass\nos.execv('x', [])\nif __name__ == '__main__':\n    pass\n")
    probe.write_text(source)
    try:
        assert _starts_or_hooks(probe) == ["_probe_starts.py:1 imports multiprocessing",
                                           "_probe_starts.py:4 defines a trainer callback",
                                           "_probe_starts.py:6 calls os.execv",
                                           "_probe_starts.py:7 is a python -m entry point"]
    finally:
        probe.unlink()


def test_every_trl_ext_variable_is_named_in_one_place():
    """A ``TRL_EXT_*`` setting is named and read in ``settings/environment.py`` only, with its one default; a variable
    that one process hands down to the next is named in its one owner (``environment.HANDED_DOWN``)."""
    from trl_ext.settings import environment

    home = "trl_ext/settings/environment.py"
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"TRL_EXT_[A-Z0-9_]+", node.value):
                allowed = environment.HANDED_DOWN.get(node.value, home)
                if where not in (allowed, home):
                    wrong.append(f"{where}:{node.lineno} names {node.value} (its place: {allowed})")
    assert not wrong, wrong
    names = [s.name for s in environment.SETTINGS] + [n for s in environment.SETTINGS for n in s.former]
    assert len(names) == len(set(names)) and not set(names) & set(environment.HANDED_DOWN)
