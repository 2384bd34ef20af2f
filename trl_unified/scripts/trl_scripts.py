# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""TRL's own training scripts with trl_unified's classes: `trl-unified <name>` runs `trl.scripts.<name>`.

Given a model or a config, `trl-unified <name>` is TRL's script as it is (docs/cli.md, "TRL's scripts, our classes"):
TRL's scripts import their classes from `trl` when they run, and `trl_classes` puts ours there for the duration.
"""

import contextlib
import importlib
import os
import sys

from transformers import TrainerCallback


# command: (TRL's script module, its class prefix, ours). TRL 1.16 ships no online DPO script: `online_dpo` is TRL's
# GRPO script (prompts, `reward_funcs`, `reward_model_name_or_path`) with the online DPO classes; nor ORPO, CPO or TPO
# scripts: theirs is TRL's dpo script (preference rows, the same model and dataset flags) with their classes; nor a GKD
# script: GKD's is TRL's distillation script (student, teacher and dataset flags) with the GKD classes.
SCRIPTS = {
    "rloo": ("rloo", "RLOO", "RLOO"), "grpo": ("grpo", "GRPO", "GRPO"), "dpo": ("dpo", "DPO", "DPO"),
    "kto": ("kto", "KTO", "KTO"), "distillation": ("distillation", "Distillation", "Distillation"),
    "online_dpo": ("grpo", "GRPO", "OnlineDPO"), "orpo": ("dpo", "DPO", "ORPO"), "cpo": ("dpo", "DPO", "CPO"),
    "tpo": ("dpo", "DPO", "TPO"), "gkd": ("distillation", "Distillation", "GKD"),
}  # fmt: skip


def is_demo(argv: list[str]) -> bool:
    """No model and no config on the command line: the script's offline demo."""
    return not {arg.split("=")[0] for arg in argv} & {"--config", "--model_name_or_path", "--model-name-or-path"}


def entry_points(name: str, demo_module):
    """`(make_parser, main)` of `scripts/<name>.py`: the offline demo's (`demo_module.demo_parser` / `.demo`)
    without a model or a config, TRL's script's otherwise."""

    def parser(prog=None, argv=None):
        argv = sys.argv[1:] if argv is None else argv
        return demo_module.demo_parser(name, prog) if is_demo(argv) else make_parser(name, prog)

    def main(argv=None):
        argv = sys.argv[1:] if argv is None else argv
        (demo_module.demo if is_demo(argv) else run)(name, argv)

    return parser, main


def trainer_class(name: str):
    return getattr(importlib.import_module("trl_unified"), f"{SCRIPTS[name][2]}Trainer")


@contextlib.contextmanager
def trl_classes(name: str, trainer=None):
    """TRL's script module for `name`, with `trl.<X>Config` / `trl.<X>Trainer` set to trl_unified's (or `trainer`)
    until the block ends. `vars(trl)` is read, not `getattr`: that would import TRL's own trainer first."""
    import trl

    import trl_unified

    (module, theirs, prefix), missing = SCRIPTS[name], object()
    ours = {f"{theirs}Config": getattr(trl_unified, f"{prefix}Config")}
    ours[f"{theirs}Trainer"] = trainer or getattr(trl_unified, f"{prefix}Trainer")
    saved = {key: vars(trl).get(key, missing) for key in ours}
    for key, value in ours.items():
        setattr(trl, key, value)
    try:
        yield importlib.import_module(f"trl.scripts.{module}")
    finally:
        for key, value in saved.items():
            if value is missing:
                delattr(trl, key)  # TRL's lazy module imports its own again on the next access
            else:
                setattr(trl, key, value)


def demo_model(training_args, name: str, hidden_size: int) -> str:
    """The path of a tiny Qwen2-style model + word-level tokenizer that the main process saves in the trl_unified cache
    as `name`: outside output_dir, which is what `--push_to_hub` uploads and must hold one model, the trained one."""
    from trl_unified.pretrained import cache_dir
    from trl_unified.testing import build_causal_lm, build_tokenizer, save_tiny_model

    path = os.path.join(cache_dir(), name)
    with training_args.main_process_first(desc="build the demo model"):  # one process writes, the others read
        if training_args.process_index == 0:
            tokenizer = build_tokenizer()
            save_tiny_model(build_causal_lm(tokenizer, "qwen2", hidden_size=hidden_size), tokenizer, path)
    return path


def make_parser(name: str, prog: str | None = None):
    """TRL's `TrlParser` for `name`, its dataclasses holding trl_unified's config."""
    with trl_classes(name) as script:
        return script.make_parser(prog=prog)


def run(name: str, argv: list[str]) -> None:
    """TRL's script `name` on `argv`, as `trl <name>` runs it in each launched process (unknown keys, meant for
    accelerate, ignored), with trl_unified's classes and a `ReportCallback` on the trainer."""
    cls = trainer_class(name)

    def trainer(*args, **kwargs):  # the class itself is what TRL's script builds (and the model card names)
        built = cls(*args, **kwargs)
        built.add_callback(ReportCallback(built))
        return built

    with trl_classes(name, trainer) as script:
        parsed = script.make_parser(prog=f"trl-unified {name}").parse_args_and_config(
            argv, fail_with_unknown_args=False
        )
        script.main(*parsed)


class ReportCallback(TrainerCallback):
    """At the end of training, on the main process: the first and last logged reward (online trainers) or held-out
    reward margin (preference trainers), and their curve as a PNG in `output_dir`. It reads the log only."""

    def __init__(self, trainer):
        self.name = trainer._name

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            report(state.log_history, args.output_dir, self.name)


def report(log_history: list[dict], output_dir: str, name: str) -> None:
    """Print what a run learned from its logs and plot it: the mean reward (`reward_curve.png`), or the held-out
    reward accuracy and margin (`rewards.png`)."""
    rewards = [log["reward"] for log in log_history if "reward" in log]
    evals = [log for log in log_history if "eval_rewards/margins" in log]
    os.makedirs(output_dir, exist_ok=True)
    if rewards:
        print(
            f"reward at start: {rewards[0]:.3f}   reward at end: {rewards[-1]:.3f}   (first and last logged means, "
            f"over {len(rewards)} logs)"
        )
        plot(log_history, ("reward",), os.path.join(output_dir, "reward_curve.png"), f"{name} training reward")
    if evals:
        first, last = evals[0], evals[-1]
        accuracy, margin = "eval_rewards/accuracies", "eval_rewards/margins"
        if accuracy in first:
            print(f"held-out reward accuracy: {first[accuracy]:.3f} -> {last[accuracy]:.3f}")
        print(f"held-out reward margin:   {first[margin]:.3f} -> {last[margin]:.3f}")
        plot(log_history, (accuracy, margin), os.path.join(output_dir, "rewards.png"), f"{name} on held-out pairs")


def plot(log_history: list[dict], keys, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in keys:
        points = [(log["step"], log[key]) for log in log_history if key in log]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=key.removeprefix("eval_"))
    ax.set(xlabel="step", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
