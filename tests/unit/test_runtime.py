import pytest
import trl

import trl_ext
from trl_ext import runtime


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
    assert "fp16 needs a GPU" in caplog.text


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


def test_configs_are_trl_configs_plus_one_save_option_and_build_on_cpu(tmp_path):
    for ours, theirs in [(trl_ext.SFTConfig, trl.SFTConfig), (trl_ext.RewardConfig, trl.RewardConfig),
                         (trl_ext.DPOConfig, trl.DPOConfig)]:
        cfg = ours(output_dir=str(tmp_path))  # TRL's own default (bf16) raises on CPU
        assert isinstance(cfg, theirs)
        assert [f.name for f in theirs.__dataclass_fields__.values()] + ["max_shard_size"] == [
            f.name for f in ours.__dataclass_fields__.values()]
        assert cfg.max_shard_size == "50GB"  # transformers' save_pretrained default


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
