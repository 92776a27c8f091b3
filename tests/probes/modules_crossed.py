"""The trl_ext modules a checkpoint's path runs code in, from ``Trainer._save_checkpoint`` to the committed directory:
on the training thread inside the save and at the waits that belong to it, and on every thread the save starts. A
count, not a timing: the same run gives the same modules (bench/checkpoint_path.py)."""

import sys
import threading

_ROOT = "trl_ext"


class ModulesCrossed:
    """Records the ``trl_ext`` modules whose functions run while ``active`` (the training thread) and on threads
    started meanwhile (the executor's thread, the copies' thread)."""

    def __init__(self):
        self.modules: set[str] = set()
        self.calls: set[tuple[str, str]] = set()  # (module, function)
        self.active = False
        self._lock = threading.Lock()

    def _profile(self, frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name == _ROOT or name.startswith(_ROOT + "."):
                with self._lock:
                    self.modules.add(name)
                    self.calls.add((name, frame.f_code.co_name))

    def _trainer_thread(self, frame, event, arg):
        if self.active:
            self._profile(frame, event, arg)

    def __enter__(self):
        sys.setprofile(self._trainer_thread)
        threading.setprofile(self._profile)  # threads started from now on: everything they run is the save's
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)

    def around(self, owner, name: str):
        """Make ``owner.name`` (a method of the training thread) count while it runs."""
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.active = True
            try:
                return original(*args, **kwargs)
            finally:
                self.active = False

        setattr(owner, name, counted)
