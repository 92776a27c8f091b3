"""``trl-ext merge``: merge a LoRA adapter into its base without loading the model, tensor by tensor.

The base checkpoint's safetensors are read lazily; each tensor is copied byte for byte, merged with its LoRA delta
block by block, or replaced by the adapter's copy, and written through the streaming shard writer into a hidden
directory, which is checked and then renamed into place. Peak memory is the adapter's largest factors plus a few
``BLOCK_BYTES`` buffers, whatever the size of the base: not even one whole base tensor is held. The model is never
instantiated, except on the meta device (names and shapes). ``trl_ext.merge.merge`` is the in-memory merge, for
models already loaded and the cases this one refuses.
"""

import contextlib
import copy
import json
import os
import resource
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from trl_ext.data.model_paths import check_model_path
from trl_ext.errors import AdapterError, MergeError, PlanError, UnreadableCheckpoint
from trl_ext.files import audit, commit, hub_names, readback
from trl_ext.files.reader import SafetensorsReader
from trl_ext.files.shards import ShardStreamWriter, index_json, plan_shards
from trl_ext.merge import inputs
from trl_ext.merge.lora_deltas import Adapter, RowMerger, load_adapter, merge_bias
from trl_ext.merge.plan import MergePlan, Output, build_plan

BLOCK_BYTES = 8 * 2**20  # one read and write of a copied tensor
MERGE_BLOCK_BYTES = 2 * 2**20  # rows merged at once: the check's float64 copy of them; the delta and block are smaller
PROBE_MAX_BYTES = 256 * 2**20  # bases up to this size also get the end-to-end check (both models loaded)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
NOT_COPIED = {"config.json", "README.md", "adapter_config.json"}


@dataclass
class MergeReport:
    """What a streamed merge did."""

    path: Path
    tensors: int
    merged: int  # tensors that received a LoRA delta
    nbytes: int
    seconds: float
    peak_rss: int  # this process's peak resident memory, bytes
    worst_check: float  # largest |W'x - (Wx + s B(Ax))| / tolerance over all merged tensors (must stay <= 1)
    probe_diff: float | None  # end-to-end: merged vs adapter model outputs, when run

    def summary(self) -> str:
        probe = "" if self.probe_diff is None else f"; outputs vs the adapter model: max diff {self.probe_diff:.3g}"
        return (f"{self.tensors} tensors ({self.merged} merged, {self.nbytes / 2**30:.2f} GiB) in {self.seconds:.1f}s; "
                f"per-tensor check at {self.worst_check:.2f} of its tolerance{probe}; "
                f"peak RSS {self.peak_rss / 2**30:.2f} GiB")


@dataclass
class _Inputs:
    """Everything a merge needs, checked: the refusals all happen while these are gathered, before any write."""

    adapter: Path
    base: Path
    config: object  # the base's transformers config
    model: torch.nn.Module  # the merged model's class, on the meta device
    reader: SafetensorsReader
    lora: Adapter
    plan: MergePlan
    num_labels: int | None  # a SEQ_CLS adapter's head size
    cast: torch.dtype | None
    new_dtype: torch.dtype  # the base's dtype, for tensors it does not have

    def close(self) -> None:
        self.reader.close()
        self.lora.weights.close()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def locate_base(name: str) -> Path:
    """A local directory, or a Hub id found in the local Hugging Face cache (nothing is downloaded).

    Raises:
        FileNotFoundError: a local path that does not exist.
        MergeError: a Hub id that is not in the cache.
    """
    check_model_path(name)
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError) as exc:
        raise MergeError(f"the base '{name}' is neither a local directory nor in the local Hugging Face cache "
                         f"({type(exc).__name__}); download it first (hf download {name}) or pass --base DIR") from exc


def weight_files(base: Path) -> list[Path]:
    """The base's safetensors files: every shard of ``model.safetensors.index.json``, or ``model.safetensors``.

    Raises:
        MergeError: missing shards, only PyTorch ``.bin`` weights (refused: a pickle is read whole, which is the
            memory use this merge exists to avoid), or no weights at all.
    """
    index = base / audit.FULL_INDEX
    if index.exists():
        files = list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (base / f).exists()]
        if missing:
            raise MergeError(f"the base {base} lists shards that are not there: {', '.join(missing[:3])}")
        return [base / f for f in files]
    if (base / audit.FULL_WEIGHTS).exists():
        return [base / audit.FULL_WEIGHTS]
    if list(base.glob("pytorch_model*.bin")):
        raise MergeError(f"the base {base} has PyTorch .bin weights: the streamed merge reads safetensors only (a "
                         ".bin pickle is loaded whole). Convert it once (from_pretrained + save_pretrained) or merge "
                         "in memory with trl_ext.merge.merge")
    if (base / audit.ADAPTER_WEIGHTS).exists():
        raise MergeError(f"{base} is a PEFT adapter, not a base model; pass the model it was trained on as --base")
    raise MergeError(f"no model.safetensors or {audit.FULL_INDEX} in {base}")


