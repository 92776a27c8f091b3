"""Every change trl_ext makes to another library's internals, declared in one place; the fixes live by their callers.

``PATCHES`` declares each one: what it changes, why, the upstream issue or PR, when it can go, and its guard (a
version check or a feature probe against the installed releases). Every private name of another library that trl_ext
reads or overrides is declared there too. This module holds the declarations and the guards only: each fix's body sits
beside the code that needs it, and asks the registry first (``applies``), or makes its change through it, scoped to the
call where it can be (``swapped``, ``setting``); where the guard fails it keeps the library's public behaviour.
Nothing is patched on import or while a config is built. Where a guard fails (a release that moved the internals) the
patch is skipped with one notice and the library's own behaviour stays. The registry imports nothing of trl_ext, so
that every room can use it, ``process/`` included. ``tests/unit/test_patches.py`` lists them, checks every guard
against the installed versions, and that every change or private read elsewhere asks its patch's guard.
"""

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

from packaging.version import Version

# Where a guard fails, the one notice (per process: ``applies`` is cached) goes here. The registry imports nothing of
# trl_ext, so that every room can use it; ``process.notices`` lets only the process that says notices print it.
logger = logging.getLogger("trl_ext.patches")

# TRL's trainer classes (``trl.trainer.sft_trainer.SFTTrainer``) whose dataset preparation trl_ext's trainers wrap,
# handed down by each trainer's class as it is defined (trainers/mixin.py): the guard of dataset-preparation-refusal
DATASET_PREPARERS: set[str] = set()


@dataclass(frozen=True)
class Patch:
    """One change to another library's internals.

    Args:
        target: the dotted path of what it changes (``module.Class.attribute``).
        why: what goes wrong without it.
        upstream: the upstream issue or PR, or why none applies.
        remove_when: the condition under which the patch can go.
        guard: returns True where the installed release has what the patch expects.
    """

    target: str
    why: str
    upstream: str
    remove_when: str
    guard: Callable[[], bool]


def _version(package: str) -> Version | None:
    try:
        return Version(importlib.import_module(package).__version__)
    except (ImportError, AttributeError):
        return None


def _resolve(target: str):
    """The object at a dotted path (module, then attributes), or None if the installed release does not have it."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            owner = getattr(owner, name, None)
            if owner is None:
                return None
        return owner
    return None


def _has(target: str, *parameters: str) -> Callable[[], bool]:
    """A feature probe: ``target`` exists (and, for a callable, takes these ``parameters``)."""

    def probe() -> bool:
        found = _resolve(target)
        if found is None:
            return False
        if not parameters:
            return True
        try:
            names = inspect.signature(found).parameters
        except (TypeError, ValueError):
            return False
        return all(p in names for p in parameters)

    return probe


def _source_has(target: str, text: str) -> Callable[[], bool]:
    """A feature probe for code whose decorators hide its signature: ``target``'s source contains ``text``."""

    def probe() -> bool:
        found = _resolve(target)
        try:
            return found is not None and text in inspect.getsource(found)
        except (OSError, TypeError):
            return False

    return probe


def _all(*probes: Callable[[], bool]) -> Callable[[], bool]:
    return lambda: all(probe() for probe in probes)


