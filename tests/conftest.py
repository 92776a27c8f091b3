import os

import pytest

# Keep the tiny CPU runs quiet and single-threaded per process (2 cores, 2 ranks).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_path():
    from trl_ext.assets import default_model_path

    return default_model_path()
