"""Each patch in ``trl_ext.patches`` works around an upstream bug or gap; here each one that can be shown on CPU is
shown, without the patch, on the installed releases. When an upstream release fixes it, its test fails and says
which patch to remove. ``SHOWN_ELSEWHERE`` and ``NOT_SHOWN`` account for the rest, and a test keeps the three lists
equal to ``PATCHES``.

Multi-process cases run in forked processes with a gloo group of their own (the parent's imports, no new
interpreter), bounded by a timeout.
"""

import ast
import inspect
import multiprocessing
import os
import socket
import types
from pathlib import Path

import pytest
import torch

from tests.upstream import still_needed
from trl_ext import patches

# Patches whose upstream bug a test elsewhere shows (it needs a real multi-process run or a server stand-in).
SHOWN_ELSEWHERE = {
    "bounded-vllm-client":
        "tests/unit/test_vllm_server.py::test_trls_own_client_waits_for_a_stalled_server_without_end",
    "vllm-cpu-dtype": "tests/vllm/test_colocate.py::test_vllm_cpu_runs_an_fp32_checkpoint_in_bf16_unless_told",
    "vllm-cpu-tied-head": "tests/vllm/test_colocate.py::"
                          "test_vllm_cpu_reload_leaves_a_tied_head_and_moe_experts_stale_unless_processed_again",
    "vllm-cpu-moe-reload": "tests/vllm/test_colocate.py::"
                           "test_vllm_cpu_reload_leaves_a_tied_head_and_moe_experts_stale_unless_processed_again",
    "save-pretrained-guard": "tests/distributed/test_verify_real_checkpoints.py::"
                             "test_user_save_paths_after_zero3_are_refused_or_caught",
}
# Patches with nothing to show on CPU, and why.
NOT_SHOWN = {
    "dataset-preparation-probe": "a missing feature, not a bug: TRL has no public dataset check (its guard checks the "
                                 "private method the probe calls)",
    "trl-script-classes": "a missing hook: TRL's scripts take no trainer class (its guard reads the script's source)",
    "trl-cli-script": "a missing hook: TRL's CLI takes no script (its guard reads the command's source)",
    "accelerate-launch-environment": "a missing hook: accelerate has no function from a config to its processes' "
                                     "environment; tests/unit/test_orchestrators.py applies configs through it",
    "deferred-checkpoint-files": "a missing hook, not a bug: Trainer, DeepSpeed and accelerate write a checkpoint's "
                                 "states themselves, with no way to stage them (its guard checks the calls it defers)",
    "partitioned-adapter-dtype": "needs a 4-bit model under ZeRO-3 (two processes, bitsandbytes' kernels): "
                                 "tests/distributed/test_qlora.py trains through it with the patch",
    "zero3-forward-outside-trace": "needs a 2-process ZeRO-3 GRPO run with a colocated vLLM: without the patch, the "
                                   "recipe under accelerate_configs/zero3.yaml stopped at its first step ('Cannot "
                                   "partition a param in flight', tried by hand); tests/vllm checks that first sync",
    "ray-fresh-cluster-view": "needs a Ray cluster that loses a node: tests/ray/test_ray.py's elastic run restarts on "
                              "the nodes left through it; without it (tried by hand) the group restarted at the old "
                              "size and waited out a 60 s start timeout first",
    "elastic-first-round": "a missing setting: torchrun's c10d rendezvous has one last_call_timeout for every round; "
                           "tests/unit/test_elastic.py shows the job's first round reading a longer one with the "
                           "patch, and a machine joining a running job reading the later rounds' (4.2 s of waiting "
                           "against 1.5 s for the next round, on an idle machine)",
    "ray-standby-workers": "a missing API: Ray 2.60 prestarts a job's workers only through its raylet's RPC; "
                           "tests/ray/test_ray.py's elastic run restarts on standby processes through it (without "
                           "them a recovery took 27.3 s here, with them 9.6 s: bench/RESULTS.md)",
    "ray-unregister-lost-node": "needs a Ray cluster that loses a node: tests/ray/test_ray.py's elastic run reports "
                                "it dead through it; without it Ray's health checks marked it 10.8 s later "
                                "(bench/RESULTS.md)",
    # Private names read or overridden where the library has no public one: nothing wrong to show; each guard checks
    # the name, and tests/unit/test_patches.py checks what each helper reads and its fallback.
    "checkpoint-wrapper": "a private module: torch has no public path to its CheckpointWrapper",
    "storage-identity": "a missing API: torch gives storages no public identity",
    "dtensor-local-tensor": "to_local() gives a Parameter(DTensor)'s shard as a new view at each call (torch "
                            "gh-166156, by design); FSDP2's background saves (tests/distributed) copy through it",
    "memory-checkpoint-point": "a missing hook, not a bug: Trainer has no callback after its step-end save, where "
                               "a memory checkpoint holds the same trainer state (tests/unit/test_memory_tier.py "
                               "compares it with the disk checkpoint of its step)",
    "module-own-tensors": "a missing API: no public way to tell persistent buffers without the state-dict hooks",
    "model-from-config": "a missing API: model classes have no public from_config",
    "dataset-preparation-refusal": "a missing hook: TRL has no public dataset check",
    "jit-checkpoint-sigterm-handler": "a missing hook: transformers keeps the handler it replaced private",
    "parser-destinations": "a missing API: argparse lists a parser's actions only privately",
    "exit-callbacks-now": "a missing API: atexit runs its callbacks only at exit; a gloo rank's clean end "
                          "(tests/distributed) runs them through it",
    "exit-threads-now": "a missing API: CPython takes its first exit step (threading's hooks, then the joins) only at "
                        "exit; a gloo rank's clean end takes it through it, and tests/unit/test_clean_exit.py shows "
                        "the joins alone hang on an idle thread pool",
}


