# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""The script behind `trl-unified rloo|grpo` and `examples/rloo.py` / `examples/grpo.py`: an offline demo with no
arguments, a TRL-style script (script arguments + the trainer's config + `trl.ModelConfig`, or a YAML file via
--config) otherwise."""

import os
import sys
from dataclasses import dataclass, field

from datasets import Dataset, load_dataset
from transformers import AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config


@dataclass
class OnlineScriptArguments(ScriptArguments):
    dataset_name: str | None = field(
        default=None, metadata={"help": "Dataset id or path. None runs the offline demo."}
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Sequence-classification reward model (id or path)."}
    )
    target_word: str = field(
        default="a", metadata={"help": "Demo reward: fraction of completion words equal to this."}
    )


def target_fraction(word: str):
    def reward(completions, **kwargs):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [t.split().count(word) / max(1, len(t.split())) for t in texts]

    reward.__name__ = f"fraction_of_{word}"
    return reward


def demo_model_and_data(training_args):
    """A tiny model + tokenizer saved to a cache folder (so it loads by path, as a Hub id would) and synthetic prompts.

    The folder is outside output_dir: output_dir is what `--push_to_hub` uploads, and it must hold one model, the
    trained one.
    """
    from trl_unified.testing import build_causal_lm, build_tokenizer, save_tiny_model

    tokenizer = build_tokenizer()
    cache = os.environ.get("TRL_UNIFIED_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "trl_unified"))
    path = os.path.join(cache, "online-demo-base-model")
    with training_args.main_process_first(desc="build the demo model"):  # one process writes, the others read
        if training_args.process_index == 0:
            save_tiny_model(build_causal_lm(tokenizer, "qwen2", hidden_size=64), tokenizer, path)
    words = "b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    prompts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(1 + i % 5)) for i in range(256)]
    return path, tokenizer, Dataset.from_dict({"prompt": prompts}), None


DEMO_DEFAULTS = dict(
    per_device_train_batch_size=16,
    num_generations=4,
    max_completion_length=12,
    learning_rate=1e-2,
    beta=0.0,
    max_steps=120,
    logging_steps=5,
    save_strategy="no",
    report_to="none",
    gradient_checkpointing=False,
    seed=0,
)


def is_demo(argv) -> bool:
    """No model and no config on the command line: the offline demo."""
    return "--model_name_or_path" not in " ".join(argv) and "--config" not in argv


def make_parser(trainer_class, config_class, prog=None, argv=None):
    """The script's `TrlParser` (script arguments, the trainer's config, `trl.ModelConfig`), with the demo's
    defaults when `argv` (default: the command line) names no model and no config."""
    parser = TrlParser((OnlineScriptArguments, config_class, ModelConfig), prog=prog)
    if is_demo(sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**DEMO_DEFAULTS, output_dir=f"outputs/{trainer_class._name.lower()}-demo")
    return parser


def main(trainer_class, config_class):
    """Parse the command line (or run the offline demo: `DEMO_DEFAULTS`, output in outputs/<algo>-demo), train, save,
    plot, push."""
    demo = is_demo(sys.argv[1:])
    script_args, training_args, model_args = make_parser(trainer_class, config_class).parse_args_and_config()

    if demo:
        model, tokenizer, train_dataset, eval_dataset = demo_model_and_data(training_args)
        reward_funcs = [target_fraction(script_args.target_word)]
    else:
        model = model_args.model_name_or_path
        training_args.model_init_kwargs = {
            "revision": model_args.model_revision,
            "attn_implementation": model_args.attn_implementation,
            "dtype": model_args.dtype,
            **(training_args.model_init_kwargs or {}),
        }
        quantization = get_quantization_config(model_args)
        if quantization is not None:
            training_args.model_init_kwargs["device_map"] = "auto"
        tokenizer = AutoTokenizer.from_pretrained(
            model, padding_side="left", trust_remote_code=training_args.trust_remote_code
        )
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        train_dataset = dataset[script_args.dataset_train_split]
        eval_dataset = dataset.get(script_args.dataset_test_split) if training_args.eval_strategy != "no" else None
        reward_funcs = (
            [script_args.reward_model_name_or_path]
            if script_args.reward_model_name_or_path
            else [target_fraction(script_args.target_word)]
        )

    trainer = trainer_class(
        model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        quantization_config=None if demo else get_quantization_config(model_args),
        peft_config=None if demo else get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)

    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    if trainer.accelerator.is_main_process and rewards:
        print(
            f"reward at start: {rewards[0]:.3f}   reward at end: {rewards[-1]:.3f}   (first and last logged means, "
            f"over {len(rewards)} logs)"
        )
        curve = os.path.join(training_args.output_dir, "reward_curve.png")
        save_reward_curve(trainer.state.log_history, curve, f"{trainer._name} training reward")
        print(f"model, tokenizer, model card and reward curve saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


def save_reward_curve(log_history, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [log["step"] for log in log_history if "reward" in log]
    rewards = [log["reward"] for log in log_history if "reward" in log]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker="o", markersize=3)
    ax.set(xlabel="step", ylabel="mean reward", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
