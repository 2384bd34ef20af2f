# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified ppo` and `examples/ppo.py` (usage in its docstring): TRL 1.12's PPO script (script args + PPOConfig +
ModelConfig) with trl_unified's classes, or with no model and no config the offline demo."""

import os
import sys

from datasets import load_dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_unified import PPOConfig, PPOTrainer
from trl_unified.scripts.online import DemoArguments, demo_model_and_data, target_fraction
from trl_unified.scripts.trl_scripts import plot


DEMO_DEFAULTS = dict(
    per_device_train_batch_size=16,
    num_ppo_epochs=2,
    response_length=12,
    total_episodes=16 * 80,
    learning_rate=1e-2,
    kl_coef=0.0,
    vf_coef=0.5,
    num_sample_generations=0,
    logging_steps=10,
    save_strategy="no",
    report_to="none",
    gradient_checkpointing=False,
    seed=0,
    output_dir="outputs/ppo-demo",
)


def is_demo(argv) -> bool:
    return not any(a.startswith(("--model_name_or_path", "--sft_model_path", "--config")) for a in argv)


def make_parser(prog=None, argv=None):
    parser = TrlParser((ScriptArguments, PPOConfig, ModelConfig, DemoArguments), prog=prog)
    if is_demo(sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**DEMO_DEFAULTS)
    return parser


def main():
    demo = is_demo(sys.argv[1:])
    script_args, args, model_args, demo_args = make_parser().parse_args_and_config()
    peft_config = None if demo else get_peft_config(model_args)
    if demo:
        policy, tokenizer, train_dataset, eval_dataset = demo_model_and_data(args)
        value_path, reward_model, reward_funcs = policy, None, [target_fraction(demo_args.target_word)]
    else:
        policy = model_args.model_name_or_path or args.sft_model_path
        tokenizer = AutoTokenizer.from_pretrained(policy, padding_side="left")
        value_path, reward_funcs = args.reward_model_path, None
        reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model_path, num_labels=1)
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        train_dataset = dataset[script_args.dataset_train_split]
        eval_dataset = dataset.get(script_args.dataset_test_split) if args.eval_strategy != "no" else None
    value_model = AutoModelForSequenceClassification.from_pretrained(value_path, num_labels=1)
    trainer = PPOTrainer(
        args,
        tokenizer,
        policy,
        ref_model=None,  # a frozen copy of the policy (or, with PEFT, the policy with its adapter disabled)
        reward_model=reward_model,
        train_dataset=train_dataset,
        value_model=value_model,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        reward_funcs=reward_funcs,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    scores = [log["objective/scores"] for log in trainer.state.log_history if "objective/scores" in log]
    if trainer.accelerator.is_main_process and scores:
        print(f"score at start: {scores[0]:.3f}   score at end: {scores[-1]:.3f}   ({len(scores)} logs)")
        plot(trainer.state.log_history, ("objective/scores",), os.path.join(args.output_dir, "reward_curve.png"),
             "PPO training score")  # fmt: skip
        print(f"policy, tokenizer, model card and reward curve saved to {args.output_dir}")
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