def _tests_here() -> set[str]:
    tree = ast.parse(Path(__file__).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


SHOWN_HERE = {
    "fsdp-on-cpu": "test_accelerate_sets_up_no_fsdp_for_cpu_processes",
    "rank0-loading": "test_a_rank_that_should_not_read_still_reads_every_weight",
    "reference-model-broadcast": "test_trl_shards_the_reference_model_without_a_broadcast",
    "reward-head-peft-config": "test_trls_reward_trainer_lora_wraps_the_head",
    "bounded-weight-sync": "test_trls_vllm_sync_gathers_the_whole_peft_model_at_once",
    "no-input-require-grads": "test_non_reentrant_checkpointing_still_registers_the_input_hook",
    "partial-checkpoint-dir": "test_a_failed_checkpoint_save_leaves_a_checkpoint_dir_in_place",
    "sharded-optimizer-states": "test_accelerate_saves_optimizer_states_as_it_saves_weights",
    "unused-weight-conversions": "test_a_zero3_load_keeps_conversions_that_never_matched",
    "notebook-import-check": "test_notebook_launcher_refuses_once_bitsandbytes_is_imported",
    "accelerate-state-set-aside": "test_notebook_launcher_refuses_after_single_process_use",
    "bnb-cpu-packed-4bit": "test_bitsandbytes_repacks_4bit_weights_in_place_on_cpu",
    "recompute-owner": "test_deepspeed_gives_a_recomputed_weight_to_the_innermost_module",
    "zero3-universal-load": "test_deepspeed_zero3_universal_load_shares_one_adam_step_and_the_first_groups_settings",
    "exit-before-thread-pools": "test_thread_pools_refuse_work_from_atexit_callbacks_and_non_daemon_threads",
}


def test_every_patch_is_shown_or_says_why_not():
    accounted = set(SHOWN_HERE) | set(SHOWN_ELSEWHERE) | set(NOT_SHOWN)
    assert accounted == set(patches.PATCHES), accounted ^ set(patches.PATCHES)
    assert not (set(SHOWN_HERE) & set(SHOWN_ELSEWHERE)) and not (set(SHOWN_HERE) & set(NOT_SHOWN))
    assert set(SHOWN_HERE.values()) <= _tests_here()
    repo = Path(__file__).resolve().parents[2]
    for where in SHOWN_ELSEWHERE.values():
        path, name = where.split("::")
        assert f"def {name}(" in (repo / path).read_text(), where


# -------------------------------------------------------------------------------------------------- CPython


def test_thread_pools_refuse_work_from_atexit_callbacks_and_non_daemon_threads():
    """A script that returns: an atexit callback, and a non-daemon thread still working, can no longer submit to a
    ThreadPoolExecutor (the uploads' file pool, asyncio's resolver); a threading exit hook registered after
    concurrent.futures' still can."""
    import subprocess
    import sys

    script = """
import atexit, threading, time
from concurrent.futures import ThreadPoolExecutor  # imported first, as by the uploader: its exit hook is older
def submit(where):
    try:
        ThreadPoolExecutor(1).submit(int).result()
        print(where, "ok", flush=True)
    except RuntimeError as exc:
        print(where, "refused:", exc, flush=True)
atexit.register(submit, "atexit")
threading._register_atexit(submit, "threading-hook")
threading.Thread(target=lambda: (time.sleep(0.5), submit("thread"))).start()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
    assert "threading-hook ok" in out, out
    still_needed("exit-before-thread-pools", "atexit refused" in out and "thread refused" in out,
                 f"thread pools asked for work at exit: {out.strip()}")


# --------------------------------------------------------------------------------- helpers: forked gloo processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, env: dict, fn, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    try:
        results.put((rank, fn(rank)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def in_processes(fn, world: int = 1, env: dict | None = None, timeout: float = 120, deepspeed: bool = False) -> list:
    """``fn(rank)`` in ``world`` forked processes with the launcher's variables set; their results, by rank. With
    ``deepspeed``, DeepSpeed's CPU comm op is built first, outside the timeout: on a clean machine its build takes 60 s
    of CPU, which under CI's load ran past the bound (tests/deepspeed_op.py)."""
    if deepspeed:
        from tests import deepspeed_op

        deepspeed_op.build()
    context = multiprocessing.get_context("fork")
    results, port = context.Queue(), _free_port()
    processes = [context.Process(target=_child, args=(r, world, port, env or {}, fn, results)) for r in range(world)]
    for process in processes:
        process.start()
    got = {}
    try:
        for _ in processes:
            rank, value = results.get(timeout=timeout)
            got[rank] = value
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
    return [got[r] for r in range(world)]


# ------------------------------------------------------------------------------------------------ accelerate


def _distributed_type_with_fsdp(rank: int) -> str:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    for cls in (PartialState, AcceleratorState, GradientState):  # a fresh process's state, not the parent's
        cls._shared_state.clear()
    kind = str(Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)).distributed_type)
    # both ranks' gloo meshes whole before either leaves: a rank that ended at once closed its side while the other
    # still connected ("Gloo connectFullMesh failed ... Connection closed by peer", seen on a loaded CI machine)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return kind


