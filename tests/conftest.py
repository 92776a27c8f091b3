import gc
import os
from pathlib import Path, PurePosixPath

import pytest

# Keep the tiny CPU runs quiet and single-threaded per process (2 cores, 2 ranks).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    from tests import deepspeed_op

    deepspeed_op.use_own_directory()


def pytest_collection_finish(session):
    # Every Trainer.train() starts with a full gc.collect() (accelerate's free_memory). In a test process that has
    # imported torch, transformers, TRL and every test module, each took about 0.4 s: 29 s of the fast tier's 76
    # trainings (measured 2026-11-27). What exists once collection ends lives to the session's end anyway, so the
    # collector stops walking it; what the tests make is collected as before.
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_model_path():
    from trl_ext.assets import default_model_path

    return default_model_path()


UNIT = Path(__file__).parent / "unit"

# Under pytest-xdist (.ci/test.sh: `pytest -n 2 --dist loadscope --no-loadscope-reorder`) each module is one unit of
# work for the workers, except the modules that read the session's shared training runs (tests/distributed/conftest.py):
# they are one unit together, so that each shared run is made once. The costliest units go first, so that the workers
# end together: seconds measured for the whole unit on the 2-core CI machine (2026-11-26, under the other sessions'
# load; only their order matters). Units not listed follow in file order.
SHARED_RUNS = "tests/distributed (shared runs)"
SHARED_RUNS_MODULES = {"test_background_saves", "test_checkpointing", "test_merge", "test_mirror", "test_options",
                       "test_parallel_writes", "test_preemption", "test_reliability", "test_reward_head",
                       "test_saving", "test_trajectory", "test_zero_training"}
COST_S = {SHARED_RUNS: 1160, "tests/distributed/test_launchers.py": 515,
          "tests/test_recipes.py": 430, "tests/distributed/test_families.py": 425,
          "tests/distributed/test_fsdp2.py": 280, "tests/distributed/test_grpo.py": 230,
          "tests/distributed/test_trl_cli.py": 150, "tests/distributed/test_qlora.py": 140,
          "tests/distributed/test_resume_anywhere.py": 140, "tests/test_readme.py": 120,
          "tests/distributed/test_memory_tier.py": 340,  # an estimate: 240 s here idle (2026-12-03), not yet in CI
          "tests/distributed/test_vlm.py": 100, "tests/distributed/test_user_configs.py": 100,
          "tests/distributed/test_multinode.py": 90, "tests/distributed/test_mirror_exit.py": 110,
          "tests/test_device_check.py": 75,
          "tests/distributed/test_vllm_server.py": 70, "tests/test_formats.py": 65, "tests/test_notebook.py": 55}


