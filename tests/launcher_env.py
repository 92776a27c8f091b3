"""A clean launcher environment for unit tests that decide how a run launches (tests/unit/test_orchestrators.py,
tests/unit/test_ray.py)."""

import pytest

from tests.harness import REPO
from trl_ext.process import notices


def clean_launcher_env(monkeypatch: pytest.MonkeyPatch, cleared: tuple[str, ...]):
    """Unsets ``cleared``, runs from the repository and lets this process's notices speak (a launch decided in a test
    may silence them).

    Args:
        monkeypatch: the test's ``monkeypatch``; it undoes all of this after the test.
        cleared: the variables to unset.

    Returns:
        ``set_env(**variables)``, which sets more and returns ``monkeypatch``.
    """
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(notices, "_speaks", [True])
    for key in cleared:
        monkeypatch.delenv(key, raising=False)

    def set_env(**variables):
        for key, value in variables.items():
            monkeypatch.setenv(key, value)
        return monkeypatch

    return set_env