def test_accelerate_sets_up_no_fsdp_for_cpu_processes():
    """Two CPU processes, an FSDP2 plugin: accelerate chooses plain data parallelism (MULTI_CPU), not FSDP."""
    kinds = in_processes(_distributed_type_with_fsdp, world=2, env={"ACCELERATE_USE_CPU": "true"})
    still_needed("fsdp-on-cpu", all("MULTI_CPU" in k for k in kinds),
                 f"accelerate's distributed type for CPU processes with an FSDP plugin: {kinds}")


def test_accelerate_saves_optimizer_states_as_it_saves_weights():
    """accelerate's FSDP plugin has one state-dict type for weights and optimizer: whole weights mean whole
    optimizer states, gathered on rank 0."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FullOptimStateDictConfig

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT")
    fields = sorted(f for f in vars(plugin) if "optim" in f and "state_dict" in f)
    still_needed("sharded-optimizer-states", isinstance(plugin.optim_state_dict_config, FullOptimStateDictConfig)
                 and fields == ["optim_state_dict_config"],
                 f"the plugin's optimizer settings for whole weights: {fields}, "
                 f"{type(plugin.optim_state_dict_config).__name__}")


def test_notebook_launcher_refuses_once_bitsandbytes_is_imported():
    pytest.importorskip("bitsandbytes")
    from accelerate import launchers

    source = inspect.getsource(launchers.notebook_launcher)
    still_needed("notebook-import-check", bool(launchers.are_libraries_initialized("bitsandbytes"))
                 and 'are_libraries_initialized("bitsandbytes")' in source,
                 "notebook_launcher's refusal once bitsandbytes is imported")


def test_notebook_launcher_refuses_after_single_process_use():
    from accelerate import Accelerator, notebook_launcher
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from trl_ext.launching import notebook

    saved = {cls: dict(cls._shared_state) for cls in (PartialState, AcceleratorState, GradientState)}
    refused = None
    try:
        Accelerator()  # what single-process training earlier in a notebook leaves behind
        with notebook.no_import_check():
            try:
                notebook_launcher(lambda: None, num_processes=2)
            except ValueError as exc:
                refused = str(exc)
    finally:
        for cls, state in saved.items():
            cls._shared_state.clear()
            cls._shared_state.update(state)
    still_needed("accelerate-state-set-aside", refused is not None and "initialized" in refused,
                 "notebook_launcher's refusal while a one-process state exists")


# ---------------------------------------------------------------------------------------------- transformers


def _bytes_read_by_a_rank_that_should_not_read(rank: int) -> int:
    import importlib

    from transformers import AutoModelForCausalLM, modeling_utils

    from tests.probes import weight_reads
    from trl_ext.assets import default_model_path

    torch.distributed.init_process_group("gloo")
    for where in ("transformers.distributed.utils", "transformers.modeling_utils"):  # it moved in 5.x
        try:
            module = importlib.import_module(where)
        except ImportError:
            continue
        if hasattr(module, "is_local_dist_rank_0"):
            module.is_local_dist_rank_0 = lambda: False  # a second process of the machine
    weight_reads.install()
    AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    assert modeling_utils.safe_open is not None
    torch.distributed.destroy_process_group()
    return sum(weight_reads.READS.values())


def test_a_rank_that_should_not_read_still_reads_every_weight(tiny_model_path):
    """With fsdp_cpu_ram_efficient_loading under FSDP2, a machine's other processes should read no weight
    (transformers#43749): transformers' loader reads them all anyway."""
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_VERSION": "2"}
    (read,) = in_processes(_bytes_read_by_a_rank_that_should_not_read, env=env)
    total = sum(f.stat().st_size for f in Path(tiny_model_path).glob("*.safetensors"))
    still_needed("rank0-loading", isinstance(read, int) and read > total // 2,
                 f"weight bytes read on a rank that keeps its weights on meta: {read} of about {total}")


def _unused_conversions_under_zero3(rank: int, path: str) -> list[str]:
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1})
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    del config
    return [str(c) for c in getattr(model, "_weight_conversions", None) or [] if not c.was_used()]


