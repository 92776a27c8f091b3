"""trl-ext: TRL's training commands with trl_ext's trainers, and the tools that check and merge what they save."""

import argparse
import sys


def _env(_: argparse.Namespace) -> int:
    """Print the versions and hardware trl_ext sees: paste this into bug reports."""
    import importlib.metadata as md

    import torch

    for name in ("trl_ext", "trl", "transformers", "accelerate", "peft", "deepspeed", "torch", "safetensors",
                 "datasets", "bitsandbytes"):
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            version = "not installed"
        print(f"{name:<14}{version}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"{'gpus':<14}{gpus}" + ("" if gpus else "  (CPU: trainers run fp32, multi-process runs use gloo)"))
    return 0


def _model(_: argparse.Namespace) -> int:
    """Build (first time) and print the path of the embedded tiny model."""
    from trl_ext.assets import default_model_path

    print(default_model_path())
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Audit a saved checkpoint (adapter or full model), or a mirrored one at a URL (its manifest and safetensors
    headers); exit 1 if it has problems."""
    from trl_ext.data.model_paths import check_model_path
    from trl_ext.files.audit import audit
    from trl_ext.mirror import verify

    if verify.is_url(args.path):
        return _verify_remote(args)
    try:
        check_model_path(args.base)
        report = audit(args.path, base=args.base, num_labels=args.num_labels)
    except OSError as exc:  # a --base that is not there: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report.format())
    return 0 if report.ok else 1


def _verify_remote(args: argparse.Namespace) -> int:
    from trl_ext.errors import ConfigError, MirrorError
    from trl_ext.mirror import options, verify

    try:
        report = verify.verify(args.path, options.parse(args.storage_options))
    except (MirrorError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report.format())
    return 0 if report.ok else 1


def _merge(args: argparse.Namespace) -> int:
    """Merge a LoRA adapter into its base and save a standalone model, streamed tensor by tensor without loading the
    model (reward models stay reward models)."""
    from trl_ext.errors import CheckpointError, MergeError
    from trl_ext.merge.front import merge_adapter

    if len(args.adapter) > 1:
        print(f"error: {len(args.adapter)} adapters given; merge one at a time: --adapter {args.adapter[0]} --out M1, "
              f"then --adapter {args.adapter[1]} --base M1 --out M2", file=sys.stderr)
        return 1
    try:
        out, report = merge_adapter(args.adapter[0], args.out, base=args.base, dtype=args.dtype,
                                    max_shard_size=args.max_shard_size, dequantize_base=args.dequantize_base,
                                    say=lambda line: print(line, file=sys.stderr))
    except (MergeError, CheckpointError, OSError) as exc:  # OSError: a base or adapter path that is not there
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if report is not None:
        print(report.summary())
    print(f"merged model saved to {out}: load it with from_pretrained('{out}')")
    return 0


def main(argv: list[str] | None = None) -> int:
    from trl_ext.launching import trl_cli

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in trl_cli.COMMANDS:  # TRL's command line, TRL's parser: everything after the name is TRL's
        from trl_ext.launching import launch
        from trl_ext.launching.decision import Become, decide
        from trl_ext.placement import orchestrators

        job = orchestrators.current()
        decision = decide(job, accelerate=True)  # once: what this process becomes
        if decision.become is Become.NODE_LAUNCHER:  # one machine of several: its launcher starts its ranks
            launch.become_node_launcher(["trl-ext", *argv])
        return trl_cli.run(argv[0], argv[1:], job=job, decision=decision)
    parser = argparse.ArgumentParser(prog="trl-ext", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in trl_cli.COMMANDS:
        commands.add_parser(name, add_help=False,
                            help=f"trl {name}, with trl_ext's trainer: the same options and configs")
    commands.add_parser("env", help=_env.__doc__).set_defaults(func=_env)
    commands.add_parser("model", help=_model.__doc__).set_defaults(func=_model)
    verify = commands.add_parser("verify", help=_verify.__doc__, description=_verify.__doc__)
    verify.add_argument("path", help="checkpoint directory (adapter or full model), or the URL of a mirrored "
                                     "checkpoint or model (s3://bucket/run/checkpoint-20)")
    verify.add_argument("--storage-options", default=None,
                        help="a URL's fsspec storage options as JSON (default: the store's standard credentials)")
    verify.add_argument("--base", help="base model id or path: check that the adapter's shapes match it")
    verify.add_argument("--num-labels", type=int, default=1,
                        help="outputs a sequence-classification head must have (default 1: a reward model)")
    verify.set_defaults(func=_verify)
    merge = commands.add_parser("merge", help=_merge.__doc__, description=_merge.__doc__)
    merge.add_argument("--adapter", required=True, action="append",
                       help="the adapter directory (adapter_config.json + weights)")
    merge.add_argument("--out", required=True, help="where to write the merged model (must not hold files)")
    merge.add_argument("--base", help="base model id or path (default: the one recorded in the adapter)")
    merge.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="dtype to write floating tensors in (default: auto, each base tensor's own)")
    merge.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    merge.add_argument("--dequantize-base", action="store_true",
                       help="allow a quantized base checkpoint: load it and dequantize before merging (in memory)")
    merge.set_defaults(func=_merge)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
