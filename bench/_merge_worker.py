"""One side of bench/merge.py, in its own process: build the base and adapter, or merge them one way.

    python bench/_merge_worker.py build   --base DIR --adapter DIR [--layers 22]
    python bench/_merge_worker.py peft    --base DIR --adapter DIR --out DIR   # PEFT merge_and_unload + save
    python bench/_merge_worker.py trl_ext --base DIR --adapter DIR --out DIR   # trl-ext merge (the CLI's code path)

Prints ``BENCH {json}``: the time after imports and the RSS then (what the imports cost), so the parent can tell the
merge's own memory from the interpreter's.
"""

import argparse
import json
import time

import psutil


def build(base: str, adapter: str, layers: int) -> dict:
    """A TinyLlama-1.1B-shaped Llama, random bf16 weights, saved as transformers saves it; a rank-64 all-linear LoRA."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                         max_position_embeddings=2048, dtype=torch.bfloat16)
    with torch.device("meta"):  # transformers' own init of 1.1B parameters takes minutes on 2 cores
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02, generator=generator)
    model.save_pretrained(base)
    params = sum(p.numel() for p in model.parameters())
    lora = LoraConfig(r=64, lora_alpha=128, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(adapter)
    lora_params = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    return {"params": params, "adapter_params": lora_params}


def peft_merge(base: str, adapter: str, out: str) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)


def trl_ext_merge(base: str, adapter: str, out: str) -> None:
    from trl_ext.cli import main

    if main(["merge", "--adapter", adapter, "--base", base, "--out", out]) != 0:
        raise SystemExit("trl-ext merge failed")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["build", "peft", "trl_ext"])
    parser.add_argument("--base", required=True)
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--out")
    parser.add_argument("--layers", type=int, default=22)
    cli = parser.parse_args()
    # What each side imports, before the clock starts: the same for a user running either.
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    if cli.mode == "trl_ext":
        import trl_ext.cli  # noqa: F401 - the CLI's own imports (trl_ext's package pulls in trl)
        import trl_ext.merge_stream  # noqa: F401
    imported = psutil.Process().memory_info().rss
    started = time.monotonic()
    result = {}
    if cli.mode == "build":
        result = build(cli.base, cli.adapter, cli.layers)
    elif cli.mode == "peft":
        peft_merge(cli.base, cli.adapter, cli.out)
    else:
        trl_ext_merge(cli.base, cli.adapter, cli.out)
    result.update(seconds=time.monotonic() - started, rss_after_imports=imported)
    print("BENCH " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