def test_a_zero3_load_keeps_conversions_that_never_matched():
    """Outside ZeRO-3, from_pretrained keeps the weight conversions that matched the checkpoint; under ZeRO-3 it keeps
    unused ones too, and reverting them on save writes wrong names."""
    from tests.families import family_path

    # Resolved here, outside the bound: the first use builds every family (in a fresh session, the oldest leg's, that
    # build ran inside the child's 180 s at CI's load and timed it out, 2026-12-03)
    path = family_path("qwen2_vl")
    (unused,) = in_processes(lambda rank: _unused_conversions_under_zero3(rank, path), timeout=180, deepspeed=True)
    still_needed("unused-weight-conversions", isinstance(unused, list) and bool(unused),
                 f"conversions a ZeRO-3 load keeps without using them: {unused}")


def test_non_reentrant_checkpointing_still_registers_the_input_hook(tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base = model.get_base_model()
    still_needed("no-input-require-grads", getattr(base, "_require_grads_hook", None) is not None,
                 "the input-require-grads hook after enabling non-reentrant checkpointing on a PEFT model")


def test_a_failed_checkpoint_save_leaves_a_checkpoint_dir_in_place(tmp_path, tiny_model_path, monkeypatch):
    """transformers' Trainer writes checkpoint-N where it will stay: a save that dies half-way leaves a
    checkpoint-N with the model but without the rest, which get_last_checkpoint then picks."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    ids = list(range(10, 26))
    data = Dataset.from_list([{"input_ids": ids, "labels": ids}] * 4)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, save_steps=1, per_device_train_batch_size=2,
                             report_to="none", use_cpu=True)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path), args=args, train_dataset=data)

    def die(*args, **kwargs):
        raise OSError("killed mid-save")

    monkeypatch.setattr(trainer, "_save_optimizer_and_scheduler", die)
    with pytest.raises(OSError, match="killed mid-save"):
        trainer.train()
    last = get_last_checkpoint(str(tmp_path))
    still_needed("partial-checkpoint-dir", last is not None and not (Path(last) / "trainer_state.json").exists(),
                 f"what a save that died half-way leaves for resume_from_checkpoint=True: {last}")


# ------------------------------------------------------------------------------------------------------- TRL


def test_trls_reward_trainer_lora_wraps_the_head(tmp_path, tiny_model_path):
    """TRL's RewardTrainer with LoRA on all linear layers and no task_type wraps the score head in LoRA: its random
    base weights are never trained nor saved (docs/fixes.md, report F2)."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig

    rows = [{"chosen": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}],
             "rejected": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "3"}]}] * 2
    trainer = trl.RewardTrainer(model=tiny_model_path, train_dataset=Dataset.from_list(rows),
                                args=trl.RewardConfig(output_dir=str(tmp_path), report_to="none", bf16=False,
                                                      use_cpu=True),
                                peft_config=LoraConfig(r=4, target_modules="all-linear"))
    names = [n for n, _ in trainer.model.named_parameters()]
    wrapped = [n for n in names if ".score.lora_" in n or n.startswith("base_model.model.score.lora_")]
    saved_whole = [n for n in names if "score.modules_to_save" in n]
    still_needed("reward-head-peft-config", bool(wrapped) and not saved_whole,
                 f"the head's parameters under TRL: LoRA {wrapped[:1]}, saved whole {saved_whole[:1]}")