def _meta_model(config, sequence_classification: bool) -> torch.nn.Module:
    """The merged model's class on the meta device: its parameter names and shapes, no memory."""
    import transformers

    if sequence_classification:
        classes = [transformers.AutoModelForSequenceClassification]
    else:
        named = getattr(transformers, (config.architectures or [""])[0], None)
        classes = [c for c in (named, transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText,
                               transformers.AutoModel) if c is not None]
    with torch.device("meta"):
        for cls in classes:
            try:
                return audit.model_from_config(cls, config)
            except ValueError:  # an Auto class without this model type
                continue
    raise MergeError(f"transformers has no model class for {config.model_type} ({config.architectures})")


def _pieces(out: Output, reader: SafetensorsReader, adapter: Adapter) -> Iterator[torch.Tensor]:
    """The bytes of an output tensor that needs no block-wise merge, in order."""
    if out.adapter_source is not None or out.bias_delta is not None:
        values = (adapter.weights.read(out.adapter_source) if out.adapter_source is not None
                  else reader.read(out.source)).to(out.spec.dtype, copy=out.bias_delta is not None)
        yield merge_bias(values, out.bias_delta, adapter.weights) if out.bias_delta is not None else values
    else:
        for chunk in reader.chunks(out.source, BLOCK_BYTES):
            yield chunk.to(out.spec.dtype)


def _merged_blocks(out: Output, reader: SafetensorsReader, adapter: Adapter,
                   merger: RowMerger) -> Iterator[torch.Tensor]:
    """A weight with its LoRA delta merged, in blocks of whole rows (each checked by ``merger``)."""
    rows = out.spec.shape[0]
    step = max(1, MERGE_BLOCK_BYTES // (out.spec.shape[1] * 8))
    held = adapter.weights.read(out.adapter_source) if out.adapter_source is not None else None
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        block = held[start:stop] if held is not None else reader.read_rows(out.source, start, stop)
        yield merger.merge(block.to(out.spec.dtype, copy=held is not None), start)


def _write_tensor(out: Output, writer: ShardStreamWriter, reader: SafetensorsReader, adapter: Adapter,
                  progress) -> float:
    """Stream one output tensor into the writer. Returns its check's ratio to the tolerance (0 without a delta).

    Raises:
        MergeError: a merged weight whose check fails.
    """
    writer.begin(out.spec.name)
    merger = RowMerger(out.delta, adapter.weights, out.spec.shape) if out.delta is not None else None
    for piece in _merged_blocks(out, reader, adapter, merger) if merger else _pieces(out, reader, adapter):
        writer.append(piece)
        progress.update(piece.numel() * piece.element_size())
    writer.end()
    if merger is None:
        return 0.0
    if merger.result.worst_ratio > 1:
        raise MergeError(f"{out.spec.name}: the merged weight fails its check (W'x differs from Wx + s*B(Ax) by "
                         f"{merger.result.max_error:.3g}, {merger.result.worst_ratio:.1f}x the tolerance for "
                         f"{out.spec.dtype}); nothing was written")
    return merger.result.worst_ratio


def _copy_files(base: Path, adapter: Path, partial: Path, generates: bool) -> None:
    """Everything a loader reads beside the weights: the base's files (processor, generation config, custom code,
    license) and the tokenizer, the adapter's when it was saved with one."""
    adapter_tokenizer = (adapter / "tokenizer_config.json").exists()
    for path in sorted(base.iterdir()):
        name = path.name
        if (not path.is_file() or name.startswith(".") or name in NOT_COPIED or name.endswith(WEIGHT_SUFFIXES)
                or name.endswith(".index.json") or (adapter_tokenizer and name in TOKENIZER_FILES)
                or (not generates and name == "generation_config.json")):
            continue
        if name == "generation_config.json":  # written as save_pretrained writes it: stamped with this transformers
            from transformers import GenerationConfig

            GenerationConfig.from_pretrained(base).save_pretrained(partial)
            continue
        shutil.copyfile(path, partial / name)
    if adapter_tokenizer:
        for name in TOKENIZER_FILES:
            if (adapter / name).is_file():
                shutil.copyfile(adapter / name, partial / name)


def _merged_config(config, model, plan: MergePlan, num_labels: int | None, cast, new_dtype, tokenizer_dir: Path):
    config = copy.deepcopy(config)
    config.architectures = [hub_names.model_class(model).__name__]
    text = config.get_text_config()
    if num_labels is not None:
        config.num_labels = num_labels
        if config.pad_token_id is None:  # batched rewards need it to find each row's last token
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            pad = tokenizer.pad_token_id
            config.pad_token_id = pad if pad is not None else tokenizer.eos_token_id
    if plan.vocab_size is not None:
        text.vocab_size = plan.vocab_size
    if plan.untie:
        for target in {id(config): config, id(text): text}.values():
            target.tie_word_embeddings = False
    dtype = cast if cast is not None else new_dtype
    if dtype is not None:  # as from_pretrained(dtype=...) sets it and save_pretrained writes it: sub-configs too
        for target in [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))]:
            if target is not None:
                target.dtype = dtype
    return config


