"""settings/environment.py: every TRL_EXT_* setting read in one place, with its one default; a bad value is one line
and exit code 1."""

import pytest

from trl_ext.errors import UsageError
from trl_ext.settings import environment


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for setting in environment.SETTINGS:
        for name in (setting.name, *setting.former):
            monkeypatch.delenv(name, raising=False)


def test_unset_or_blank_reads_as_the_default(monkeypatch):
    assert environment.RENDEZVOUS_TIMEOUT.number() == 600.0
    assert environment.RAY_WAIT.number() == 300.0
    assert environment.MAX_FAILURES.whole() == 3
    assert environment.RUN_ID.text() is None and environment.RUN_ID.source() is None
    monkeypatch.setenv("TRL_EXT_RENDEZVOUS_TIMEOUT", "  ")
    assert environment.RENDEZVOUS_TIMEOUT.number() == 600.0


def test_a_set_value_is_read_typed_and_the_new_name_wins_over_a_former_one(monkeypatch):
    monkeypatch.setenv("TRL_EXT_RAY_WAIT_S", "0")
    assert environment.RAY_WAIT.number() == 0.0
    monkeypatch.setenv("TRL_EXT_SLURM_MAX_FAILURES", "5")
    assert environment.MAX_FAILURES.whole() == 5
    assert environment.MAX_FAILURES.source() == ("TRL_EXT_SLURM_MAX_FAILURES", "5")
    monkeypatch.setenv("TRL_EXT_MAX_FAILURES", " 1 ")
    assert environment.MAX_FAILURES.whole() == 1
    assert environment.MAX_FAILURES.source() == ("TRL_EXT_MAX_FAILURES", "1")


@pytest.mark.parametrize("setting, value, read, said", [
    (environment.RENDEZVOUS_TIMEOUT, "ten", lambda s: s.number(),
     "TRL_EXT_RENDEZVOUS_TIMEOUT='ten' is not a number >= 0"),
    (environment.RAY_WAIT, "-1", lambda s: s.number(), "TRL_EXT_RAY_WAIT_S='-1' is not a number >= 0"),
    (environment.MAX_FAILURES, "three", lambda s: s.whole(), "TRL_EXT_MAX_FAILURES='three' is not a whole number >= 0"),
    (environment.MASTER_PORT, "70000", lambda s: s.whole(minimum=1, maximum=65535),
     "TRL_EXT_MASTER_PORT='70000' is not a whole number from 1 to 65535"),
])
def test_a_bad_value_is_one_line_naming_the_variable_and_what_it_sets(monkeypatch, setting, value, read, said):
    monkeypatch.setenv(setting.name, value)
    with pytest.raises(UsageError) as raised:
        read(setting)
    message = str(raised.value)
    assert said in message and f"(it sets {setting.what})." in message and "\n" not in message
    assert raised.value.code == message  # a SystemExit with a message: Python prints it and exits with 1


def test_every_setting_is_in_the_docs():
    """Each setting a user can set is documented with its default."""
    from pathlib import Path

    docs = "\n".join(p.read_text() for p in (Path(__file__).resolve().parents[2] / "docs").rglob("*.md"))
    missing = [s.name for s in environment.SETTINGS if s.name not in docs]
    assert not missing, missing
