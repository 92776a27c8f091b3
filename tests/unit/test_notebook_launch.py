"""trl_ext.launching.notebook.launch: the DeepSpeed config, its refusals, and two launches from one process."""

import json
import os
import pickle

import pytest
from accelerate.state import PartialState

from trl_ext import SFTConfig
from trl_ext.launching import notebook
from trl_ext.launching.notebook import _deepspeed_config, accelerate_state_set_aside, launch


def test_zero_stage_alone_keeps_deepspeed_defaults():
    config = _deepspeed_config(3, None)
    assert config["zero_optimization"] == {"stage": 3}  # persistence threshold: DeepSpeed's own default
    assert config["train_micro_batch_size_per_gpu"] == "auto"
    assert _deepspeed_config(None, None) is None  # no DeepSpeed: plain data parallel


def test_deepspeed_overrides_merge_section_by_section(tmp_path):
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}, "gradient_clipping": 1.0}
    config = _deepspeed_config(3, extra)
    assert config["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert config["gradient_clipping"] == 1.0
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert _deepspeed_config(None, str(path))["zero_optimization"] == {"stage": 2}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_processes": 1}, "num_processes must be 2 or more"),
    ({"zero_stage": 4}, "zero_stage must be one of"),
    ({"zero_stage": 3, "deepspeed": {"zero_optimization": {"stage": 2}}}, "give the stage once"),
    ({"deepspeed": "no/such/file.json"}, "is not a file"),
    ({"deepspeed": 3}, "must be a dict or a JSON file path"),
])
def test_bad_arguments_are_refused_before_anything_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch(lambda: None, **kwargs)


def test_kernel_state_is_set_aside_and_restored():
    PartialState()  # what single-process training earlier in a notebook leaves behind
    before = dict(PartialState._shared_state)
    with accelerate_state_set_aside():
        assert not PartialState._shared_state  # forked processes must not inherit a one-process state
    assert PartialState._shared_state == before


def test_each_process_waits_for_the_others_before_closing_its_connections(tmp_path, monkeypatch):
    """A rank whose function returns without a collective must not close its connections while another is still
    connecting: that one failed in its init_process_group (gloo: "Connection closed by peer"), in 38 of 1,362 double
    launches beside 3 busy processes (test_two_launches_after_single_process_use in CI). A barrier comes before the
    group is destroyed."""
    import torch
    import torch.distributed as dist

    calls = []
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *args, **kwargs: calls.append("destroy"))
    monkeypatch.setattr(notebook, "env_rank", lambda: 0)

    notebook._run_and_report(lambda: calls.append("function") or [0.5], str(tmp_path))()

    assert calls == ["function", "barrier", "destroy"]
    assert pickle.loads((tmp_path / notebook._RESULT_FILE).read_bytes()) == [0.5]


def _describe(output_dir):
    args = SFTConfig(output_dir=output_dir, report_to="none")
    plugin = args.deepspeed_plugin
    return {"world_size": args.world_size, "parallel": args.parallel_mode.value,
            "zero_stage": plugin.zero_stage if plugin else None,
            "persistence": plugin.hf_ds_config.config["zero_optimization"].get("stage3_param_persistence_threshold")
            if plugin else None}


@pytest.mark.slow
def test_two_launches_after_single_process_use(tmp_path):
    assert SFTConfig(output_dir=str(tmp_path / "here"), report_to="none").world_size == 1  # this process: alone
    env_before = dict(os.environ)

    zero3 = launch(_describe, str(tmp_path / "a"), num_processes=2, zero_stage=3,
                   deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    ddp = launch(_describe, str(tmp_path / "b"), num_processes=2)

    assert zero3 == {"world_size": 2, "parallel": "distributed", "zero_stage": 3, "persistence": 0}
    # data parallel for real (not 2 processes each training alone), and the first launch's DeepSpeed is gone
    assert ddp == {"world_size": 2, "parallel": "distributed", "zero_stage": None, "persistence": None}
    assert dict(os.environ) == env_before
    assert SFTConfig(output_dir=str(tmp_path / "again"), report_to="none").world_size == 1


def test_refuses_when_the_gpu_is_already_in_use(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialized in this one"):
        launch(lambda: None, num_processes=2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="this machine has 2 GPU"):
        launch(lambda: None, num_processes=4)
