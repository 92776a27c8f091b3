"""`--config` handling for the recipes: accelerate configs told apart from recipe configs by content, the re-launch
command, and the configs shipped in accelerate_configs/ and recipes/configs/."""

import sys

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from tests.harness import REPO
from trl_ext.errors import UsageError
from trl_ext.launching import decision, launch

ACCELERATE_CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
ZERO3, DPO_CONFIG = "accelerate_configs/zero3.yaml", "recipes/configs/dpo.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", decision.LAUNCH_ENV):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("argv", [
    ["--config", ZERO3, "--config", DPO_CONFIG, "--max_steps", "3"],
    ["--config", DPO_CONFIG, "--max_steps", "3", f"--config={ZERO3}"],
])
def test_configs_are_told_apart_by_content(argv):
    assert launch.split_configs(argv) == (ZERO3, DPO_CONFIG, ["--max_steps", "3"])


def test_only_a_recipe_config():
    assert launch.split_configs(["--config", DPO_CONFIG]) == (None, DPO_CONFIG, [])


def test_bad_config_files(tmp_path):
    cases = {
        "missing.yaml": (None, "does not exist"),
        "list.yaml": ("- a\n- b\n", "neither a recipe config"),
        "empty.yaml": ("", "neither a recipe config"),
        "broken.yaml": ("a: [1, 2\n", "is not valid YAML"),
    }
    for name, (content, expected) in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(UsageError) as err:
            launch.split_configs(["--config", str(tmp_path / name)])
        assert expected in str(err.value) and str(err.value).count("\n") == 0, str(err.value)
        assert err.value.code != 0


def test_two_configs_of_one_kind_are_refused():
    with pytest.raises(UsageError, match="two accelerate configs"):
        launch.split_configs(["--config", ZERO3, "--config", "accelerate_configs/zero2.yaml"])
    with pytest.raises(UsageError, match="needs a file"):
        launch.split_configs(["--config"])


def test_relaunch_command():
    cmd = launch.relaunch_command(ZERO3, "recipes/dpo.py", ["--config", DPO_CONFIG], num_processes=2)
    assert cmd[:7] == [sys.executable, "-m", "trl_ext.launching.accelerate_run", "--config_file", ZERO3,
                       "--num_processes", "2"]
    assert cmd[7] == "--main_process_port" and int(cmd[8]) > 0  # a free port: an outer launch may hold 29500
    assert cmd[9:] == ["recipes/dpo.py", "--config", DPO_CONFIG]


