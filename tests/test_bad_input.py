"""Every bad input we know of, across the CLI, the trainers and resume, in one table.

Each case builds its inputs in a fresh directory, runs what a user runs, and checks three things: the exit code, a
message that says what is wrong (and, for our own errors, on one line), and that no file was changed or added,
neither the case's inputs nor the shared artifacts. Python-level cases run in-process: an uncaught exception is
exit code 1 with ``Type: message`` as its last line, which is what ``run_python`` reports. To add a row, append a
``Case`` to ``CASES`` (``command([...])`` runs a real subprocess, e.g. a recipe).
"""

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from datasets import Dataset

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Case:
    id: str
    run: Callable[[Path, Path], tuple[int, str]]  # (workspace, shared artifacts) -> (exit code, message)
    exit_code: int
    message: str  # a substring the message must contain
    one_line: bool = True  # our own errors are one line; reports (trl-ext verify) and argparse usage are not


# ---------------------------------------------------------------- ways to run a case


def cli(*argv: str) -> Callable:
    """``trl-ext ARGV`` in-process; ``{ws}`` and ``{assets}`` in arguments are replaced by the directories."""

    def run(ws: Path, assets: Path) -> tuple[int, str]:
        from trl_ext.cli import main

        args = [a.format(ws=ws, assets=assets) for a in argv]
        return run_python(lambda: sys.exit(main(args)))

    return run


def command(*argv: str, timeout: float = 300) -> Callable:
    """A real subprocess (``python -m trl_ext.cli ...``, a recipe): its exit code and stderr."""

    def run(ws: Path, assets: Path) -> tuple[int, str]:
        args = [a.format(ws=ws, assets=assets) for a in argv]
        proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
        return proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1] + "\n" + proc.stdout

    run.starts_a_process = True  # a slow case: the fast tier (-m "not slow") leaves it out
    return run


def run_python(fn: Callable) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            fn()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        return code, out.getvalue().strip() + (str(exc.code) if isinstance(exc.code, str) else "")
    except Exception as exc:  # noqa: BLE001 - what the interpreter would print as the last line, exit code 1
        return 1, f"{type(exc).__name__}: {exc}"
    return 0, out.getvalue()


def trainer(kind: str, rows: list[dict] | Callable | None = None, model: str | None = None, lora: bool = False,
            resume: str | None = None, **config) -> Callable:
    """Build ``kind``'s trainer on ``rows`` (and train, when ``resume`` is given) as a user script would."""

    def run(ws: Path, assets: Path) -> tuple[int, str]:
        from peft import LoraConfig

        import trl_ext

        trainer_cls, config_cls = {"sft": (trl_ext.SFTTrainer, trl_ext.SFTConfig),
                                   "dpo": (trl_ext.DPOTrainer, trl_ext.DPOConfig),
                                   "reward": (trl_ext.RewardTrainer, trl_ext.RewardConfig)}[kind]

        def build_and_train():
            args = config_cls(output_dir=str(ws / "run"), max_steps=3, per_device_train_batch_size=2,
                              report_to="none", save_steps=1, **config)
            dataset = rows(ws) if callable(rows) else Dataset.from_list(rows or SFT_ROWS)
            peft_config = LoraConfig(r=4, target_modules=["q_proj"]) if lora else None
            t = trainer_cls(model=(model or "{assets}/base").format(ws=ws, assets=assets), args=args,
                            train_dataset=dataset, peft_config=peft_config)
            if resume is not None:
                t.train(resume_from_checkpoint=True if resume == "last" else resume.format(ws=ws, assets=assets))

        return run_python(build_and_train)

    return run


def config(kind: str, **fields) -> Callable:
    def run(ws: Path, assets: Path) -> tuple[int, str]:
        import trl_ext

        cls = {"sft": trl_ext.SFTConfig, "dpo": trl_ext.DPOConfig, "reward": trl_ext.RewardConfig}[kind]
        return run_python(lambda: cls(output_dir=str(ws / "run"), report_to="none", **fields))

    return run


