import pytest
import trl

import trl_ext
from trl_ext.engines import runtime


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(runtime, "is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setattr(runtime, "has_accelerator", lambda: False)


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(runtime, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(runtime, "has_accelerator", lambda: True)


def _fields(**kw):
    base = dict(use_cpu=False, bf16=None, bf16_full_eval=False, fp16=False, fp16_full_eval=False, ddp_backend=None,
                deepspeed=None)
    return type("Args", (), {**base, **kw})()


def test_trl_default_bf16_falls_back_to_fp32_on_cpu(cpu_only, caplog):
    args = _fields()
    runtime.adapt_to_hardware(args)
    assert args.bf16 is False
    assert "training in fp32" in caplog.text


def test_fp16_falls_back_without_gpu(cpu_only, caplog):
    args = _fields(bf16=False, fp16=True)
    runtime.adapt_to_hardware(args)
    assert (args.fp16, args.bf16) == (False, False)
    assert "fp16 is not supported on this hardware (no GPU): training in fp32" in caplog.text


def test_gloo_only_for_multi_process_cpu_launch(cpu_only, monkeypatch):
    args = _fields(bf16=False)
    runtime.adapt_to_hardware(args)
    assert args.ddp_backend is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    runtime.adapt_to_hardware(args)
    assert args.ddp_backend == "gloo"
    chosen = _fields(bf16=False, ddp_backend="mpi")
    runtime.adapt_to_hardware(chosen)
    assert chosen.ddp_backend == "mpi"  # an explicit choice is kept


def test_cpu_ddp_is_accelerate_cpu_mode_but_deepspeed_is_left_alone(cpu_only, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # accelerate launch with a DeepSpeed config
    runtime.adapt_to_hardware(_fields(bf16=False))
    assert "ACCELERATE_USE_CPU" not in runtime.os.environ  # transformers would skip DeepSpeed with it set
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    runtime.adapt_to_hardware(_fields(bf16=False))  # DDP: without CPU mode each rank would train alone
    assert runtime.os.environ["ACCELERATE_USE_CPU"] == "true"


def test_nothing_changes_on_a_gpu_machine(gpu, monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = _fields(bf16=True)
    runtime.adapt_to_hardware(args)
    assert (args.bf16, args.fp16, args.ddp_backend) == (True, False, None)
    assert caplog.text == ""


def test_configs_are_trl_configs_plus_the_save_options_and_build_on_cpu(tmp_path):
    for ours, theirs in [(trl_ext.SFTConfig, trl.SFTConfig), (trl_ext.RewardConfig, trl.RewardConfig),
                         (trl_ext.DPOConfig, trl.DPOConfig)]:
        cfg = ours(output_dir=str(tmp_path))  # TRL's own default (bf16) raises on CPU
        assert isinstance(cfg, theirs)
        added = ["max_shard_size", "save_in_background", "save_on_preemption", "memory_checkpoint_steps",
                 "checkpoint_mirror",
                 "mirror_storage_options", "mirror_grace_period", "mirror_exit_grace_period"]
        assert [f.name for f in theirs.__dataclass_fields__.values()] + added == [
            f.name for f in ours.__dataclass_fields__.values()]
        assert cfg.max_shard_size == "50GB"  # transformers' save_pretrained default
        assert cfg.save_on_preemption is True and cfg.save_in_background is False


def test_single_training_process_in_a_multi_process_launch_is_refused(monkeypatch):
    from transformers.training_args import ParallelMode

    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = type("Args", (), {"world_size": 1, "parallel_mode": ParallelMode.NOT_PARALLEL})()
    with pytest.raises(RuntimeError, match="ddp_backend='gloo'"):
        runtime.check_distributed_setup(alone)
    # world size 2 but no data parallelism (DDP on CPU without accelerate's CPU mode): each rank trains alone too
    unsynced = type("Args", (), {"world_size": 2, "parallel_mode": ParallelMode.NOT_PARALLEL})()
    with pytest.raises(RuntimeError, match="world size 2, parallel mode not_parallel"):
        runtime.check_distributed_setup(unsynced)
    runtime.check_distributed_setup(type("Args", (), {"world_size": 2, "parallel_mode": ParallelMode.DISTRIBUTED})())


# --- precision from every source agrees with the fp32 fallback (accelerate config, DeepSpeed config, arguments) -----

DS_BF16 = {"bf16": {"enabled": True}, "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}
DS_FP16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}, "zero_optimization": {"stage": 2}}


def test_launcher_and_deepspeed_precision_follow_the_cpu_fallback(cpu_only, monkeypatch, caplog):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = _fields(deepspeed=DS_BF16)
    runtime.adapt_to_hardware(args)
    assert args.bf16 is False and runtime.os.environ["ACCELERATE_MIXED_PRECISION"] == "no"
    assert args.deepspeed["bf16"] == {"enabled": False} and args.deepspeed["fp16"] == {"enabled": "auto"}
    assert DS_BF16["bf16"]["enabled"] is True, "the user's dict was modified"
    assert caplog.text.count("[trl_ext]") == 1 and "accelerate mixed_precision" in caplog.text


def test_fp16_deepspeed_file_from_accelerate_gets_an_adjusted_copy(cpu_only, monkeypatch, tmp_path, caplog):
    path = tmp_path / "ds.json"
    path.write_text(runtime.json.dumps(DS_FP16))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    runtime.adapt_to_hardware(_fields(bf16=False))
    copy = runtime.os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
    assert copy != str(path) and runtime.json.loads(path.read_text()) == DS_FP16, "the user's file was changed"
    assert runtime.json.loads(open(copy).read())["fp16"] == {**DS_FP16["fp16"], "enabled": False}
    assert "fp16 (DeepSpeed fp16.enabled)" in caplog.text


def test_gpu_machines_keep_every_precision_setting(gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    path = tmp_path / "ds.json"
    path.write_text(runtime.json.dumps(DS_BF16))
    args = _fields(bf16=None, deepspeed=str(path))
    runtime.adapt_to_hardware(args)
    assert args.bf16 is None and args.deepspeed == str(path)
    assert runtime.os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_activation_offloading_without_an_accelerator_is_refused_in_one_line(cpu_only):
    """On a CUDA build of torch without a driver (torch from PyPI on a CPU machine) TRL fails with CUDA's multi-line
    error; on a CPU build, with one line of its own. Both before anything trains."""
    from types import SimpleNamespace

    from trl_ext.errors import SetupError

    runtime.check_offloading_has_an_accelerator(SimpleNamespace(activation_offloading=False))
    runtime.check_offloading_has_an_accelerator(SimpleNamespace())  # a config without the field (Reward, KTO)
    with pytest.raises(SetupError) as refused:
        runtime.check_offloading_has_an_accelerator(SimpleNamespace(activation_offloading=True))
    assert "\n" not in str(refused.value) and "activation_offloading=False" in str(refused.value)


def test_activation_offloading_is_left_to_trl_on_a_gpu(gpu):
    from types import SimpleNamespace

    runtime.check_offloading_has_an_accelerator(SimpleNamespace(activation_offloading=True, use_cpu=False))
