"""FSDP2 on CPU: when accelerate is told to choose FSDP, and that a GPU machine is left exactly as accelerate sets
it."""

import pytest
from accelerate.state import AcceleratorState, DistributedType, PartialState
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import CPUOffloadPolicy, StateDictType

from tests.unit.test_runtime import _fields, cpu_only, gpu  # noqa: F401 - fixtures
from trl_ext.engines import fsdp, quantization, rank0_loading, runtime


@pytest.fixture
def fake_state(monkeypatch):
    """AcceleratorState.__init__ replaced by one that sets ``distributed_type`` only, then wrapped by the scoped
    ``fsdp-on-cpu`` patch, as around a trainer's constructor."""
    saved = dict(PartialState._shared_state)

    def fake_init(self, *args, fsdp_plugin=None, **kwargs):
        self.__dict__ = AcceleratorState._shared_state
        self.distributed_type, self._mixed_precision, self.fsdp_plugin = self.chosen, "no", None

    monkeypatch.setattr(AcceleratorState, "__init__", fake_init)
    with runtime.accelerate_fsdp_on_cpu():
        yield
    assert AcceleratorState.__init__ is fake_init  # scoped: restored after the constructor
    AcceleratorState._shared_state.clear()
    PartialState._shared_state.clear()
    PartialState._shared_state.update(saved)


def _state(chosen, plugin):
    state = AcceleratorState.__new__(AcceleratorState)
    AcceleratorState.chosen = chosen
    try:
        state.__init__(fsdp_plugin=plugin)
    finally:
        del AcceleratorState.chosen
    return state


def _plugin(**kwargs):
    return FullyShardedDataParallelPlugin(fsdp_version=2, **kwargs)


def test_cpu_processes_get_fsdp_with_unpinned_offload(fake_state):
    plugin = _plugin(cpu_offload=True)
    assert plugin.cpu_offload.pin_memory  # accelerate's default; pinning needs an accelerator
    state = _state(DistributedType.MULTI_CPU, plugin)
    assert state.distributed_type == DistributedType.FSDP and state.fsdp_plugin is plugin
    assert PartialState._shared_state["distributed_type"] == DistributedType.FSDP  # later AcceleratorState() agree
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) and not plugin.cpu_offload.pin_memory


def test_gpus_and_plain_cpu_ddp_are_left_alone(fake_state):
    assert _state(DistributedType.MULTI_GPU, _plugin()).distributed_type == DistributedType.MULTI_GPU
    assert _state(DistributedType.MULTI_CPU, None).distributed_type == DistributedType.MULTI_CPU  # no FSDP asked


def test_applied_only_for_an_fsdp_launch_without_gpu_and_never_by_a_config(cpu_only, monkeypatch):  # noqa: F811
    calls = []
    monkeypatch.setattr(runtime, "accelerate_fsdp_on_cpu", lambda: calls.append(1))
    monkeypatch.setenv("WORLD_SIZE", "2")
    original = AcceleratorState.__init__
    runtime.fsdp_on_cpu(_fields(bf16=False, fsdp=""))
    assert calls == []
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch sets for an FSDP config
    runtime.adapt_to_hardware(_fields(bf16=False, fsdp=""))  # building a config patches nothing
    assert calls == [] and AcceleratorState.__init__ is original
    runtime.fsdp_on_cpu(_fields(bf16=False, fsdp=""))
    assert calls == [1]


def test_nothing_applied_on_a_gpu_machine(gpu, monkeypatch):  # noqa: F811
    monkeypatch.setattr(runtime, "accelerate_fsdp_on_cpu", lambda: pytest.fail("patched accelerate on a GPU machine"))
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    runtime.adapt_to_hardware(_fields(bf16=True, fsdp=""))
    runtime.fsdp_on_cpu(_fields(bf16=True, fsdp=""))


def test_optimizer_states_are_sharded_whatever_the_config_says():
    plugin = _plugin(state_dict_type="FULL_STATE_DICT")
    state = type("State", (), {"fsdp_plugin": plugin})()
    accelerator = type("Accelerator", (), {"state": state})()
    with fsdp.sharded_optimizer_states(accelerator) as sharded:
        assert state.fsdp_plugin is sharded and sharded.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert state.fsdp_plugin is plugin and plugin.state_dict_type == StateDictType.FULL_STATE_DICT


@pytest.mark.parametrize(("init_kwargs", "expected"), [({"dtype": "bfloat16"}, "bfloat16"), ({}, "float32"),
                                                        ({"dtype": "auto"}, "float32")])
def test_qlora_storage_follows_the_model_dtype_under_fsdp(monkeypatch, init_kwargs, expected):
    import torch
    from transformers import BitsAndBytesConfig

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    args = type("Args", (), {"model_init_kwargs": init_kwargs, "fsdp": "", "deepspeed_plugin": None})()
    config = BitsAndBytesConfig(load_in_4bit=True)
    assert quantization._storage_for(args, config.bnb_4bit_quant_storage, config) == getattr(torch, expected)


def test_ranks_that_do_not_read_load_headers_only_then_get_storage_of_their_own(monkeypatch):
    """rank0_loading on a rank that does not read: every weight stays on meta with the checkpoint's shapes, not one
    byte is read; give_meta_parameters_storage then gives each parameter its own CPU storage (accelerate maps the
    optimizer by address) and keeps tied parameters tied. The reading rank loads as usual."""
    import types

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, modeling_utils

    from tests.probes import weight_reads as _weight_reads
    from trl_ext.assets import default_model_path

    monkeypatch.setattr(modeling_utils, "safe_open", modeling_utils.safe_open)  # the counter is removed afterwards
    _weight_reads.install()
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    trl_module = types.SimpleNamespace()  # no reference model to prepare
    loaded = {}
    for reads in (True, False):
        monkeypatch.setattr(rank0_loading, "_reads_weights", lambda reads=reads: reads)
        _weight_reads.READS.clear()
        with rank0_loading.rank0_loading(trl_module, None):
            loaded[reads] = AutoModelForCausalLM.from_pretrained(default_model_path())
        assert {p.is_meta for p in loaded[reads].parameters()} == {not reads}
        assert (sum(_weight_reads.READS.values()) > 0) == reads
    assert "_load_pretrained_model" not in type(loaded[True]).__dict__  # transformers' loader restored on the way out
    model = loaded[False]
    expected = {n: (p.shape, p.dtype, p.requires_grad) for n, p in loaded[True].named_parameters()}
    rank0_loading.give_meta_parameters_storage(model)
    params = dict(model.named_parameters())
    assert not any(p.is_meta for p in params.values())
    assert {n: (p.shape, p.dtype, p.requires_grad) for n, p in params.items()} == expected
    assert len({p.data_ptr() for p in params.values()}) == len(params)

    with torch.device("meta"):
        tied = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_model_path(),
                                                                           tie_word_embeddings=True))
    rank0_loading.give_meta_parameters_storage(tied)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight and not tied.lm_head.weight.is_meta