def recipe(name: str, *argv: str) -> Callable:
    """``python recipes/NAME.py ARGV``'s checks before anything starts, in-process (the same function the script calls;
    tests/test_recipes.py runs the scripts end to end). Without a ``--config`` the recipe's tiny config is used."""

    def run(ws: Path, assets: Path) -> tuple[int, str]:
        import trl_ext
        from trl_ext.launching import launch
        from trl_ext.launching.scripting import parse_recipe_args

        config_cls, kind = {"sft": (trl_ext.SFTConfig, "sft"), "reward": (trl_ext.RewardConfig, "preference"),
                            "dpo": (trl_ext.DPOConfig, "preference")}[name]
        parser = trl_ext.TrlParser((trl_ext.ScriptArguments, config_cls, trl_ext.ModelConfig))
        import datasets

        args = [a.format(ws=ws, assets=assets) for a in argv]
        configs = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
        if all(c.startswith("accelerate_configs/") for c in configs):  # no recipe config: the script's default
            args = ["--config", str(REPO / "recipes" / "configs" / f"{name}.yaml"), *args]
        datasets.disable_progress_bars()  # "Generating train split" bars are not part of the message

        def never_relaunched(*args, **kwargs):  # a re-launch would replace this test process
            raise AssertionError(f"the recipe re-launched in-process: {args}")

        try:
            with mock.patch.object(launch, "_exec", never_relaunched):
                return run_python(lambda: parse_recipe_args(parser, name, kind,
                                                            ["--output_dir", str(ws / "out"), *args]))
        finally:
            datasets.enable_progress_bars()

    return run


def files(**contents: str) -> Callable[[Path, Path], None]:
    """Files in the workspace (a bad config, a dataset directory's splits)."""

    def setup(ws: Path, assets: Path) -> None:
        for name, text in contents.items():
            path = ws / name.replace("__", "/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    return setup


def with_setup(setup: Callable[[Path, Path], None], run: Callable) -> Callable:
    def both(ws: Path, assets: Path) -> tuple[int, str]:
        return run(ws, assets)

    both.setup = setup
    both.starts_a_process = getattr(run, "starts_a_process", False)
    return both


# ---------------------------------------------------------------- inputs

SFT_ROWS = [{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}] * 4
PREF_ROWS = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 4


def shapes(edit: Callable | None = None, kind: str = "sft") -> Callable[[Path], Dataset]:
    """Four rows of the bundled image data (TRL's vision format); ``edit(ws, rows)`` returns them made bad."""

    def make(ws: Path) -> Dataset:
        from trl_ext.assets import load_shapes

        rows = load_shapes(kind)["train"].select(range(4))
        return edit(ws, rows) if edit else rows

    return make


def image_files(name: str) -> Callable[[Path, Dataset], Dataset]:
    """Each row's image replaced by the file ``name`` in the workspace (a datasets Image read from that path)."""

    def edit(ws: Path, rows: Dataset) -> Dataset:
        from datasets import Image, Sequence

        return rows.remove_columns("images").add_column("images", [[str(ws / name)]] * len(rows)).cast_column(
            "images", Sequence(Image()))

    return edit


def images_value(value) -> Callable[[Path, Dataset], Dataset]:
    def edit(ws: Path, rows: Dataset) -> Dataset:
        return Dataset.from_dict({"messages": rows["messages"], "images": [value(row) for row in rows["images"]]})

    return edit


def copy(name: str, corrupt: str | None = None, how: str = "truncate") -> Callable[[Path, Path], None]:
    """Copy the shared artifact ``name`` into the workspace; damage its file ``corrupt``."""

    def setup(ws: Path, assets: Path) -> None:
        shutil.copytree(assets / name, ws / name)
        if corrupt:
            path = ws / name / corrupt
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2] if how == "truncate" else b"\x10\0\0\0\0\0\0\0" + b"{garbage" * 8)

    return setup


def occupied(setup=None) -> Callable[[Path, Path], None]:
    def both(ws: Path, assets: Path) -> None:
        if setup:
            setup(ws, assets)
        (ws / "out").mkdir()
        (ws / "out" / "notes.txt").write_text("another run's files")

    return both


