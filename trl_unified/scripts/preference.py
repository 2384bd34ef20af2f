# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""The script behind `trl-unified dpo|kto` (and `examples/dpo.py`, `examples/kto.py`): an offline demo with no
arguments, a TRL-style script (script arguments + the trainer's config + `trl.ModelConfig`, or a YAML file via
--config) otherwise."""

import os
import random
import sys

from datasets import Dataset, load_dataset
from transformers import AutoTokenizer
from trl import (
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_peft_config,
    get_quantization_config,
    unpair_preference_dataset,
)


DEMO_DEFAULTS = dict(
    per_device_train_batch_size=8,
    per_device_eval_batch_size=32,
    max_steps=40,
    learning_rate=3e-3,
    logging_steps=5,
    eval_strategy="steps",
    eval_steps=10,
    save_strategy="no",
    report_to="none",
    gradient_checkpointing=False,
    bf16=False,
    seed=0,
)


def toy_preferences(n: int, seed: int) -> Dataset:
    """Prompts of random words; the chosen completion uses words a-m, the rejected one words n-z."""
    rng = random.Random(seed)
    words = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        rows["prompt"].append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))))
        rows["chosen"].append(" " + " ".join(rng.choice(words[:13]) for _ in range(3)))
        rows["rejected"].append(" " + " ".join(rng.choice(words[13:]) for _ in range(3)))
    return Dataset.from_dict(rows)


def demo_model(training_args) -> str:
    """A tiny Qwen2-style model + word-level tokenizer, saved in the trl_unified cache (outside output_dir)."""
    from trl_unified.pretrained import cache_dir
    from trl_unified.testing import build_causal_lm, build_tokenizer, save_tiny_model

    path = os.path.join(cache_dir(), "preference-demo-base-model")
    with training_args.main_process_first(desc="build the demo model"):
        if training_args.process_index == 0:
            tokenizer = build_tokenizer()
            save_tiny_model(build_causal_lm(tokenizer, "qwen2", hidden_size=32), tokenizer, path)
    return path


def is_demo(argv) -> bool:
    """No model and no config on the command line: the offline demo."""
    return "--model_name_or_path" not in " ".join(argv) and "--config" not in argv


def make_parser(trainer_class, config_class, prog=None, argv=None):
    """The script's `TrlParser`, with the demo's defaults when `argv` (default: the command line) names no model
    and no config."""
    parser = TrlParser((ScriptArguments, config_class, ModelConfig), prog=prog)
    if is_demo(sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**DEMO_DEFAULTS, output_dir=f"outputs/{trainer_class._name.lower()}-demo")
    return parser


def main(trainer_class, config_class):
    """Parse the command line (or run the offline demo), train, save, plot reward accuracy and margins, push."""
    demo = is_demo(sys.argv[1:])
    script_args, training_args, model_args = make_parser(trainer_class, config_class).parse_args_and_config()
    if demo:
        model = demo_model(training_args)
        train_dataset, eval_dataset = toy_preferences(256, 0), toy_preferences(64, 1)
        if not trainer_class.paired:  # KTO: unpaired rows, mixed so each batch holds both labels
            train_dataset = unpair_preference_dataset(train_dataset).shuffle(seed=0)
            eval_dataset = unpair_preference_dataset(eval_dataset).shuffle(seed=0)
    else:
        model = model_args.model_name_or_path
        training_args.model_init_kwargs = {
            "revision": model_args.model_revision,
            "attn_implementation": model_args.attn_implementation,
            "dtype": model_args.dtype,
            **(training_args.model_init_kwargs or {}),
        }
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        train_dataset = dataset[script_args.dataset_train_split]
        eval_dataset = dataset.get(script_args.dataset_test_split) if training_args.eval_strategy != "no" else None
    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=training_args.trust_remote_code)
    trainer = trainer_class(
        model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        quantization_config=None if demo else get_quantization_config(model_args),
        peft_config=None if demo else get_peft_config(model_args),
    )
    start = [{**trainer.evaluate(), "step": 0}] if eval_dataset is not None else []  # train() resets the history
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        history = start + trainer.state.log_history
        evals = [log for log in history if "eval_rewards/margins" in log]
        if evals:
            first, last = evals[0], evals[-1]
            accuracy = "eval_rewards/accuracies"
            if accuracy in first:
                print(f"held-out reward accuracy: {first[accuracy]:.3f} -> {last[accuracy]:.3f}")
            print(
                f"held-out reward margin:   {first['eval_rewards/margins']:.3f} -> {last['eval_rewards/margins']:.3f}"
            )
            save_preference_curve(history, os.path.join(training_args.output_dir, "rewards.png"),
                                  f"{trainer._name} on held-out pairs")  # fmt: skip
        print(f"model, tokenizer, model card and rewards.png saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


def save_preference_curve(log_history, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("eval_rewards/accuracies", "reward accuracy"), ("eval_rewards/margins", "reward margin")):
        points = [(log["step"], log[key]) for log in log_history if key in log]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=label)
    ax.set(xlabel="step", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