def test_process_count_follows_the_machine(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launch.default_num_processes() == 2  # no GPU here: 2 CPU processes
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert launch.default_num_processes() == 4


def test_relaunch_loop_is_refused(monkeypatch):
    monkeypatch.setenv(decision.LAUNCH_ENV, "accelerate:1")  # what accelerate's launch hands its ranks
    with pytest.raises(UsageError, match="already re-launched"):
        launch.start("recipes/dpo.py", ["--config", ZERO3])


def test_take_option():
    assert launch.take_option(["--a", "1", "--num_processes", "4", "--b"], "num_processes") == (
        "4", ["--a", "1", "--b"])
    assert launch.take_option(["--num_processes=3"], "num_processes") == ("3", [])


def test_the_default_config_is_inside_the_package_and_equals_the_users_copy():
    # an installed wheel has no accelerate_configs/ beside the package: the default lives in it
    assert launch.DATA_PARALLEL.is_file() and REPO / "trl_ext" in launch.DATA_PARALLEL.parents
    assert launch.DATA_PARALLEL.read_text() == (REPO / "accelerate_configs" / "ddp.yaml").read_text()


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_shipped_accelerate_configs(path):
    assert {p.name for p in ACCELERATE_CONFIGS} == {"ddp.yaml", "zero2.yaml", "zero2_offload.yaml", "zero3.yaml",
                                                    "zero3_offload.yaml", "fsdp2.yaml", "fsdp2_offload.yaml"}
    config = load_config_from_file(str(path))  # accelerate's own reader accepts it
    text = path.read_text()
    assert "accelerate launch recipes/" in text and f"--config accelerate_configs/{path.name}" in text
    assert f"--config_file accelerate_configs/{path.name}" in text  # the header gives both exact commands
    assert config.num_machines == 1 and config.mixed_precision == "no"  # precision: the training config decides
    if path.stem == "ddp":
        assert config.distributed_type == "MULTI_GPU"
        return
    if path.stem.startswith("fsdp2"):
        fsdp = config.fsdp_config
        assert config.distributed_type == "FSDP" and fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_offload_params"] == (path.stem == "fsdp2_offload")
        assert fsdp["fsdp_activation_checkpointing"] is False  # the training config's checkpointing applies
        return
    ds = config.deepspeed_config
    assert config.distributed_type == "DEEPSPEED" and ds["zero_stage"] == int(path.stem[4])
    assert ds["offload_optimizer_device"] == ("cpu" if "offload" in path.stem else "none")
    assert ds["offload_param_device"] == ("cpu" if path.stem == "zero3_offload" else "none")
    if ds["zero_stage"] == 3:
        assert ds["zero3_init_flag"] and ds["zero3_save_16bit_model"]


@pytest.mark.parametrize("path", sorted((REPO / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_recipe_configs_have_only_known_keys(path):
    from trl_ext import DPOConfig, GRPOConfig, ModelConfig, RewardConfig, ScriptArguments, SFTConfig, TrlParser

    config_class = {"sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig,
                    "grpo": GRPOConfig}[path.stem.split("_")[0]]
    parser = TrlParser((ScriptArguments, config_class, ModelConfig))
    assert not launch.is_accelerate_config(yaml.safe_load(path.read_text()))
    parser.parse_args_and_config(["--config", str(path)])  # unknown keys raise; bf16 falls back to fp32 on CPU


def test_the_failure_that_ended_a_launch_is_the_ranks_own_not_torchruns_sigterm_to_the_others():
    from types import SimpleNamespace

    from trl_ext.launching.accelerate_run import _cause

    def failure(code, when):
        return SimpleNamespace(exitcode=code, timestamp=when)

    # rank 1 refused its input; torchrun then ended rank 0 with SIGTERM, in the same (whole) second
    assert _cause({0: failure(-15, 100), 1: failure(1, 100)}) == (1, failure(1, 100))
    # the OOM killer's SIGKILL on rank 1, then torchrun's SIGTERM to rank 0
    assert _cause({0: failure(-15, 100), 1: failure(-9, 100)})[0] == 1
    # two ranks' own errors: the earliest, then the lowest rank
    assert _cause({0: failure(2, 101), 1: failure(1, 100)})[0] == 1
    assert _cause({0: failure(1, 100), 1: failure(1, 100)})[0] == 0


_MACHINE = {"orchestrator": "SkyPilot", "per_rank": False, "nodes": 2}


@pytest.mark.parametrize("job, accelerate, carried, become, started_by", [
    (dict(orchestrator="Ray", per_rank=False), False, None, "RAY_DRIVER", None),
    (dict(orchestrator="torchrun", per_rank=True, world_size=2), True, None, "RANK", None),
    (dict(_MACHINE, node_launched=True), False, None, "MACHINE", None),  # Slurm's sbatch starts the node launcher
    (_MACHINE, True, None, "NODE_LAUNCHER", None),
    (dict(_MACHINE, nodes=1), True, None, "ACCELERATE", None),
    (None, True, None, "ACCELERATE", None),
    (None, False, None, "RANK", None),
    (dict(_MACHINE, node_launched=True), True, "node-launcher:1", "MACHINE", "NODE_LAUNCHER"),
    (dict(orchestrator="SkyPilot", per_rank=True, world_size=4), False, "machine:1", "RANK", "MACHINE"),
    (None, False, "accelerate:1", "RANK", "ACCELERATE"),  # accelerate's one process sets no RANK
    (None, True, "rank:1", "ACCELERATE", None),  # another process's decision to train: this one decides
])
def test_the_launch_is_one_decision_and_what_it_starts_follows_it(monkeypatch, job, accelerate, carried, become,
                                                                  started_by):
    from trl_ext.launching.decision import Become
    from trl_ext.placement.orchestrators import Job

    if carried:
        monkeypatch.setenv(decision.LAUNCH_ENV, carried)
    made = decision.decide(Job(**job) if job else None, accelerate)
    assert (made.become, made.started_by, made.decided_before) == (
        Become[become], Become[started_by] if started_by else None, False)
    decision.decided_here()  # this process trains: its next ask is answered, whatever it would decide
    assert decision.decide(None, accelerate=True) == decision.Decision(Become.RANK, decided_before=True)