CASES = [
    # --- trl-ext verify: a damaged or mismatched checkpoint is reported, exit 1
    Case("verify-truncated-safetensors", with_setup(copy("full", "model.safetensors"), cli("verify", "{ws}/full")),
         1, "model.safetensors: cannot be read as safetensors", one_line=False),
    Case("verify-garbage-safetensors", with_setup(copy("adapter", "adapter_model.safetensors", "garbage"),
                                                  cli("verify", "{ws}/adapter")),
         1, "adapter_model.safetensors: cannot be read as safetensors", one_line=False),
    Case("verify-missing-path", cli("verify", "{ws}/no-such-checkpoint"), 1, "not a directory", one_line=False),
    Case("verify-adapter-base-mismatch", cli("verify", "{assets}/adapter", "--base", "{assets}/other_base"),
         1, "tensors do not match the base model", one_line=False),
    Case("verify-missing-base", cli("verify", "{assets}/adapter", "--base", "{ws}/no-such-base"),
         1, "no-such-base' does not exist"),
    Case("verify-subprocess-exit-code", with_setup(copy("full", "model.safetensors"),
                                                   command("-m", "trl_ext.cli", "verify", "{ws}/full")),
         1, "cannot be read as safetensors", one_line=False),
    # --- trl-ext merge: refused before anything is written, exit 1 (argparse: 2)
    Case("merge-adapter-base-mismatch",
         cli("merge", "--adapter", "{assets}/adapter", "--out", "{ws}/merged", "--base", "{assets}/other_base"),
         1, "does not fit this base model", one_line=False),
    Case("merge-corrupted-adapter", with_setup(copy("adapter", "adapter_model.safetensors"),
                                               cli("merge", "--adapter", "{ws}/adapter", "--out", "{ws}/merged")),
         1, "adapter_model.safetensors: cannot be read as safetensors", one_line=False),
    Case("merge-missing-adapter", cli("merge", "--adapter", "{ws}/no-such-adapter", "--out", "{ws}/merged"),
         1, "is not a PEFT adapter: adapter_config.json is missing"),
    Case("merge-missing-base",
         cli("merge", "--adapter", "{assets}/adapter", "--out", "{ws}/merged", "--base", "{ws}/no-such-base"),
         1, "no-such-base' does not exist"),
    Case("merge-output-holds-files", with_setup(occupied(), cli("merge", "--adapter", "{assets}/adapter", "--out",
                                                                "{ws}/out")),
         1, "already exists and is not empty; nothing was changed"),
    Case("merge-invalid-dtype", cli("merge", "--adapter", "{assets}/adapter", "--out", "{ws}/m", "--dtype", "float17"),
         2, "invalid choice: 'float17'", one_line=False),
    Case("merge-missing-out-flag", cli("merge", "--adapter", "{assets}/adapter"), 2,
         "the following arguments are required: --out", one_line=False),
    # --- trainers: malformed rows, empty and over-long samples, wrong column types, refused in one line
    Case("sft-message-without-content",
         trainer("sft", [*SFT_ROWS[:2], {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant"}]}]),
         1, "DatasetError: train_dataset: 1 bad field(s) in 3 rows, first at row 2: 'messages' has a message from "
            "'assistant' without content"),
    Case("sft-empty-conversation", trainer("sft", [*SFT_ROWS, {"messages": []}]), 1,
         "row 4: 'messages' is an empty conversation"),
    # An empty text or answer alone is no error (TRL trains on the rest, tests/test_formats.py); all of them is.
    Case("sft-nothing-to-train-on", trainer("sft", [{"text": ""}, {"text": ""}]), 1,
         "train_dataset: none of its 2 rows has a token to train on"),
    Case("sft-wrong-column-type", trainer("sft", [{"text": 5}, {"text": 6}]), 1,
         "row 0: 'text' has type int (5)"),
    Case("sft-messages-as-string", trainer("sft", [{"messages": "1+1=2"}] * 2), 1,
         "row 0: 'messages' is text, expected a list of {'role', 'content'} messages"),
    Case("sft-missing-columns", trainer("sft", [{"question": "1+1?"}] * 2), 1,
         "has columns ['question'], but this trainer needs messages or prompt+completion or text"),
    Case("dpo-missing-rejected", trainer("dpo", [{"prompt": "1+1=", "chosen": "2"}] * 2), 1,
         "needs chosen+rejected"),
    Case("dpo-wrong-column-type", trainer("dpo", [{"prompt": "1+1=", "chosen": 2, "rejected": 3}] * 2), 1,
         "row 0: 'chosen' has type int (2)"),
    Case("dpo-every-prompt-over-max-length",
         trainer("dpo", [{"prompt": "1+1=" * 40, "chosen": "2", "rejected": "3"}] * 4, max_length=16), 1,
         "all 4 rows are too long for max_length=16"),
    Case("reward-every-row-over-max-length",
         trainer("reward", [{"chosen": "1+1=2" * 40, "rejected": "1+1=3" * 40}] * 4, max_length=16), 1,
         "all 4 rows are too long for max_length=16"),
    Case("reward-missing-value", trainer("reward", [{"chosen": "1+1=2", "rejected": None}] * 2), 1,
         "row 0: 'rejected' is missing (None)"),
    # --- images (vision-language models): refused before the model loads, instead of mid-training in the collator
    Case("vlm-missing-image-file", trainer("sft", shapes(image_files("gone.png")), model="{assets}/vlm"), 1,
         "DatasetError: train_dataset: 4 bad image row(s) in 4 rows, first at row 0: an image is a path that does "
         "not exist"),
    Case("vlm-unreadable-image", with_setup(files(**{"broken.png": "not a png"}),
                                            trainer("sft", shapes(image_files("broken.png")), model="{assets}/vlm")),
         1, "first at row 0: an image cannot be read"),
    Case("vlm-more-images-than-placeholders", trainer("sft", shapes(images_value(lambda imgs: imgs * 2)),
                                                       model="{assets}/vlm"),
         1, "row 0: 2 image(s) but 1 {'type': 'image'} placeholder(s) in its conversation"),
    Case("vlm-image-column-wrong-type", trainer("sft", shapes(images_value(lambda imgs: 5)), model="{assets}/vlm"), 1,
         "row 0: 'images' has type int, expected a list of images"),
    Case("vlm-dpo-missing-image-file",
         trainer("dpo", shapes(image_files("gone.png"), kind="preference"), model="{assets}/vlm", lora=True), 1,
         "an image is a path that does not exist"),
    Case("vlm-images-for-a-text-only-model", trainer("sft", shapes()), 1,
         "has an 'images' column but the model is text-only"),
    Case("recipe-vlm-data-for-a-text-only-model",
         recipe("sft", "--config", "recipes/configs/sft_vlm.yaml", "--model_name_or_path", "trl-ext/tiny-llama"), 1,
         "dataset 'trl-ext/shapes-sft' split 'train' has an 'images' column but the model is text-only"),
    # --- model paths and flags
    Case("missing-model-path", trainer("sft", SFT_ROWS, model="{ws}/no-such-model"), 1,
         "NotFoundError: model path '"),
    Case("conflicting-bf16-fp16", config("sft", bf16=True, fp16=True), 1, "bf16=True and fp16=True conflict"),
    Case("conflicting-best-model-without-eval", config("sft", load_best_model_at_end=True, eval_strategy="no"), 1,
         "requires the save and eval strategy to match", one_line=False),  # transformers' own message
    Case("conflicting-packing-without-max-length", trainer("sft", SFT_ROWS, packing=True, max_length=None), 1,
         "When packing is enabled, `max_length` can't be `None`"),
    # --- resume from a damaged or missing checkpoint: refused before anything loads, the run dir untouched
    Case("resume-corrupted-safetensors",
         with_setup(copy("run", "checkpoint-2/adapter_model.safetensors"),
                    trainer("sft", SFT_ROWS, lora=True, resume="last")),
         1, "checkpoint-2: adapter_model.safetensors: cannot be read as safetensors"),
    Case("resume-missing-checkpoint", trainer("sft", SFT_ROWS, lora=True, resume="{ws}/run/checkpoint-9"), 1,
         "cannot resume from"),
    # --- recipes: checked before any model loads or any process is launched; one line, exit 1
    Case("recipe-config-does-not-exist", recipe("dpo", "--config", "{ws}/nothing.yaml"), 1, "does not exist"),
    Case("recipe-config-neither-kind", with_setup(files(**{"list.yaml": "- a\n- b\n"}),
                                                  recipe("dpo", "--config", "{ws}/list.yaml")),
         1, "is neither a recipe config"),
    Case("recipe-unknown-config-key", with_setup(files(**{"typo.yaml": "learnin_rate: 1.0e-3\n"}),
                                                 recipe("dpo", "--config", "{ws}/typo.yaml")),
         1, "learnin_rate (did you mean learning_rate?)"),
    Case("recipe-unknown-flag", recipe("dpo", "--lora_rr", "8"), 1, "lora_rr (did you mean lora_r?)"),
    Case("recipe-dataset-missing-columns",
         with_setup(files(**{"data__train.jsonl": '{"question": "1+1?", "answer": "2"}\n',
                             "data__test.jsonl": '{"question": "1+1?", "answer": "2"}\n'}),
                    recipe("dpo", "--dataset_name", "{ws}/data")),
         1, "has columns ['question', 'answer'], but this trainer needs chosen+rejected"),
    Case("recipe-dataset-malformed-row",
         with_setup(files(**{"data__train.jsonl": '{"messages": [{"role": "user", "content": "1+1?"}]}\n'
                                                  '{"messages": "1+1=2"}\n'}),
                    recipe("sft", "--dataset_name", "{ws}/data", "--eval_strategy", "no")),
         1, "first at row 1: 'messages'"),
    Case("recipe-dataset-missing-split", recipe("dpo", "--dataset_test_split", "validation"), 1,
         "has no split 'validation'"),
    Case("recipe-missing-model-path", recipe("sft", "--model_name_or_path", "{ws}/no-model"), 1, "cannot load model"),
    Case("recipe-output-dir-holds-another-run", with_setup(occupied(), recipe("reward")), 1, "already holds files"),
    Case("recipe-resume-without-checkpoint", recipe("sft", "--resume_from_checkpoint", "true"), 1,
         "holds no complete checkpoint-N"),
    Case("recipe-conflicting-4bit-without-peft", recipe("sft", "--load_in_4bit"), 1, "add --use_peft"),
    Case("recipe-conflicting-4bit-dtype-auto", recipe("sft", "--use_peft", "--load_in_4bit", "--dtype", "auto"), 1,
         "pass --dtype bfloat16"),
    Case("recipe-conflicting-4bit-and-8bit", recipe("dpo", "--use_peft", "--load_in_4bit", "--load_in_8bit"), 1,
         "8 bit and 4 bit"),
    Case("recipe-num-processes-without-accelerate-config", recipe("dpo", "--num_processes", "4"), 1,
         "needs an accelerate config"),
]


# ---------------------------------------------------------------- shared artifacts and the test


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_model_path):
    """A base, a full save, a LoRA adapter, a base of another size, and a LoRA run with checkpoint-1 and -2."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import trl_ext
    import trl_ext.assets

    root = tmp_path_factory.mktemp("assets")
    shutil.copytree(tiny_model_path, root / "base")
    shutil.copytree(trl_ext.assets.vlm_model_path(), root / "vlm")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.save_pretrained(root / "full")
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(root / "adapter")
    other = LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    LlamaForCausalLM(other).save_pretrained(root / "other_base")
    args = trl_ext.SFTConfig(output_dir=str(root / "run"), max_steps=2, save_steps=1, per_device_train_batch_size=2,
                             report_to="none")
    trl_ext.SFTTrainer(model=str(root / "base"), args=args, train_dataset=Dataset.from_list(SFT_ROWS),
                       peft_config=LoraConfig(r=4, target_modules=["q_proj"])).train()
    assert (root / "run" / "checkpoint-2" / "adapter_model.safetensors").exists()
    return root


def digest(*directories: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in directories for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id, marks=[pytest.mark.slow] if getattr(c.run, "starts_a_process", False) else [])
    for c in CASES])
def test_bad_input_is_refused_clearly_and_changes_nothing(case, assets, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    if hasattr(case.run, "setup"):
        case.run.setup(ws, assets)
    before = digest(ws, assets)

    code, message = case.run(ws, assets)

    assert code == case.exit_code, f"exit code {code}, expected {case.exit_code}: {message[-2000:]}"
    assert case.message in message, message[-2000:]
    if case.one_line:
        assert "\n" not in message.strip(), f"not one line:\n{message}"
    assert digest(ws, assets) == before, "a file was changed or added"