PATCHES: dict[str, Patch] = {
    "fsdp-on-cpu": Patch(
        target="accelerate.state.AcceleratorState.__init__",
        why="accelerate sets DistributedType.FSDP only for GPU-like launches; on CPU processes it sets up plain data "
            "parallelism and ignores the FSDP config, so nothing is sharded",
        upstream="none filed: accelerate/state.py (1.15) checks MULTI_GPU, MULTI_XPU, ... before choosing FSDP",
        remove_when="accelerate chooses FSDP for a MULTI_CPU launch with an FSDP plugin",
        guard=_has("accelerate.state.AcceleratorState.__init__", "fsdp_plugin"),
    ),
    "rank0-loading": Patch(
        target="transformers.modeling_utils.PreTrainedModel._load_pretrained_model",
        why="with fsdp_cpu_ram_efficient_loading under FSDP2 every rank still reads every weight",
        upstream="transformers#43749",
        remove_when="transformers' loader skips the weights on the ranks it leaves on meta",
        guard=_has("transformers.modeling_utils.PreTrainedModel._load_pretrained_model", "model", "state_dict",
                   "checkpoint_files", "load_config"),
    ),
    "reference-model-broadcast": Patch(
        target="trl.trainer.dpo_trainer.prepare_fsdp",
        why="TRL prepares DPO's (and KTO's) reference model with a bare fully_shard, which never broadcasts rank 0's "
            "weights to the ranks that rank-0 loading kept on meta",
        upstream="none filed: trl/trainer/dpo_trainer.py (1.16) calls prepare_fsdp(ref_model, accelerator)",
        remove_when="TRL prepares the reference model through accelerate's fsdp2_prepare_model",
        guard=_has("trl.trainer.dpo_trainer.prepare_fsdp"),
    ),
    "reward-head-peft-config": Patch(
        target="trl.trainer.reward_trainer.get_peft_model",
        why="with target_modules='all-linear' and no task_type TRL LoRA-wraps the reward head, whose random weights "
            "are never trained or saved (docs/fixes.md, report F2)",
        upstream="none filed: TRL 1.16 has no hook between loading the model and wrapping it with PEFT",
        remove_when="TRL keeps the head out of LoRA and in modules_to_save for reward models",
        guard=_has("trl.trainer.reward_trainer.get_peft_model"),
    ),
    "bounded-weight-sync": Patch(
        target="trl.trainer.grpo_trainer.VLLMGeneration",
        why="TRL's vLLM sync gathers the whole PEFT model under ZeRO-3 to merge, and names weights by string rules",
        upstream="trl#7103, trl PR#7131, trl#6797 (sync hangs and gathers)",
        remove_when="TRL syncs one module at a time under the checkpoint's names",
        guard=_all(_has("trl.trainer.grpo_trainer.VLLMGeneration"),
                   _has("trl.generation.vllm_generation.VLLMGeneration._iter_named_params")),
    ),
    "vllm-cpu-dtype": Patch(
        target="trl.generation.vllm_generation.LLM",
        why="TRL builds the colocated LLM without a dtype; vLLM's CPU build then runs an fp32 checkpoint in bf16 "
            "while the trainer trains fp32 on CPU: rollouts and their log-probabilities come from other weights "
            "(the sync check sees 3e-3 on the first sync)",
        upstream="none filed: trl/generation/vllm_generation.py (1.16) passes no dtype to LLM(...)",
        remove_when="TRL passes the policy's dtype to the colocated LLM (or a vllm_dtype option)",
        guard=_source_has("trl.generation.vllm_generation.VLLMGeneration._init_vllm", "self.llm = LLM("),
    ),
    "vllm-cpu-tied-head": Patch(
        target="vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod."
               "process_weights_after_loading",
        why="on CPU vLLM packs the LM head's weight for its GEMM when it processes the layer; a tied head receives no "
            "weight of its own in reload_weights (the checkpoint has no lm_head.weight), so the layerwise reload never "
            "processes it again and the logits keep coming from the first weights: every sync after the first, in "
            "full fine-tuning of a tied model, does not land",
        upstream="none filed for the tied head; vllm#48312 tracks weight-reload correctness for RL",
        remove_when="vLLM's layerwise reload processes a layer again when a weight it shares was loaded",
        guard=_all(_has("vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod."
                        "process_weights_after_loading", "layer"),
                   _has("vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbedding")),
    ),
    "vllm-cpu-moe-reload": Patch(
        target="vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod."
               "_setup_kernel",
        why="on CPU vLLM packs the experts' weights for its MoE kernel only on the first load; on a weight update "
            "(reload_weights) it skips the packing and copies the loaded weights, not packed, over the packed ones, "
            "so a mixture-of-experts model serves wrong experts after every sync, the first included",
        upstream="none filed; vllm#48312 tracks weight-reload correctness for RL",
        remove_when="vLLM packs the CPU experts again on a weight update",
        guard=_all(_source_has("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method."
                               "UnquantizedFusedMoEMethod._setup_kernel", "if not is_weight_update:"),
                   _has("vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts."
                        "process_weights_after_loading", "layer")),
    ),
    "bounded-vllm-client": Patch(
        target="trl.generation.vllm_generation.VLLMClient",
        why="TRL's vLLM client sends requests without a timeout and retries failed reads 5 times: a stalled server "
            "hangs every rank of the job without a message",
        upstream="trl#6973 (closed; trl PR#7219, an opt-in timeout for metadata requests only, was not merged)",
        remove_when="TRL's VLLMClient bounds every request and its weight transfer",
        guard=_all(_has("trl.generation.vllm_generation.VLLMClient"),
                   _source_has("trl.generation.vllm_client.VLLMClient.__init__", "self.session = requests.Session()"),
                   _has("trl.generation.vllm_generation.VLLMGeneration._init_vllm")),
    ),
    "no-input-require-grads": Patch(
        target="transformers.modeling_utils.PreTrainedModel.enable_input_require_grads",
        why="transformers registers the input-require-grads hook whenever checkpointing is enabled on a PEFT model "
            "and TRL's DPO re-enables it every step (one more hook each step); non-reentrant checkpointing does not "
            "need it",
        upstream="none filed: transformers 5.23 gradient_checkpointing_enable",
        remove_when="transformers registers the hook for reentrant checkpointing only",
        guard=_has("transformers.modeling_utils.PreTrainedModel.disable_input_require_grads"),
    ),
    "save-pretrained-guard": Patch(
        target="transformers.modeling_utils.PreTrainedModel.save_pretrained",
        why="a plain save_pretrained of a ZeRO-3 model writes its empty torch.Size([0]) placeholders (report F1)",
        upstream="none: the user's own call, outside any trainer, cannot be gathered for",
        remove_when="save_pretrained gathers ZeRO-3 partitions itself",
        guard=_has("transformers.modeling_utils.PreTrainedModel.save_pretrained", "save_directory"),
    ),
    "partial-checkpoint-dir": Patch(
        target="transformers.Trainer._get_output_dir",
        why="Trainer builds checkpoint-N's path from _get_output_dir() and offers no hook to write it elsewhere "
            "first, so a kill mid-save leaves a checkpoint-N that looks complete",
        upstream="none filed",
        remove_when="Trainer saves checkpoints atomically",
        guard=_has("transformers.Trainer._get_output_dir"),
    ),
    "memory-checkpoint-point": Patch(
        target="transformers.Trainer._maybe_log_save_evaluate",
        why="a memory checkpoint (memory_checkpoint_steps) is taken where Trainer takes its own, after the step's "
            "log and evaluation, so that it holds the same trainer state; Trainer has no hook after that point",
        upstream="none filed",
        remove_when="Trainer offers a callback after its step-end save",
        guard=_has("transformers.Trainer._maybe_log_save_evaluate", "model", "trial"),
    ),
    "sharded-optimizer-states": Patch(
        target="accelerate.state.AcceleratorState.fsdp_plugin",
        why="FULL_STATE_DICT assembles every optimizer state on rank 0; trl_ext keeps them sharded (DCP)",
        upstream="none: accelerate follows the config's fsdp_state_dict_type for weights and optimizer alike",
        remove_when="accelerate can save optimizer states sharded while weights are saved whole",
        guard=_has("accelerate.utils.FullyShardedDataParallelPlugin.set_state_dict_type"),
    ),
    "unused-weight-conversions": Patch(
        target="transformers.modeling_utils.PreTrainedModel._weight_conversions",
        why="a model loaded under ZeRO-3 keeps conversions that never matched its checkpoint; reverting them writes "
            "wrong names (model.model.layers... for Qwen2-VL), also in the user's own save_pretrained",
        upstream="none filed: transformers 5.23 integrations.deepspeed._load_state_dict_into_zero3_model",
        remove_when="transformers keeps only the conversions that were used, under ZeRO-3 too",
        guard=_has("transformers.core_model_loading.WeightConverter.was_used"),
    ),
    "notebook-import-check": Patch(
        target="accelerate.launchers.are_libraries_initialized",
        why="notebook_launcher refuses to start once bitsandbytes is imported (peft imports it whenever installed), "
            "even on CPU; launch() checks torch.cuda.is_initialized() itself instead",
        upstream="none filed: accelerate/launchers.py (1.15)",
        remove_when="accelerate checks CUDA initialisation rather than imported libraries",
        guard=_has("accelerate.launchers.are_libraries_initialized"),
    ),
    "accelerate-state-set-aside": Patch(
        target="accelerate.state.PartialState._shared_state",
        why="single-process training earlier in a notebook leaves a one-process state: notebook_launcher refuses to "
            "start while it exists, and forked processes would inherit it and each train alone",
        upstream="none filed: accelerate keeps its state in class-level _shared_state dicts with no public reset",
        remove_when="accelerate offers a public way to reset its state around notebook_launcher",
        guard=_all(*(_has(f"accelerate.state.{cls}._shared_state")
                     for cls in ("PartialState", "AcceleratorState", "GradientState"))),
    ),
    "bnb-cpu-packed-4bit": Patch(
        target="bitsandbytes.nn.Linear4bit.support_avx512bf16_for_cpu",
        why="on a CPU with AVX512-BF16 bitsandbytes repacks a 4-bit weight in place on its first eval forward and "
            "rounds its scales to bf16: the next ZeRO-3 gather fails, and every later save differs from the base",
        upstream="none filed: bitsandbytes 0.48-0.50 nn/modules.py Linear4bit.forward",
        remove_when="bitsandbytes repacks a copy, or keeps the scales",
        guard=lambda: _version("bitsandbytes") is None or _version("bitsandbytes") < Version("0.51"),
    ),
    "dataset-preparation-probe": Patch(
        target="trl.trainer.sft_trainer.SFTTrainer._prepare_dataset",
        why="TRL's verdict on a dataset comes only from its constructor, after the model is loaded; the probe runs "
            "_prepare_dataset on an instance built with __new__ holding only what the method reads, with the "
            "module's global_then_local_main_first barrier made local (a probe that stops early on one rank would "
            "leave the others at it)",
        upstream="none: TRL has no public dataset check",
        remove_when="TRL exposes its dataset preparation without building a trainer",
        guard=_all(_has("trl.trainer.sft_trainer.SFTTrainer._prepare_dataset", "dataset", "processing_class", "args"),
                   _has("trl.trainer.sft_trainer.global_then_local_main_first")),
    ),
    "recompute-owner": Patch(
        target="deepspeed.runtime.zero.partitioned_param_coordinator.update_recompute_parameters",
        why="DeepSpeed hands each frozen parameter a non-reentrant recompute gathers to the innermost backward "
            "submodule running (under LoRA a lora_B) and frees it when that one ends, before the backward of the "
            "module that uses it, which all-gathers it again: 0.93x the model per step more than reentrant",
        upstream="DeepSpeed PR #8148 (which introduced the attribution); follow-up not filed: the report's text is in "
                 "bench/RESULTS.md, 'Non-reentrant checkpointing without the extra all-gather'",
        remove_when="DeepSpeed attributes a recomputed parameter to a backward submodule that contains its module",
        guard=_all(_source_has("deepspeed.runtime.zero.partitioned_param_coordinator",  # decorated: its module's source
                               "def update_recompute_parameters(sub_module: Module, param: Parameter)"),
                   _source_has("deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator"
                               "._fetch_sub_module_impl", "update_recompute_parameters(next(reversed(self.__active"),
                   _has("deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator"
                        ".release_backward_leftovers")),
    ),
    "zero3-forward-outside-trace": Patch(
        target="deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator._invalidate_trace",
        why="ZeRO-3 takes the module order of the first forward it sees as the trace it prefetches by; the vLLM sync "
            "check's forward, run before a process's first training forward (its first sync, the one after every "
            "resume), became that trace, and TRL's training forward, which gathers lm_head's weight itself, met it "
            "prefetched and in flight ('Cannot partition a param in flight')",
        upstream="none filed: DeepSpeed has no public way to run a forward outside the trace it records",
        remove_when="DeepSpeed offers a forward that neither records nor follows the trace (or re-records on a miss "
                    "without prefetching)",
        guard=_all(_has("deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator."
                        "_invalidate_trace"),
                   _has("deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator."
                        "is_invalid_trace")),
    ),
    "partitioned-adapter-dtype": Patch(
        target="deepspeed.runtime.zero.partition_parameters.Init (each parameter's ds_tensor)",
        why="a ZeRO-3 partition keeps its own copy of the values: casting a QLoRA adapter parameter must cast its "
            "shard too, or the next gather mixes dtypes (trl#6089)",
        upstream="trl#6089",
        remove_when="TRL gives a quantized model's adapter the base's compute dtype under DeepSpeed",
        guard=_has("deepspeed.runtime.zero.partition_parameters.Init"),
    ),
    "deferred-checkpoint-files": Patch(
        target="torch.save and torch.distributed.checkpoint.save, on the training thread while a background "
               "checkpoint's parts are copied",
        why="Trainer, DeepSpeed's engine and accelerate write the optimizer, scheduler, RNG and ZeRO states of a "
            "checkpoint themselves, in the foreground, with no hook to write them later from a copy",
        upstream="none filed: transformers 5.24 Trainer._save_checkpoint, deepspeed 0.19 engine.save_checkpoint "
                 "(its decoupled engine does not fit: saving/deferred.py says why), accelerate 1.15 "
                 "save_fsdp_optimizer",
        remove_when="Trainer writes a checkpoint's states through a pluggable writer that can stage them",
        guard=_all(_has("torch.save", "obj", "f"),
                   _has("torch.distributed.checkpoint.save", "state_dict", "storage_writer", "planner",
                        "process_group")),
    ),
    "trl-script-classes": Patch(
        target="trl.<Name>Trainer and trl.<Name>Config, while one of trl/scripts/<name>.py runs",
        why="TRL's scripts import their trainer and config from `trl` inside main() and make_parser(); `trl-ext "
            "<name>` runs those scripts unchanged, so the names must resolve to trl_ext's classes while they run",
        upstream="none: TRL's scripts take no trainer class (trl/scripts/sft.py, 1.14-1.16)",
        remove_when="TRL's scripts or CLI accept the trainer class to use",
        guard=_source_has("trl.scripts.sft.main", "from trl import SFTTrainer"),
    ),
    "trl-cli-script": Patch(
        target="trl.cli.accelerate_launcher.launch_training_script",
        why="TRL's training command launches trl/scripts/<name>.py by file; `trl-ext <name>` keeps TRL's parsing, "
            "--accelerate_config presets and launch options, and launches trl_ext's runner of the same script",
        upstream="none: trl/cli/commands/training.py (1.14-1.16) imports the launcher inside run()",
        remove_when="TRL's CLI takes the script to launch",
        guard=_all(_has("trl.cli.accelerate_launcher.launch_training_script", "script_name", "launch_args",
                        "training_script_args"),
                   _source_has("trl.cli.commands.training.TrainingCommand.run",
                               "from ..accelerate_launcher import launch_training_script")),
    ),
    "zero3-universal-load": Patch(
        target="deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
               ".load_hp_checkpoint_state_from_checkpoint_dir_stage3",
        why="loading a universal checkpoint under ZeRO-3 gives every sub-group of the optimizer one shared Adam step "
            "tensor, which torch's AdamW then advances once per sub-group (a full fine-tuning has two: its norms are "
            "not decayed), so Adam's bias correction runs ahead after a resume on another number of processes; and "
            "every parameter group gets the first group's hyperparameters (the no-decay group's weight_decay)",
        upstream="none filed; came with DeepSpeed PR #7585 (issue #7584, ZeRO-3 universal checkpoints with several "
                 "sub-groups), 0.18.0; still in main on 2026-08-22",
        remove_when="DeepSpeed's ZeRO-3 universal loader gives each sub-group its own step and each parameter group "
                    "its own saved hyperparameters",
        guard=_all(_source_has("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
                               ".load_hp_checkpoint_state_from_checkpoint_dir_stage3",
                               "self.optimizer.state[fp32_param]['step'] = state_step\n"),
                   _source_has("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.__init__",
                               "self.fp32_partitioned_groups_flat = []")),
    ),
    "accelerate-launch-environment": Patch(
        target="accelerate.commands.launch.{deepspeed,multi_gpu,simple}_launcher",
        why="a rank that torchrun, a Kubeflow pod or Ray Train started applies the accelerate config named with "
            "--config in its own process: accelerate's launch command translates the config into its processes' "
            "environment (prepare_*_env) and then starts them; the starting is replaced by recording that environment",
        upstream="none: accelerate has no public function from a config to its processes' environment (1.13-1.15)",
        remove_when="accelerate exposes the environment its launch command computes",
        guard=_all(_has("accelerate.commands.launch.launch_command", "args"),
                   _has("accelerate.commands.launch.deepspeed_launcher", "args"),
                   _has("accelerate.commands.launch.multi_gpu_launcher", "args"),
                   _has("accelerate.commands.launch.simple_launcher", "args"),
                   _has("accelerate.utils.launch.prepare_deepspeed_cmd_env", "args"),
                   _has("accelerate.utils.launch.prepare_multi_gpu_env", "args"),
                   _has("accelerate.utils.launch.prepare_simple_launcher_cmd_env", "args")),
    ),
    "exit-before-thread-pools": Patch(
        target="threading._register_atexit (process.before_exit)",
        why="uploads still queued when a script returns must run before the interpreter shuts concurrent.futures' and "
            "asyncio's thread pools ('cannot schedule new futures after interpreter shutdown'); atexit callbacks run "
            "after that, and a non-daemon thread is joined after it: only threading's own exit hooks run before",
        upstream="none: CPython has no public hook that runs before threads are joined (concurrent.futures uses this "
                 "one since 3.9, bpo-39812)",
        remove_when="CPython offers a public exit hook that runs before its thread pools shut down",
        guard=_has("threading._register_atexit"),
    ),
    "exit-threads-now": Patch(
        target="threading._shutdown (process.exit_now)",
        why="a gloo rank ends with os._exit(0), skipping the interpreter's teardown, where gloo can abort and fail a "
            "launch whose work is done (pytorch#190489); first it must do the interpreter's first exit step, which "
            "runs threading's exit hooks (concurrent.futures' stops its pools' workers) and then joins the "
            "non-daemon threads: joined without that hook, an idle pool's workers never end",
        upstream="pytorch#190489 (gloo's abort at shutdown); none for threading: CPython runs this step only at exit",
        remove_when="pytorch#190489 is fixed, so that a gloo rank can exit as the interpreter does",
        guard=_has("threading._shutdown"),
    ),
    "exit-callbacks-now": Patch(
        target="atexit._run_exitfuncs (process.exit_now)",
        why="a gloo rank ends with os._exit(0), skipping the interpreter's teardown, where gloo can abort and fail a "
            "launch whose work is done (pytorch#190489); atexit's callbacks (logging's flush, trackers' finish) must "
            "run first, and atexit has no public function that runs them",
        upstream="pytorch#190489 (gloo's abort at shutdown); none for atexit: CPython runs its callbacks only at exit",
        remove_when="pytorch#190489 is fixed, so that a gloo rank can exit as the interpreter does",
        guard=_has("atexit._run_exitfuncs"),
    ),
    "ray-fresh-cluster-view": Patch(
        target="ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator._AutoscalingCoordinatorActor"
               ".get_reserved_resources(recompute=True), called once a lost node is marked dead, and before a group "
               "that stopped to grow starts again",
        why="Ray Train's elastic policy sizes a restarted worker group from the AutoscalingCoordinator's view of the "
            "cluster, refreshed every 20 s: right after a node is lost it still counts the dead node, asks for "
            "workers that cannot start, and waits out a whole start timeout before it tries again with the nodes left; "
            "right after a node joins it may not count it yet, and a group that stopped to grow came back at its old "
            "size",
        upstream="none filed: ray 2.60 train/v2/_internal/execution/scaling_policy/elastic.py reads "
                 "get_reserved_resources without recompute",
        remove_when="Ray Train's elastic policy recomputes the coordinator's view after a worker group fails",
        guard=_all(_has("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator"
                        "._AutoscalingCoordinatorActor.get_reserved_resources", "requester_id", "recompute"),
                   _has("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator"
                        ".get_or_create_autoscaling_coordinator")),
    ),
    "elastic-first-round": Patch(
        target="torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous, "
               "with the settings its handler, op executor and state holder keep (_settings), the first round told "
               "by the shared state (_state_holder.state: round 0, not complete), in an elastic pod's "
               "torchrun process",
        why="torchrun's c10d rendezvous has one last_call_timeout for every round: 30 s by default, most of a lost "
            "machine's recovery, while 2 s lets a first round start before pods that come seconds later, fixing a "
            "global batch that the grown world may not divide",
        upstream="none filed: torch 2.13 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py reads "
                 "settings.timeout.last_call for every round",
        remove_when="torchrun's rendezvous takes a separate wait for its first round",
        guard=_all(_has("torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler"
                        ".next_rendezvous"),
                   _has("torch.distributed.elastic.rendezvous.dynamic_rendezvous.RendezvousTimeout",
                        "join", "last_call", "close", "heartbeat"),
                   _source_has("torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler"
                               ".__init__", "self._op_executor = _DistributedRendezvousOpExecutor"),
                   _has("torch.distributed.elastic.rendezvous.dynamic_rendezvous._BackendRendezvousStateHolder.sync"),
                   _source_has("torch.distributed.elastic.rendezvous.dynamic_rendezvous._RendezvousState.__init__",
                               "self.round = 0")),
    ),
    "ray-standby-workers": Patch(
        target="ray.core.generated.node_manager_pb2_grpc.NodeManagerServiceStub.PrestartWorkers over "
               "ray._private.grpc_utils.init_grpc_channel, called on a node's first rank after a worker group's first "
               "step; and Ray's setup-hook variable (ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR) set "
               "to a module path in the group's runtime environment",
        why="Ray Train ends every worker of a lost group and starts new processes, which import Ray, torch, "
            "transformers and TRL before the first step: 24.6 s of a 29.7-s recovery here; Ray prestarts idle "
            "workers for a job only through its raylet's RPC",
        upstream="none filed: ray 2.60 has the raylet's PrestartWorkers RPC and the setup hook, but no Python call "
                 "that prestarts workers for a runtime environment",
        remove_when="Ray offers a public call that prestarts workers for a job's runtime environment, or Ray Train "
                    "keeps spare workers itself",
        guard=_all(_has("ray._private.grpc_utils.init_grpc_channel", "address"),
                   _has("ray.core.generated.node_manager_pb2_grpc.NodeManagerServiceStub"),
                   _has("ray.core.generated.node_manager_pb2.PrestartWorkersRequest"),
                   _has("ray.core.generated.runtime_environment_pb2.RuntimeEnvInfo"),
                   _has("ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR"),
                   _has("ray._private.runtime_env.setup_hook.load_and_execute_setup_hook_module")),
    ),
    "ray-unregister-lost-node": Patch(
        target="ray.core.generated.gcs_service_pb2_grpc.NodeInfoGcsServiceStub.UnregisterNode over "
               "ray._private.grpc_utils.init_grpc_channel, called on the Ray Train controller for a node whose workers "
               "were unreachable and whose raylet takes no connection",
        why="Ray marks a node dead only once its health checks miss (3 s x 5 at Ray's defaults, the cluster's "
            "setting): until then the worker group cannot restart on the nodes left, 10.8 s of a 26.9-s recovery",
        upstream="none filed: ray 2.60 has no public call that reports a node dead (GcsClient.drain_nodes asks the "
                 "node's raylet to shut down, and a dead raylet's node stays alive until the health checks miss)",
        remove_when="Ray offers a public call that reports a node dead, or marks one dead when its raylet refuses "
                    "connections",
        guard=_all(_has("ray._private.grpc_utils.init_grpc_channel", "address"),
                   _has("ray.core.generated.gcs_service_pb2_grpc.NodeInfoGcsServiceServicer.UnregisterNode"),
                   _has("ray.core.generated.gcs_service_pb2.UnregisterNodeRequest"),
                   _has("ray.core.generated.common_pb2.NodeDeathInfo.UNEXPECTED_TERMINATION")),
    ),
    "checkpoint-wrapper": Patch(
        target="torch.distributed.algorithms._checkpoint.checkpoint_wrapper (CheckpointWrapper, CheckpointImpl, "
               "_CHECKPOINT_PREFIX), read",
        why="FSDP's activation checkpointing (fsdp_activation_checkpointing) wraps each decoder layer in torch's "
            "CheckpointWrapper: the save plan strips the wrapper's prefix from module names (PEFT finds adapter "
            "weights by module name), and the FSDP check counts the layers it wraps non-reentrantly",
        upstream="none: torch 2.13 has the wrapper in a private module only (accelerate imports it from there too)",
        remove_when="torch makes checkpoint_wrapper public",
        guard=_all(_has("torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX"),
                   _has("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper"),
                   _has("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointImpl.NO_REENTRANT")),
    ),
    "storage-identity": Patch(
        target="torch.UntypedStorage._cdata, read",
        why="a background checkpoint copies each storage once, whichever tensor meets it first; _cdata is the identity "
            "torch.save itself keys storages by (several Python storage objects can stand for one)",
        upstream="none: torch 2.13 gives storages no public identity (torch/serialization.py uses _cdata)",
        remove_when="torch gives storages a public identity",
        guard=_has("torch.UntypedStorage._cdata"),
    ),
    "dtensor-local-tensor": Patch(
        target="torch.distributed.tensor.DTensor._local_tensor, read",
        why="a background checkpoint copies an FSDP2 parameter's own shard, the same tensor object at every "
            "checkpoint: to_local() returns a new view of a Parameter(DTensor)'s shard at every call (torch gh-166156)",
        upstream="torch gh-166156 (to_local of a Parameter(DTensor) returns a Parameter: a fresh view in torch 2.13)",
        remove_when="DTensor.to_local returns the shard itself for a parameter",
        guard=_has("torch.distributed.tensor.DTensor.to_local"),  # _local_tensor is an instance slot: probed on use
    ),
    "module-own-tensors": Patch(
        target="torch.nn.Module._parameters, _buffers and _non_persistent_buffers_set, read",
        why="a module's own saved tensors read without its state-dict hooks: FSDP2's reshard the unit, so inside "
            "FsdpUnits.unsharded they would return its shards; no public API says which buffers are persistent",
        upstream="none: torch 2.13's public state_dict runs the hooks",
        remove_when="torch says which buffers are persistent without running the state-dict hooks",
        guard=lambda: all(hasattr(__import__("torch").nn.Module(), name)
                          for name in ("_parameters", "_buffers", "_non_persistent_buffers_set")),
    ),
    "model-from-config": Patch(
        target="transformers.PreTrainedModel._from_config, called",
        why="a model of the exact class its config names, built on the meta device as from_pretrained would build it "
            "(dtype, attention implementation); the public from_config is the Auto classes' only",
        upstream="none: transformers 5.23 documents _from_config as the class-level equivalent of from_config",
        remove_when="transformers gives model classes a public from_config",
        guard=_has("transformers.modeling_utils.PreTrainedModel._from_config", "config"),
    ),
    "dataset-preparation-refusal": Patch(
        target="trl.<Name>Trainer._prepare_dataset of each trainer that takes a dataset kind, overridden",
        why="TRL prepares the rows inside its constructor and raises what the tokenizer or a map says; the trainers "
            "wrap it to say, in one line, which rows TRL cannot prepare (or prepares into nothing)",
        upstream="none: TRL has no public dataset check",
        remove_when="TRL says which rows it cannot prepare",
        guard=lambda: all(_has(f"{trl_class}._prepare_dataset", "dataset")() for trl_class in DATASET_PREPARERS),
    ),
    "jit-checkpoint-sigterm-handler": Patch(
        target="transformers.trainer_jit_checkpoint.CheckpointManager._original_sigterm_handler, read",
        why="with enable_jit_checkpoint transformers replaces the SIGTERM handler; trl_ext's preemption replaces its "
            "callback and must put back the handler it replaced",
        upstream="none: transformers 5.23 keeps the replaced handler private",
        remove_when="transformers' JIT checkpointing restores the handler when its callback is removed",
        guard=_source_has("transformers.trainer_jit_checkpoint.CheckpointManager", "self._original_sigterm_handler"),
    ),
    "parser-destinations": Patch(
        target="argparse.ArgumentParser._actions, read",
        why="a recipe's parser is asked which options it declares (their destinations) before it parses: argparse "
            "has no public list of them",
        upstream="none: CPython's argparse (3.11-3.13) keeps its actions private",
        remove_when="argparse lists a parser's actions publicly",
        guard=lambda: isinstance(getattr(__import__("argparse").ArgumentParser(), "_actions", None), list),
    ),
}


