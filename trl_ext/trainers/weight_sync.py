"""The weight sync from the trained policy into vLLM (GRPO, RLOO), bounded to one module at a time.

TRL 1.16's ``VLLMGeneration._iter_named_params`` gathers every parameter of a PEFT model at once under ZeRO-3 to merge
the adapter (trl#5766: the whole model on every rank), and renames by string rules (strip ``base_model.model.`` and
``.base_layer``), which gives in-memory names: fused MoE experts and ``model.language_model.*`` prefixes that are not
the checkpoint names vLLM's ``load_weights`` takes. ``BoundedVLLMGeneration`` replaces only that walk with
``merge.iter_merged_weights``: gather one module, merge its adapter, yield the names and layout ``save_pretrained``
writes (which vLLM loads from disk by construction), release.

Colocate mode loads the stream through vLLM's own weight-reload API (``LLM.collective_rpc("reload_weights",
weights_iterator=...)``: the model runner puts each layer back into its loading state, loads, and processes it again).
TRL calls ``model.load_weights`` on the running model, which fails once vLLM has processed its layers (on CPU:
``'Parameter' object has no attribute 'weight_loader'``). The sync is then proven (``sync_check``): after the first
sync and every ``vllm_check_sync_every``-th, vLLM's prompt log-probabilities must equal the trainer's. Server mode
stays TRL's ``sync_weights`` (waking the weights from sleep mode before loading, trl#5312 / trl#5142, and the
prefix-cache reset are TRL's in both modes).

In server mode it also bounds every wait on the server (``vllm_server``): its client times out, its NCCL parts run
under a watchdog, and a failure names the training step.
"""

import contextlib
import functools
import sys
import time
import weakref
from collections.abc import Iterator

import torch
from trl.generation.vllm_generation import VLLMGeneration, empty_cache

from trl_ext import patches
from trl_ext.engines.gradient_checkpointing import zero3_offload
from trl_ext.errors import ServerError
from trl_ext.merge.weights import iter_merged_weights
from trl_ext.process.clean_exit import before_exit
from trl_ext.process.notices import notice
from trl_ext.settings.trainer_options import VLLMServerOptions, VLLMSyncCheckOptions
from trl_ext.trainers.sync_check import SyncCheck, checksums


def engine_dtype(generation: VLLMGeneration) -> torch.dtype | None:
    """The dtype of the colocated vLLM engine's weights, or None when unknown (server mode): then tensors are sent
    in the policy's dtype and vLLM's loader casts them, as with TRL's own walk."""
    dtype = getattr(getattr(getattr(getattr(generation, "llm", None), "llm_engine", None), "model_config", None),
                    "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def bounded_named_params(generation: VLLMGeneration) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for vLLM's ``load_weights``: merged, in the Hub's layout, one module gathered at a time.

    Args:
        generation: TRL's ``VLLMGeneration`` (its ``model`` is the policy: a PEFT or plain transformers model).

    Yields:
        Hub-named tensors on the training device, in the engine's dtype when known. Tied weights come once.
    """
    dtype = engine_dtype(generation)
    device = generation.accelerator.device
    for name, tensor in iter_merged_weights(generation.model):
        yield name, tensor.to(device=device, dtype=dtype or tensor.dtype)


def engine_reloads() -> bool:
    """Whether the installed vLLM's model runner reloads weights from an iterator (``reload_weights(weights_iterator=,
    is_checkpoint_format=)``, vLLM 0.31); older ones keep TRL's ``load_weights`` path."""
    try:
        import inspect

        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    parameters = inspect.signature(getattr(GPUModelRunner, "reload_weights", lambda: None)).parameters
    return {"weights_iterator", "is_checkpoint_format"} <= set(parameters)


