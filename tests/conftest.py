import os
from pathlib import Path

import pytest

# Keep the tiny CPU runs quiet and single-threaded per process (2 cores, 2 ranks).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    from tests import deepspeed_op

    deepspeed_op.use_own_directory()


@pytest.fixture(scope="session")
def tiny_model_path():
    from trl_ext.assets import default_model_path

    return default_model_path()


UNIT = Path(__file__).parent / "unit"


def pytest_collection_modifyitems(items):
    # The unit tests are all part of the oldest-versions run (.ci/oldest.sh); distributed tests opt in one by one.
    for item in items:
        if UNIT in Path(item.path).parents:
            item.add_marker(pytest.mark.compat)


@pytest.fixture(autouse=True)
def _each_test_checks_its_datasets(monkeypatch):
    """A dataset check that passed in one test is not remembered in the next (trl_ext remembers them for a run)."""
    from trl_ext.data import input_checks

    monkeypatch.delenv(input_checks.CHECKED_ENV, raising=False)


@pytest.fixture(autouse=True)
def _each_test_leaves_the_environment_as_it_found_it():
    """What trl_ext sets in a process's environment for its run (ACCELERATE_USE_CPU in a simulated multi-process
    launch, say) is undone after each test: launches made by later tests inherit this process's environment, and
    ACCELERATE_USE_CPU made a later DeepSpeed launch run DDP instead."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