def _probe_outputs(job: _Inputs, merged: Path) -> float:
    """The merged model (plain transformers, from ``merged``) and the adapter model (base + PEFT) on the same token
    ids. Returns the largest difference of their logits.

    Raises:
        MergeError: a difference beyond the tolerance for the dtype (1e-4 in float32, 5e-2 otherwise).
    """
    import transformers
    from peft import PeftModel

    config = transformers.AutoConfig.from_pretrained(merged)
    arch = getattr(transformers, config.architectures[0])
    kwargs = {"dtype": job.cast or "auto"}
    if job.num_labels is not None:
        reference = transformers.AutoModelForSequenceClassification.from_pretrained(job.base, num_labels=job.num_labels,
                                                                                   **kwargs)
        reference.config.pad_token_id = config.pad_token_id
    else:
        reference = arch.from_pretrained(job.base, **kwargs)
    if job.plan.vocab_size is not None:
        reference.resize_token_embeddings(job.plan.vocab_size)
    reference = PeftModel.from_pretrained(reference, job.adapter).eval()
    model = arch.from_pretrained(merged).eval()
    ids = inputs.probe_ids(config)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return inputs.check_outputs(got, want, job.cast or job.new_dtype)


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _gather_inputs(adapter_dir: Path, base: str | None, dtype: str) -> _Inputs:
    """Find and read the base and the adapter, refusing what cannot be merged (``MergeError``, one line)."""
    from transformers import AutoConfig

    adapter_config = inputs.adapter_config(adapter_dir)
    name = inputs.base_name(adapter_config, base)
    base_dir = locate_base(name)
    try:
        config = AutoConfig.from_pretrained(base_dir)
    except (OSError, ValueError) as exc:
        raise MergeError(f"cannot read the base's config.json in {base_dir}: {exc}".splitlines()[0]) from exc
    inputs.refuse_quantized(name, config)
    files = weight_files(base_dir)
    num_labels = inputs.head_outputs(adapter_dir, adapter_config)
    inputs.audit_adapter(adapter_dir, None, num_labels)
    meta_config = copy.deepcopy(config)
    if num_labels is not None:
        meta_config.num_labels = num_labels
    model = _meta_model(meta_config, num_labels is not None)
    try:
        reader = SafetensorsReader(files)
    except UnreadableCheckpoint as exc:
        raise MergeError(f"the base checkpoint in {base_dir} is damaged: {exc}") from exc
    cast, new_dtype = None if dtype == "auto" else getattr(torch, dtype), _config_dtype(config)
    try:
        lora = load_adapter(adapter_dir, model)
        plan = build_plan(reader, model, lora, cast=cast, new_dtype=new_dtype,
                          keep_unknown=type(model).__name__ in (config.architectures or []))
    except (AdapterError, PlanError) as exc:
        reader.close()
        raise MergeError(str(exc)) from exc
    return _Inputs(adapter_dir, base_dir, config, model, reader, lora, plan, num_labels, cast, new_dtype)


