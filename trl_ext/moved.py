"""Import paths of earlier releases that keep working after their modules moved: the files layer left ``saving/``,
and resuming got a room of its own (``from trl_ext.saving.verify import audit`` still works). Registered once, when
``trl_ext`` is imported; each old path forwards attribute lookups to the modules that now hold its names."""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

MOVED = {  # old module -> the modules that hold its names now, searched in order
    "trl_ext.saving.verify": ("trl_ext.files.audit",),
    "trl_ext.saving.written_check": ("trl_ext.files.readback",),
    "trl_ext.saving.commit": ("trl_ext.files.commit", "trl_ext.saving.staged"),
    "trl_ext.saving.resume_check": ("trl_ext.resuming.checks",),
    "trl_ext.saving.hub_format": ("trl_ext.files.hub_names",),
    "trl_ext.saving.shards": ("trl_ext.files.shards",),
    "trl_ext.saving.safetensors_header": ("trl_ext.files.header",),
    "trl_ext.saving.safetensors_reader": ("trl_ext.files.reader",),
}


class _Forwarding(importlib.abc.Loader):
    """Creates the module of an old path: each attribute is looked up in the modules that now hold it."""

    def create_module(self, spec):
        old, new = spec.name, MOVED[spec.name]
        module = types.ModuleType(old, f"Moved to {', '.join(new)}.")

        def __getattr__(name: str):
            for target in new:
                found = importlib.import_module(target)
                if hasattr(found, name):
                    return getattr(found, name)
            raise AttributeError(f"module {old!r} (moved to {', '.join(new)}) has no attribute {name!r}")

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the old paths when they are imported (not before: registering imports nothing)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.machinery.ModuleSpec(fullname, _Forwarding()) if fullname in MOVED else None


def register() -> None:
    """Make every old path in ``MOVED`` importable (``import``, ``from ... import``, attribute access)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