def reprocess_after_reload(worker, tied_heads: bool, moe_experts: bool) -> list[str]:
    """Run in vLLM's CPU worker after ``reload_weights``: the layers whose packed weights its layerwise reload left
    stale, processed again from the weights just loaded.

    Args:
        worker: vLLM's worker (``collective_rpc`` passes it).
        tied_heads: each embedding layer that shares its weight with another (a tied LM head and its input
            embeddings) processed again: it received no weight of its own, so the reload kept its packed GEMM weight
            (patch ``vllm-cpu-tied-head``).
        moe_experts: the CPU experts' weights packed again: on a weight update vLLM copies the loaded weights, not
            packed, into the packed ones (patch ``vllm-cpu-moe-reload``).

    Returns:
        The names of the layers processed again.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    sharing: dict[int, list] = {}
    names = []
    for name, module in worker.model_runner.get_model().named_modules(remove_duplicate=False):
        method = getattr(module, "quant_method", None)
        if tied_heads and isinstance(module, VocabParallelEmbedding) and isinstance(method, UnquantizedEmbeddingMethod):
            sharing.setdefault(id(module.weight), []).append((name, module))
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if moe_experts and isinstance(method, UnquantizedFusedMoEMethod) and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            names.append(name)
    for name, module in (pair for group in sharing.values() if len(group) > 1 for pair in group):
        module.quant_method.process_weights_after_loading(module)
        names.append(name)
    return names


def _recording(stream, sums: dict):
    """Pass ``stream`` through, adding each tensor's checksums to ``sums``."""
    for name, tensor in stream:
        sums.update(checksums([(name, tensor)]))
        yield name, tensor


