"""The ``trl-ext`` command."""

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
    from .assets import default_model_path

    print(default_model_path())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-ext", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env", help=_env.__doc__).set_defaults(func=_env)
    commands.add_parser("model", help=_model.__doc__).set_defaults(func=_model)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
