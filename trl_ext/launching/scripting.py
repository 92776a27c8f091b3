"""What the recipes share: reading the command line, checking the input before anything starts, and the closing report.

``parse_recipe_args`` is the recipes' one entry point. Before any model is loaded it turns bad input (a missing or
unknown config, unknown keys, an output dir that holds another run, a dataset without the needed columns, a model
that cannot be found) into one line on stderr and exit code 2, and re-launches under an accelerate config named
with ``--config`` (see ``trl_ext.launching.launch``).
"""

import difflib
import gc
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trl_ext import patches
from trl_ext.errors import UsageError
from trl_ext.launching import launch, rename_probe
from trl_ext.placement import orchestrators, outcome, ownership
from trl_ext.process import end_together, env_world_size, notice
from trl_ext.resuming.choose import last_committed
from trl_ext.settings.trainer_options import MirrorOptions

TRANSFORMERS_DEFAULT_OUTPUT_DIR = "trainer_output"  # what TrainingArguments picks when none is given
RESUME_LAST = ("true", "True", "last", "1", "yes")  # `--resume_from_checkpoint true`: the last complete checkpoint


def parse_recipe_args(parser, recipe: str, dataset_kind: str | None, argv: list[str] | None = None):
    """``(script_args, training_args, model_args)`` for a recipe, checked; or a re-launch under an accelerate config
    or an orchestrator (``launching.launch.start``: decided before anything heavy is imported).

    ``recipe``: a trainer's command ("sft", "reward", "dpo"), whose TRL trainer judges the dataset; ``dataset_kind``:
    "sft" or "preference", the formats an error message suggests (see ``input_checks.FORMATS``), or None for prompt
    datasets (GRPO), whose rows only the trainer and its reward functions interpret.
    Recipe-level flags on top of TRL's: ``--overwrite_output_dir`` and ``--num_processes`` (with an accelerate config).
    Under a multi-process launch every rank checks the input; what depends on the disk (the output directory) is
    decided on rank 0 for all.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    outcome.watch()  # under a launcher: an error that ends this process is told apart from a lost peer
    # --help: the recipe's own options first, then TRL's (hundreds of lines) as argparse lists them
    parser.usage = (f"%(prog)s [--config RECIPE.yaml] [--config accelerate_configs/NAME.yaml [--num_processes N]] "
                    f"[--overwrite_output_dir] [TRL's {recipe} options, below]")
    parser.description = (
        "--config RECIPE.yaml: a recipe config (TRL's YAML; default: recipes/configs/<recipe>.yaml, the embedded tiny "
        "model and data). --config accelerate_configs/NAME.yaml: run under that accelerate config; the recipe launches "
        "its processes itself (under torchrun, each process applies it). Both --config may be given. "
        "--num_processes N: with an accelerate config. --overwrite_output_dir: replace an output_dir that holds "
        "another run. Every option below is TRL's; on the command line it overrides the config.")
    if "-h" in argv or "--help" in argv:
        parser.parse_args_and_config(["--help"])
    rest = launch.start(sys.argv[0], argv)  # re-launches here (no return), or gives the arguments to parse
    # What the recipe imported (torch, transformers, TRL: about 600,000 objects) lives to the end of the process; kept
    # out of the collector's full collections, which Trainer.train() and each DeepSpeed engine run (~0.3 s each).
    gc.freeze()
    recipe_config, rest = launch.take_option(rest, "config")
    overwrite = "--overwrite_output_dir" in rest
    parser_args = [a for a in rest if a != "--overwrite_output_dir"]
    if recipe_config is None:
        recipe_config = str(Path(sys.argv[0]).resolve().parent / "configs" / f"{recipe}.yaml")
        notice(f"no recipe config given: using {os.path.relpath(recipe_config)} (the embedded tiny model and data).")
    try:
        script_args, training_args, model_args = parser.parse_args_and_config(["--config", recipe_config, *parser_args])
    except ValueError as exc:  # TrlParser's unknown keys / flags, or a config's own check (4-bit and 8-bit, ...)
        raise UsageError(_unknown_arguments_message(parser, str(exc), recipe_config)) from None

    if training_args.eval_strategy == "no" and training_args.eval_on_start:  # `--eval_strategy no` over a config
        training_args.eval_on_start = False
        notice("eval_strategy is 'no': eval_on_start is switched off too.")
    _check_flags(model_args)
    check_model(model_args.model_name_or_path)
    _decided_everywhere(training_args, lambda: prepare_output_dir(training_args, recipe, overwrite))
    outcome.watch(training_args.output_dir)  # and, restarted, an error of its own is refused at the next attempt
    check_dataset(script_args, training_args, model_args, recipe, dataset_kind)
    check_mirror(training_args)
    _wait_for_everyone()  # every rank has checked the input before any rank writes
    return script_args, training_args, model_args


def _unknown_arguments_message(parser, error: str, config: str) -> str:
    import re

    unknown = [a.lstrip("-") for a in re.findall(r"'(--[^']+)'", error)]
    if not unknown:
        return error
    known = {a.dest for a in parser._actions} if patches.applies("parser-destinations") else set()
    hints = [f"{u} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(u, known, n=1)) else u for u in unknown]
    where = f"config file '{config}'" if "config file" in error else "the command line"
    return f"unknown option(s) in {where}: {', '.join(hints)}. `python {sys.argv[0]} --help` lists the options."


def prepare_output_dir(training_args, recipe: str, overwrite: bool = False) -> str:
    """Give each run its own directory unless the user chose one; never train over another run's output.

    ``--resume_from_checkpoint true`` resolves to the last complete ``checkpoint-N`` of the output dir. A run that its
    orchestrator names (a Slurm job, a SkyPilot task, a TrainJob, torchrun's ``--rdzv-id``; see
    ``placement.orchestrators``) gets a default directory named by it, the same when the run is restarted, and marked
    for it: restarted, the run trains on into it, and the trainer resumes from the newest checkpoint its earlier
    attempt committed there, by itself (``resuming.choose.after_restart``). Call it on rank 0 (the recipes decide it
    there for every rank).
    """
    job = orchestrators.current()
    run = job.run if job is not None else None
    if training_args.output_dir in (None, TRANSFORMERS_DEFAULT_OUTPUT_DIR):
        training_args.output_dir = os.path.join(
            "outputs", f"{recipe}-{run}" if run else f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    out = Path(training_args.output_dir)
    resume = training_args.resume_from_checkpoint
    own = ownership.is_own(out)  # the run's own directory: the trainer resumes from its newest checkpoint by itself
    mirror = MirrorOptions.of(training_args).checkpoint_mirror
    if resume in RESUME_LAST and last_committed(out) is None and mirror:
        training_args.resume_from_checkpoint = True  # the trainer downloads the mirror's newest complete checkpoint
        notice(f"{out} holds no complete checkpoint: resuming from the newest complete one of {mirror}, if it holds "
               f"one (else a new run starts)")
    elif resume in RESUME_LAST:
        last = last_committed(out)
        if last is None:
            raise UsageError(f"--resume_from_checkpoint {resume}: '{out}' holds no complete checkpoint-N to resume "
                             "from. Check --output_dir, or drop --resume_from_checkpoint to start a new run.")
        training_args.resume_from_checkpoint = last
        notice(f"resuming from {last}")
    elif resume and not (Path(resume) / "trainer_state.json").is_file():
        raise UsageError(f"--resume_from_checkpoint '{resume}' is not a checkpoint (no trainer_state.json in it). "
                         "Pass a checkpoint-N directory, or 'true' for the output dir's last one.")
    elif out.is_dir() and any(out.iterdir()) and not resume and not own:
        if not overwrite:
            raise UsageError(
                f"output_dir '{out}' already holds files from another run; nothing was changed. Choose a new "
                "--output_dir, pass --resume_from_checkpoint true to continue that run, or --overwrite_output_dir."
            )
        notice(f"--overwrite_output_dir: training into '{out}'; its files are replaced as the new run saves.")
    rename_probe.check_renames(out)  # an object-store mount would fail at the first checkpoint's commit
    if own:
        outcome.refuse_after_error(out)  # a restart of a run that ended in an error of its own: not retried
    ownership.claim(out)  # the run's directory from now on: a restarted run resumes from it
    return str(out)


def _decided_everywhere(training_args, prepare) -> None:
    """``prepare()`` (which sets the output directory and what to resume) on rank 0 only, its outcome (or its refusal)
    on every rank: ranks that each look at the directory could see it before and after rank 0 creates it."""
    from trl_ext.process import decided_on_rank0

    def decide():
        prepare()
        return training_args.output_dir, training_args.resume_from_checkpoint

    training_args.output_dir, training_args.resume_from_checkpoint = decided_on_rank0(decide)


def check_mirror(training_args) -> None:
    """A ``checkpoint_mirror`` the store refuses (credentials, bucket, permission) fails here, in one line, before any
    process starts (the trainer checks it again on every rank).

    Raises:
        UsageError: the mirror cannot be written.
    """
    from trl_ext.errors import MirrorError
    from trl_ext.mirror import check

    try:
        check(training_args)
    except MirrorError as exc:
        raise UsageError(str(exc)) from None


def _check_flags(model_args) -> None:
    """Flag combinations that TRL would only trip over later, deep inside model loading."""
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        raise UsageError("a quantized model cannot be trained directly; add --use_peft to train LoRA adapters on it.")
    if model_args.load_in_4bit and model_args.dtype in (None, "auto"):
        raise UsageError("--load_in_4bit computes in --dtype, which is 'auto'; pass --dtype bfloat16 on GPUs or "
                         "--dtype float32 on CPU.")


def check_model(name: str | None) -> None:
    """A model that cannot be found fails here, in one line, not in a long traceback from inside the trainer.

    Args:
        name: the model's Hub id or path (or an embedded model's name).

    Raises:
        UsageError: no model given, or its config does not load.
    """
    from transformers import AutoConfig

    from trl_ext.assets import resolve_model

    if not name:
        raise UsageError("no model given: set model_name_or_path in the recipe config or pass --model_name_or_path.")
    try:
        AutoConfig.from_pretrained(resolve_model(name))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise UsageError(f"cannot load model '{name}': {first}") from None


def check_dataset(script_args, training_args, model_args, recipe: str, kind: str | None, load=None) -> None:
    """The dataset loads, has the splits the run uses, its images are readable and fit the model, and TRL can prepare
    its first rows (the trainers check them again, and every row as TRL prepares them; here a bad dataset stops the
    run before any process is launched).

    Args:
        script_args: TRL's ``ScriptArguments`` (dataset name, config and splits).
        training_args: the trainer's config.
        model_args: TRL's ``ModelConfig``.
        recipe: a trainer's command ("sft", "reward", "dpo", "kto": ``trainers.commands()``), whose TRL trainer
            judges the rows, or another name with ``kind`` None.
        kind: a key of ``input_checks.FORMATS``, or None for prompt datasets (GRPO, RLOO).
        load: ``load(name, config)`` returning the ``DatasetDict`` the run trains on (default: the recipes' loader,
            which knows the bundled datasets).

    Raises:
        UsageError: the dataset does not load, lacks a split, or TRL cannot prepare its first rows.
    """
    from trl_ext import trainers
    from trl_ext.assets import load_dataset_by_name, resolve_model
    from trl_ext.data.input_checks import probe_datasets
    from trl_ext.data.model_paths import check_dataset_path
    from trl_ext.data.vision import check_image_dataset, is_vision_model
    from trl_ext.errors import DatasetError

    name = script_args.dataset_name
    if not name:
        raise UsageError("no dataset given: set dataset_name in the recipe config or pass --dataset_name.")
    try:
        check_dataset_path(name)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    try:
        dataset = (load or load_dataset_by_name)(name, script_args.dataset_config)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; the user needs the first line only
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot load dataset '{name}': {first}") from None
    splits = [script_args.dataset_train_split]
    if training_args.eval_strategy != "no":
        splits.append(script_args.dataset_test_split)
    for split in splits:
        if split not in dataset:
            hint = " (or pass --eval_strategy no)" if split == script_args.dataset_test_split else ""
            raise UsageError(f"dataset '{name}' has no split '{split}'; it has {sorted(dataset)}. Choose one with "
                             f"--dataset_{'test' if hint else 'train'}_split{hint}.")
    if kind is None:
        return  # prompt datasets (GRPO): the trainer and its reward functions interpret the rows
    trainer = trainers.trainer_for(recipe)._trl_class  # TRL's own, also while `trl-ext <command>` maps trl's names
    model = resolve_model(model_args.model_name_or_path)
    try:
        for split in splits:
            check_image_dataset(dataset[split], f"dataset '{name}' split '{split}'", is_vision_model(model))
        probe_datasets(trainer, {f"dataset '{name}' split '{split}'": dataset[split] for split in splits},
                       training_args, model, kind=kind)
    except DatasetError as exc:
        raise UsageError(str(exc)) from None


def _wait_for_everyone() -> None:
    if env_world_size() > 1:
        from accelerate import PartialState

        PartialState().wait_for_everyone()


def report_eval(trainer, final: dict, keys: Sequence[str]) -> None:
    """Print the held-out metrics before training (the step-0 evaluation) and after it, side by side."""
    if not trainer.accelerator.is_main_process:
        return
    before = next((e for e in trainer.state.log_history if e.get("step") == 0 and "eval_loss" in e), {})
    parts = [f"{k} {before[k]:.3f} -> {final[k]:.3f}" if k in before else f"{k} {final[k]:.3f}"
             for k in keys if k in final]
    print(f"[trl_ext] held-out eval, before -> after training: {', '.join(parts)}", flush=True)


def report_held_out_answers(trainer, start_model: str) -> str | None:
    """On the bundled arithmetic: print the share of held-out sums answered exactly (greedy) before and after
    training, checked in a fresh process on the saved model, as a user would load it.

    Args:
        trainer: The trainer, after ``save_model(args.output_dir)``.
        start_model: The local path the run started from.

    Returns:
        On the main process, what the try-it command prints (for ``announce_done``); None elsewhere.
    """
    if not trainer.accelerator.is_main_process:
        return None
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "trl_ext.assets.answers", start_model, trainer.args.output_dir],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:  # a report, not the run's result: say so and go on to the closing lines
        notice(f"could not check the saved model's answers: {proc.stderr.strip().splitlines()[-1:]}")
        return None
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"[trl_ext] held-out accuracy (greedy), before -> after training: {result['before']:.3f} -> "
          f"{result['after']:.3f} ({result['prompts']} prompts)", flush=True)
    return result["reply"]


def announce_done(trainer, what: str, task: str = "causal", reply: str | None = None) -> None:
    """Where the saved (and verified) model is, and the next command to use it; the recipe's last step, on every rank
    (the ranks then end together, see ``process.end_together``). ``task``: "causal" or "reward"; ``reply``: what that
    command prints, when the recipe already ran it (``report_held_out_answers``)."""
    if trainer.accelerator.is_main_process:
        _print_done(trainer, what, task, reply)
    end_together()


def _print_done(trainer, what: str, task: str, reply: str | None) -> None:
    out = trainer.args.output_dir
    adapter = (Path(out) / "adapter_config.json").is_file()
    lines = [f"[trl_ext] {what} saved and verified: {out}"]
    if adapter:
        lines.append(f"[trl_ext] merge it into a standalone model: trl-ext merge --adapter {out} --out {out}-merged")
    if task == "reward":
        loader = ("from peft import AutoPeftModelForSequenceClassification as M; "
                  "m = M.from_pretrained('{}', num_labels=1)" if adapter else
                  "from transformers import AutoModelForSequenceClassification as M; m = M.from_pretrained('{}')")
        lines.append(f'[trl_ext] load it: python -c "{loader.format(out)}; print(m.config.num_labels)"')
    elif hasattr(trainer.processing_class, "image_processor"):  # a vision-language model: ask about a shapes image
        chat = ("[{'role': 'user', 'content': [{'type': 'image', 'image': load_shapes('sft')['test'][0]['images'][0]}, "
                "{'type': 'text', 'text': 'What colour is the shape?'}]}]")
        lines.append(f"[trl_ext] try it: python -c \"from transformers import pipeline; from trl_ext.assets import "
                     f"load_shapes; print(pipeline('image-text-to-text', '{out}')(text={chat}, max_new_tokens=8, "
                     "do_sample=False, return_full_text=False))\"")
    else:
        from trl_ext.assets.answers import TRY_IT_PROMPT

        chat = f"[{{'role': 'user', 'content': '{TRY_IT_PROMPT}'}}]"
        lines.append(f"[trl_ext] try it: python -c \"from transformers import pipeline; "
                     f"print(pipeline('text-generation', '{out}')({chat}, max_new_tokens=8, do_sample=False, "
                     "return_full_text=False))\"")
        if reply is not None:  # the run ends on an answer a person can check
            lines.append(f"[trl_ext] it prints: {reply}")
    print("\n" + "\n".join(lines), flush=True)