def work_unit(nodeid: str) -> str:
    """A test's unit of work: its module's path, or SHARED_RUNS."""
    path = PurePosixPath(nodeid.split("::")[0])
    if path.parent.name == "distributed" and path.stem in SHARED_RUNS_MODULES:
        return SHARED_RUNS
    return str(path)


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler by scope, with ``work_unit`` as the scope. Not ``--dist loadgroup`` with ``xdist_group``
    marks: under pytest 9.2 it silently stops grouping (it renames node ids, which pytest no longer reads:
    pytest-dev/pytest-xdist#1386)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


# CI's gate (.ci/test.sh sets TRL_EXT_TESTS_GATE=1): every fast test, and of the slow ones one proof of each
# capability; the slow tests below, further cases of what a gated test proves, run in the whole suite (`pytest` and the
# legs without the variable: docs/quickstart.md). On 2026-12-02's CI machine (2.6x slower per CPU-second than on
# 2026-11-28) the whole suite did not end within CI's 90 minutes. Node-id prefixes; GATE_KEEPS overrides EXTRA.
GATE = "TRL_EXT_TESTS_GATE"
EXTRA = (
    # other launchers, families, configs and formats: each a launch or more per case
    "tests/distributed/test_launchers.py", "tests/distributed/test_families.py", "tests/distributed/test_trl_cli.py",
    "tests/distributed/test_qlora.py", "tests/distributed/test_resume_anywhere.py", "tests/distributed/test_vlm.py",
    "tests/distributed/test_user_configs.py", "tests/distributed/test_multinode.py", "tests/test_readme.py",
    "tests/distributed/test_mirror_exit.py", "tests/distributed/test_vllm_server.py", "tests/test_formats.py",
    "tests/test_notebook.py", "tests/test_device_check.py",
    # the shared runs' further readers: each brings launches of its own
    "tests/distributed/test_mirror.py", "tests/distributed/test_options.py",
    "tests/distributed/test_parallel_writes.py", "tests/distributed/test_preemption.py",
    "tests/distributed/test_background_saves.py",
    "tests/distributed/test_reliability.py::test_resume_after_a_fault_equals_the_uninterrupted_run",
    "tests/distributed/test_checkpointing.py::test_explicit_reentrant_is_honoured",
    "tests/distributed/test_checkpointing.py::test_same_losses",
    "tests/distributed/test_checkpointing.py::test_non_reentrant_",
    "tests/distributed/test_zero_training.py::test_ddp_on_cpu",
    *(f"tests/distributed/test_trajectory.py::test_same_trajectory_as_one_process[{engine}-"
      for engine in ("one-process-accumulation", "ddp", "zero3-accumulation")),
    "tests/distributed/test_fsdp2.py::test_fsdp2_saves_reload_to_the_trained_outputs",
    "tests/distributed/test_fsdp2.py::test_cpu_ram_efficient_loading",
    "tests/test_recipes.py::test_every_accelerate_config_trains", "tests/test_recipes.py::test_vlm_",
    "tests/distributed/test_memory_tier.py::test_a_rank_killed_on_one_machine_restarts_and_resumes_from_memory[fsdp2]",
    "tests/distributed/test_memory_tier.py::test_a_lost_pod_recreated_on_a_new_node_resumes_from_its_peers_replica[fsdp2]",
    "tests/distributed/test_memory_tier.py::test_elastic_torchrun_left_with_one_machine_resumes_from_memory_alone",
    # the legs': .ci/vllm.sh, .ci/slurm.sh, .ci/ray.sh
    "tests/vllm/test_colocate.py::test_every_family_tied", "tests/vllm/test_colocate.py::test_rloo_",
    "tests/vllm/test_colocate.py::test_a_sync_that_did_not_land", "tests/vllm/test_colocate.py::test_vllm_cpu_reload_",
    "tests/vllm/test_colocate.py::test_under_zero3_every_rank_stops", "tests/vllm/test_colocate.py::test_the_recipe_",
    "tests/slurm/test_mirror.py", "tests/slurm/test_node_loss.py", "tests/slurm/test_time_limit.py",
    "tests/slurm/test_recipes.py::test_a_requeued_job", "tests/slurm/test_recipes.py::test_an_fsdp2_recipe",
    "tests/ray/test_ray.py::test_lost_groups", "tests/ray/test_ray.py::test_a_cluster_too_small",
    "tests/ray/test_ray.py::test_sft_at_a_fixed_size",
)
GATE_KEEPS = (
    # the oldest versions' one fault case (.ci/oldest.sh runs the compat tests)
    "tests/distributed/test_reliability.py::test_resume_after_a_fault_equals_the_uninterrupted_run"
    "[sft-lora-every-rank-killed-mid-training]",
)


def in_gate(item) -> bool:
    """Whether CI's gate runs ``item``: every fast test, and the slow ones not in ``EXTRA``."""
    if not item.get_closest_marker("slow") and not any(item.get_closest_marker(m) for m in ("slurm", "ray", "vllm")):
        return True
    return item.nodeid.startswith(GATE_KEEPS) or not item.nodeid.startswith(EXTRA)


def pytest_collection_modifyitems(config, items):
    # The unit tests are part of the oldest-versions run (.ci/oldest.sh) but those marked newest_only; distributed tests
    # opt in one by one.
    for item in items:
        if UNIT in Path(item.path).parents and not item.get_closest_marker("newest_only"):
            item.add_marker(pytest.mark.compat)
    if os.environ.get(GATE) == "1":
        gated = {id(item): in_gate(item) for item in items}
        if not all(gated.values()):
            config.hook.pytest_deselected(items=[item for item in items if not gated[id(item)]])
            items[:] = [item for item in items if gated[id(item)]]
    if hasattr(config, "workerinput"):  # an xdist worker: the order its scheduler hands out the units
        order = {id(item): i for i, item in enumerate(items)}
        items.sort(key=lambda item: (-COST_S.get(work_unit(item.nodeid), 0), order[id(item)]))


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
