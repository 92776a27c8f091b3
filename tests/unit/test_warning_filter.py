"""The third-party warnings trl_ext filters (process/warning_filter.py): each gone where it is raised, nothing else."""

import dataclasses
import warnings

import pytest
import transformers

import trl_ext
from trl_ext.process import warning_filter

RENAMED = "`gradient_checkpointing` is deprecated"


def _warnings_of(build, *, quiet: bool) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if quiet:
            warning_filter.quiet_known_noise.__wrapped__()  # the cached call installs the filters once per process
        build()
    return [str(w.message) for w in caught]


@pytest.mark.skipif("activation_checkpointing" not in {f.name for f in dataclasses.fields(
    transformers.TrainingArguments)}, reason="transformers < 5.23 has no renamed field, so no warning to filter")
def test_trls_default_gradient_checkpointing_warns_only_without_the_filter(tmp_path, monkeypatch):
    def build():
        trl_ext.DPOConfig(output_dir=str(tmp_path), use_cpu=True)

    assert not any(RENAMED in m for m in _warnings_of(build, quiet=True))
    monkeypatch.setattr(warning_filter, "quiet_known_noise", lambda: None)  # the config's own call, off
    assert any(RENAMED in m for m in _warnings_of(build, quiet=False))  # the warning exists, unfiltered


def test_the_filters_match_only_their_own_source():
    def elsewhere():  # the same text, raised by another module: left as it is
        warnings.warn_explicit(f"{RENAMED} and will be removed in v6.", FutureWarning, "user_code.py", 1,
                               module="user_code")
        warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)  # from this test module

    assert len(_warnings_of(elsewhere, quiet=True)) == 2