@functools.cache
def applies(name: str) -> bool:
    """Whether patch ``name`` applies to the installed releases (its guard), said once if it does not.

    Args:
        name: a key of ``PATCHES``.

    Returns:
        True where the patch can be applied; False (after one notice) where the release moved its target.
    """
    patch = PATCHES[name]
    try:
        ok = bool(patch.guard())
    except Exception:  # noqa: BLE001 - a probe that fails means the internals moved
        ok = False
    if not ok:
        logger.warning(f"[trl_ext] {patch.target} is not what trl_ext expects in the installed release: skipping the "
                       f"'{name}' fix ({patch.why}). Upstream: {patch.upstream}.")
    return ok


@contextlib.contextmanager
def swapped(name: str, owner, attribute: str, replacement):
    """``owner.attribute`` replaced by ``replacement`` inside the block, restored after it (patch ``name``).

    Args:
        name: the patch, a key of ``PATCHES``.
        owner: the module, class or object whose attribute is replaced.
        attribute: the attribute's name.
        replacement: the value inside the block.
    """
    if not applies(name):
        yield
        return
    had = attribute in vars(owner) if hasattr(owner, "__dict__") else True
    original = vars(owner)[attribute] if had and hasattr(owner, "__dict__") else getattr(owner, attribute, None)
    setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        if had:
            setattr(owner, attribute, original)
        else:
            delattr(owner, attribute)  # the instance falls back to its class's attribute again


def setting(name: str, owner, attribute: str, value) -> bool:
    """Set ``owner.attribute = value`` for good (patch ``name``), if the patch applies. Returns whether it was set."""
    if not applies(name):
        return False
    setattr(owner, attribute, value)
    return True