def test_trls_vllm_sync_gathers_the_whole_peft_model_at_once(tiny_model_path):
    """TRL's weight sync for a PEFT model gathers every parameter in one go (under ZeRO-3: the whole model on every
    rank) to merge the adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.generation.vllm_generation import VLLMGeneration

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4))
    gathers = []

    class Dist:
        is_fsdp = False

        @staticmethod
        def gather_params(params):
            gathers.append(len(params))
            import contextlib

            return contextlib.nullcontext()

    sync = types.SimpleNamespace(model=model, _dist=Dist(), _fix_param_name_to_vllm=lambda name, **kw: name)
    list(VLLMGeneration._iter_named_params(sync))
    still_needed("bounded-weight-sync", gathers == [len(list(model.parameters()))],
                 f"parameters per gather in TRL's sync: {gathers} of {len(list(model.parameters()))}")


def test_trl_shards_the_reference_model_without_a_broadcast():
    """TRL prepares DPO's and KTO's reference model with a bare fully_shard: nothing sends rank 0's weights to the
    ranks that fsdp_cpu_ram_efficient_loading left on meta (accelerate's fsdp2_prepare_model does)."""
    from trl.trainer import dpo_trainer

    source = inspect.getsource(dpo_trainer.prepare_fsdp)
    still_needed("reference-model-broadcast", "fully_shard(" in source and "broadcast" not in source
                 and "fsdp2_load_full_state_dict" not in source and "fsdp2_prepare_model" not in source,
                 "a broadcast of rank 0's weights in TRL's prepare_fsdp")


# ------------------------------------------------------------------------------------ DeepSpeed, bitsandbytes


def test_deepspeed_gives_a_recomputed_weight_to_the_innermost_module(monkeypatch):
    """While lora_B's backward triggers a non-reentrant recompute, DeepSpeed hands the frozen weights it gathers to
    lora_B, which releases them before the backward of the modules that use them."""
    import deepspeed
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    from packaging.version import Version
    from torch import nn

    if Version(deepspeed.__version__) < Version("0.19.3"):
        pytest.skip("DeepSpeed < 0.19.3 has no non-reentrant recompute of ZeRO-3 parameters")
    monkeypatch.setattr(coordinator_module, "print_rank_0", lambda *a, **k: None)  # needs a process group
    original = getattr(coordinator_module, "_deepspeed_update_recompute_parameters",
                       coordinator_module.update_recompute_parameters)
    layer = nn.Module()
    layer.attn = nn.Linear(2, 2)
    layer.lora_B = nn.Linear(2, 2)
    for ds_id, module in enumerate(layer.modules()):
        module.ds_id, module.ds_recompute_parameters = ds_id, set()
    for ds_id, param in enumerate(layer.parameters()):
        param.ds_id, param.ds_active_sub_modules = ds_id, set()
    original(layer.lora_B, layer.attn.weight)
    still_needed("recompute-owner", layer.lora_B.ds_recompute_parameters == {layer.attn.weight},
                 "the owner of a frozen weight gathered by a recompute under lora_B's backward")


def test_bitsandbytes_repacks_4bit_weights_in_place_on_cpu():
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")  # quantized here
    if not getattr(layer, "support_avx512bf16_for_cpu", False):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes keeps its plain 4-bit kernel here")
    layer.eval()
    before = layer.weight.data.clone()
    with torch.no_grad():
        layer(torch.randn(2, 64))
    repacked = bool(getattr(layer.weight.quant_state, "packing_format_for_cpu", False))
    still_needed("bnb-cpu-packed-4bit", repacked or not torch.equal(before, layer.weight.data),
                 "bitsandbytes' in-place repacking of a 4-bit weight on its first eval forward")


def _zero3_universal_load(rank: int, folder: str) -> dict:
    """Two parameter groups (weight decay 0.1 and 0.0) under ZeRO-3, one step, saved, converted to the universal
    checkpoint and loaded into a fresh engine: what DeepSpeed's loader left, then what trl_ext's repair leaves."""
    import deepspeed
    from torch import nn

    from trl_ext.resuming import universal

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

    def engine(load_universal: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4, bias=False))
        groups = [{"params": [model[0].weight], "weight_decay": 0.1},
                  {"params": [model[1].weight], "weight_decay": 0.0}]
        built, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3),
                                         config={**config, "checkpoint": {"load_universal": load_universal}})
        return built

    saved = engine(False)
    saved.backward(saved(torch.ones(1, 4)).sum())
    saved.step()
    saved.save_checkpoint(folder, tag="global_step1")
    universal.convert_to_universal(folder, "global_step1")
    loaded = engine(True)
    loaded.load_checkpoint(folder)
    zero = loaded.optimizer

    def seen() -> dict:
        steps = [zero.optimizer.state[flat]["step"] for flat in zero.fp32_partitioned_groups_flat]
        return {"shared_step": len({id(s) for s in steps}) < len(steps), "steps": [float(s) for s in steps],
                "weight_decay": [group["weight_decay"] for group in zero.optimizer.param_groups]}

    before = seen()
    repaired = universal.repair_zero3_universal_load(zero, universal.folder(folder, "global_step1") / "zero")
    return {"deepspeed": before, "repaired": repaired, "after": seen()}


def test_deepspeed_zero3_universal_load_shares_one_adam_step_and_the_first_groups_settings(tmp_path):
    """DeepSpeed's ZeRO-3 loader of a universal checkpoint gives every optimizer sub-group the same step tensor (torch's
    AdamW advances it once per sub-group) and every parameter group the first one's hyperparameters."""
    (got,) = in_processes(lambda rank: _zero3_universal_load(rank, str(tmp_path)), timeout=180,
                         deepspeed=True)
    assert isinstance(got, dict), got
    # trl_ext's repair: a step each, at the saved count, and each group's own weight decay
    assert got["repaired"] and got["after"] == {"shared_step": False, "steps": [1.0, 1.0], "weight_decay": [0.1, 0.0]}
    still_needed("zero3-universal-load",
                 got["deepspeed"]["shared_step"] or got["deepspeed"]["weight_decay"] != [0.1, 0.0],
                 f"the optimizer DeepSpeed loaded from a ZeRO-3 universal checkpoint: {got['deepspeed']}")