@contextlib.contextmanager
def _one_thread():
    """Run torch ops on one thread. The merge's blocks are a few MiB: splitting each across threads costs more in
    synchronization than it saves (a 5632x2048 bf16 weight, r=64, on a busy 2-core machine: 49 ms with one thread,
    850 ms with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _write_files(job: _Inputs, partial: Path, max_shard_size, progress: bool) -> tuple[dict, ShardStreamWriter, float]:
    """Config, tokenizer and other files, then every tensor. Returns the shard plan, the writer (its last file's
    fsync may still run) and the per-tensor checks' worst ratio to their tolerance."""
    from tqdm.auto import tqdm

    tokenizer_dir = job.adapter if (job.adapter / "tokenizer_config.json").exists() else job.base
    config = _merged_config(job.config, job.model, job.plan, job.num_labels, job.cast, job.new_dtype, tokenizer_dir)
    config.save_pretrained(partial)
    _copy_files(job.base, job.adapter, partial, generates=job.num_labels is None)
    outputs = job.plan.outputs
    shard_plan = plan_shards([o.spec for o in outputs], max_shard_size)
    if len(shard_plan) > 1:
        (partial / audit.FULL_INDEX).write_text(json.dumps(index_json(shard_plan), indent=2))
    writer, worst = ShardStreamWriter(partial, shard_plan), 0.0
    try:
        bar = tqdm(total=job.plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                   desc=f"merging {len(outputs)} tensors")
        with _one_thread(), bar:
            for i, output in enumerate(outputs):
                worst = max(worst, _write_tensor(output, writer, job.reader, job.lora, bar))
                bar.set_postfix_str(f"tensor {i + 1}/{len(outputs)}", refresh=False)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return shard_plan, writer, worst


def merge_streamed(adapter: str, out: str, base: str | None = None, dtype: str = "auto",
                   max_shard_size: int | str = "5GB", probe: bool | None = None, progress: bool = True) -> MergeReport:
    """Merge a LoRA adapter into its base checkpoint without loading the model, and save a standalone model.

    Args:
        adapter: the adapter directory (``adapter_config.json`` + weights), as PEFT or trl_ext saves it.
        out: where to write the merged model; must not exist or be empty.
        base: base model directory or Hub id (read from the local cache); default: the one the adapter records.
        dtype: ``auto`` keeps every tensor's dtype; ``float32``/``bfloat16``/``float16`` casts floating tensors.
        max_shard_size: largest safetensors file written (``5GB``, ``500MB``, or bytes).
        probe: also compare the merged model's outputs with the adapter model's (loads both); default: for bases up
            to ``PROBE_MAX_BYTES``.
        progress: show a progress bar (bytes written, ETA, tensor count).

    Returns:
        A ``MergeReport`` (where, how much, how long, peak RSS, the checks' margins).

    Raises:
        MergeError: anything the merge refuses, in one line, before anything is written; or a failed check, with
            nothing committed.
        FileNotFoundError: a base path that does not exist.
    """
    started = time.monotonic()
    out_dir = Path(out)
    inputs.check_out_dir(out_dir)
    job = _gather_inputs(Path(adapter), base, dtype)
    target = out_dir.absolute()
    partial = target.with_name(f".{target.name}{commit.PARTIAL_SUFFIX}")
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted merge
    keep_partial, probe_diff = False, None
    try:
        partial.mkdir(parents=True)
        shard_plan, writer, worst = _write_files(job, partial, max_shard_size, progress)
        problems = readback.check_written(str(partial), shard_plan, writer.written, None, job.num_labels or 1)
        writer.wait()  # every file on disk before the outcome is decided
        if problems:
            keep_partial = True
            raise MergeError(f"the merged model failed verification; nothing was committed. The files are kept in "
                             f"{partial} for inspection: " + "; ".join(problems))
        if probe or (probe is None and _base_bytes(job.reader) <= PROBE_MAX_BYTES):
            try:
                probe_diff = _probe_outputs(job, partial)
            except (OSError, ValueError, RuntimeError, TypeError) as exc:  # MergeError (a difference) passes through
                if isinstance(exc, MergeError):
                    raise
                raise MergeError(f"the end-to-end check could not run ({type(exc).__name__}: {exc}); nothing was "
                                 "written. merge_streamed(..., probe=False) skips it".splitlines()[0]) from exc
        commit.commit(partial, target)
    except BaseException:
        if not keep_partial:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        job.close()
    return MergeReport(target, len(job.plan.outputs), sum(o.delta is not None for o in job.plan.outputs),
                       job.plan.nbytes, time.monotonic() - started, _peak_rss(), worst, probe_diff)


def _base_bytes(reader: SafetensorsReader) -> int:
    return sum(os.path.getsize(p) for p in {t.path for t in reader.tensors.values()})