def _is_quantized(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_quantized", False))


class BoundedVLLMGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` with the bounded, Hub-named parameter walk (see the module docstring).

    FSDP1 (TRL walks its flat parameters module by module) and quantized bases (4-bit weights merge in TRL's
    ``merge_adapter``) keep TRL's walk. Under FSDP2 the bounded walk unshards one FSDP unit at a time.

    Args:
        *args, **kwargs: TRL's ``VLLMGeneration`` arguments.
        request_timeout: server mode's bound on each wait for the server, in seconds (``vllm_request_timeout``).
    """

    def __init__(self, *args, request_timeout: float = VLLMServerOptions.vllm_request_timeout,
                 check_every: int = VLLMSyncCheckOptions.vllm_check_sync_every,
                 check_atol: float = VLLMSyncCheckOptions.vllm_check_sync_atol, **kwargs):
        self.request_timeout = request_timeout
        self.current_step = lambda: None  # the trainer sets it: the step a failure is reported at
        self.on_sync = lambda checked: None  # the trainer sets it: whether each colocated sync was checked
        super().__init__(*args, **kwargs)
        self.sync_check = SyncCheck(check_every, check_atol, self.model.config.vocab_size)
        self.sync_seconds: list[float] = []  # each colocated sync's wall time, its check included

    @classmethod
    def with_timeout(cls, request_timeout: float, check_every: int, check_atol: float):
        """The class as TRL's trainers call it, with ``request_timeout`` and the sync check's options bound."""
        return functools.partial(cls, request_timeout=request_timeout, check_every=check_every,
                                 check_atol=check_atol)

    def _at_step(self) -> str:
        step = self.current_step()
        return "before training" if step is None else f"at training step {step}"

    def _init_vllm(self):
        if self.mode == "colocate":  # weakly: a notebook's later trainer must not keep this engine's memory alive
            shut_down = weakref.WeakMethod(self._shut_down_colocated)
            before_exit(lambda: (method := shut_down()) and method())
        if self.mode == "colocate" and self.accelerator.device.type == "cpu":
            # vLLM's CPU build runs fp32 checkpoints in bf16 unless told: the engine gets the policy's dtype
            module = sys.modules[VLLMGeneration.__module__]
            engine = functools.partial(module.LLM, dtype=self.model.dtype) if hasattr(module, "LLM") else None
            with patches.swapped("vllm-cpu-dtype", module, "LLM", engine) if engine else contextlib.nullcontext():
                return super()._init_vllm()
        if self.mode != "server":
            return super()._init_vllm()
        from trl_ext.trainers import vllm_server  # needs requests, which server mode has

        client = functools.partial(vllm_server.BoundedVLLMClient, request_timeout=self.request_timeout)
        with (patches.swapped("bounded-vllm-client", sys.modules[VLLMGeneration.__module__], "VLLMClient", client),
              self._bounded("joining the server's weight-transfer group", nccl=True)):
            return super()._init_vllm()

    def _shut_down_colocated(self) -> None:
        """As the process exits, before trl_ext's exit hooks destroy the process group: the colocated engine shut down
        through its own ``shutdown`` (which tears down vLLM's groups and the default one). Left to vLLM's finalizer,
        which runs after those hooks, it printed a traceback at every exit ("Invalid process group specified")."""
        client = getattr(getattr(getattr(self, "llm", None), "llm_engine", None), "engine_core", None)
        if callable(getattr(client, "shutdown", None)):
            client.shutdown()

    @contextlib.contextmanager
    def _bounded(self, doing: str, nccl: bool = False):
        """Server mode, on the process that talks to the server: ``ServerError`` gets the step; with ``nccl``, the
        block runs under the watchdog, whose bound leaves the block's own HTTP timeouts room to fire first."""
        if self.mode != "server" or not self.accelerator.is_main_process:
            yield
            return
        from trl_ext.trainers import vllm_server

        bound = self.request_timeout + vllm_server.WATCHDOG_GRACE

        def expired() -> str:
            client = getattr(self, "vllm_client", None)
            failure = getattr(client, "last_failure", None)
            server = getattr(client, "base_url", "the configured address")
            return (f"the vLLM server at {server} did not finish {doing} within {bound:g} s (vllm_request_timeout "
                    f"+ {vllm_server.WATCHDOG_GRACE:g} s), {self._at_step()}" + (f"; {failure}" if failure else "")
                    + ". Ending this process: NCCL's wait cannot be interrupted. Checkpoints already saved are "
                    "intact; check the server's log, and resume with resume_from_checkpoint=True.")

        try:
            with vllm_server.watchdog(bound, expired) if nccl else contextlib.nullcontext():
                yield
        except ServerError as exc:
            raise ServerError(f"{exc} While {doing}, {self._at_step()}. Checkpoints already saved are intact; "
                              f"check the server's log, and resume with resume_from_checkpoint=True.") from None

    def sync_weights(self):
        if self.mode == "colocate" and engine_reloads():
            return self._sync_colocated()
        with self._bounded("the weight sync", nccl=True):
            return super().sync_weights()

    @contextlib.contextmanager
    def _outside_zero3_trace(self):
        """Under ZeRO-3, the check's forward is no training step: the trace DeepSpeed prefetches by is forgotten after
        it, so that the next training forward records its own (patch ``zero3-forward-outside-trace``). Without it,
        a check before the process's first training forward (its first sync, resumed or not) became the trace."""
        try:
            yield
        finally:
            wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
            offload = zero3_offload(getattr(getattr(wrapped, "engine", None), "optimizer", None))
            if offload is not None:
                forget_zero3_trace(offload.get_param_coordinator())

    def _sync_colocated(self):
        """Load the merged, Hub-named stream through vLLM's ``reload_weights``, then prove it landed (if due)."""
        start = time.perf_counter()
        if self.enable_sleep_mode:  # as TRL's sync_weights: wake the weights before loading them (trl#5142)
            empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        checked = self.sync_check.due()
        sent: dict[str, tuple[float, float]] = {}
        stream = _recording(self._iter_named_params(), sent) if checked else self._iter_named_params()
        # vLLM's API for new weights in a loaded model; in colocate mode (external_launcher) the worker runs in this
        # process, so the generator is consumed here, one module gathered at a time, every rank in step.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
        if self.accelerator.device.type == "cpu":  # on CUDA nothing is packed: the layers read their weights
            tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
            fixes = {"tied_heads": tied and patches.applies("vllm-cpu-tied-head"),
                     "moe_experts": patches.applies("vllm-cpu-moe-reload")}
            if any(fixes.values()):
                self.llm.collective_rpc(reprocess_after_reload, kwargs=fixes)
        self.llm.reset_prefix_cache()
        if checked:
            first = not self.sync_check.seconds
            with self._outside_zero3_trace():
                diff = self.sync_check.verify(self.llm, self.model, self.accelerator.device, sent,
                                              self._iter_named_params, self._at_step())
            if first:  # the sync a resumed run generates with, proven
                notice(f"The weight sync into vLLM landed {self._at_step()} (this process's first check): vLLM's "
                       f"prompt log-probabilities equal the trainer's within {diff:.2g}.")
        self.on_sync(checked)
        self.sync_seconds.append(time.perf_counter() - start)

    def generate(self, *args, **kwargs):
        with self._bounded("generating"):
            return super().generate(*args, **kwargs)

    def _iter_named_params(self):
        fsdp1 = self._dist.is_fsdp and getattr(self._dist, "fsdp_version", 1) != 2
        if fsdp1 or _is_quantized(self.model):
            yield from super()._iter_named_params()
        else:
            yield from bounded_named_params(self)


def forget_zero3_trace(coordinator) -> bool:
    """After a forward that is not a training step (the vLLM sync check's), forget the module order ZeRO-3 recorded
    or followed, so that the next training forward records its own (patch ``zero3-forward-outside-trace``).

    Args:
        coordinator: the engine's ``PartitionedParameterCoordinator``.

    Returns:
        Whether the trace was forgotten (False where the patch does not apply).
    """
    if not patches.applies("zero3-forward-outside-trace"):
        return False
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    return True
