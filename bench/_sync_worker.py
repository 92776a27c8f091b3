"""One vLLM weight sync under 2-process ZeRO-3 with LoRA: trl_ext's walk or TRL 1.16's own (``_iter_named_params``).

Trains one step (so the DeepSpeed engine exists and parameters are partitioned, as in a GRPO run), then runs the walk
that ``VLLMGeneration.sync_weights`` feeds to vLLM, with a consumer that drops each tensor (vLLM copies it into its own
preallocated weights, which are not this process's memory). With ``--vllm`` (the vLLM venv) the consumer is a
real colocated vLLM in each rank, as trl_ext's sync drives it (``LLM.collective_rpc("reload_weights",
weights_iterator=walk)``): the growth then includes what vLLM's reload allocates (the same for both walks). Rank 0
prints ``BENCH {json}``: its peak RSS growth during the walk over the level just before, read exactly from the
kernel (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), plus the walk's wall time and the number of
tensors sent.
"""

import argparse
import ctypes
import gc
import json
import time
from types import SimpleNamespace

import torch
from datasets import Dataset
from peft import LoraConfig
from trl.distributed import DistributedBackend
from trl.generation.vllm_generation import VLLMGeneration

import trl_ext
from trl_ext.trainers.weight_sync import BoundedVLLMGeneration


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["trl_ext", "trl"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--trace", action="store_true", help="record RSS growth after each tensor")
    parser.add_argument("--vllm", action="store_true", help="a real colocated vLLM takes the walk")
    cli = parser.parse_args()

    args = trl_ext.SFTConfig(output_dir=cli.output_dir, max_steps=1, per_device_train_batch_size=1,
                             report_to="none", save_strategy="no", gradient_checkpointing=False, max_length=32)
    data = Dataset.from_list([{"messages": [{"role": "user", "content": "1+1"},
                                            {"role": "assistant", "content": "2"}]}] * 4)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"])
    trainer = trl_ext.SFTTrainer(model=cli.model, args=args, train_dataset=data, peft_config=lora)
    trainer.train()

    generation_class = BoundedVLLMGeneration if cli.impl == "trl_ext" else VLLMGeneration
    generation = generation_class.__new__(generation_class)  # the walk only: vLLM cannot run on CPU
    generation.model = trainer.model
    generation.accelerator = SimpleNamespace(device=torch.device("cpu"))
    generation._dist = DistributedBackend(trainer.accelerator)
    assert generation._dist.is_zero3

    llm = None
    if cli.vllm:  # as TRL's colocate mode builds it (external_launcher: the worker runs in this process)
        from vllm import LLM

        llm = LLM(model=cli.model, dtype="float32", enforce_eager=True,
                  distributed_executor_backend="external_launcher", max_model_len=256, max_num_batched_tokens=4096,
                  seed=trainer.accelerator.process_index)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    torch.distributed.barrier()
    base = rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    start = time.perf_counter()
    sent = 0
    trace = []

    def walk():
        nonlocal sent
        for name, tensor in generation._iter_named_params():
            sent += 1
            yield name, tensor
            del tensor
            if cli.trace:
                trace.append((name, rss_kib("VmRSS") - base))

    if llm is not None:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": walk(), "is_checkpoint_format": True})
    else:
        for _ in walk():
            pass
    elapsed = time.perf_counter() - start
    peak = rss_kib("VmHWM")
    check_s = None
    if llm is not None:  # what trl_ext's proof of the sync costs on this model (sync_check: both sides' logprobs)
        from trl_ext.trainers import sync_check

        check = sync_check.SyncCheck(1, 1e-3, trainer.model.config.vocab_size)
        for _ in range(2):  # the first includes the engine's first request
            check.verify(llm, trainer.model, torch.device("cpu"), {}, lambda: iter(()), "in the bench")
        check_s = check.seconds
    torch.distributed.barrier()
    if trainer.accelerator.is_main_process:
        params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainer.model.parameters())
        print("BENCH " + json.dumps({"sync_s": elapsed, "peak_growth_mb": (peak - base) / 1024, "tensors": sent,
                                     "params": params, "check_s": check_s}), flush=True)
        for name, kib in trace:
            print(f"TRACE {name} +{kib / 1024:.0f} MiB")
    if llm is not None:  # vLLM's own teardown while its group is alive, as trl_ext's colocated sync does at exit
        llm.llm_engine.engine_core.shutdown()
    trl_ext.process.end_together()


if __name__ == "__main__":
    main()
