# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified gkd` and `examples/gkd.py`: TRL's distillation script (its flags and YAML keys; TRL 1.16 ships no GKD
script) with trl_unified's GKDTrainer and GKDConfig, or with no model and no config an offline demo on CPU: the
distillation demo's tiny student and sharpened teacher, synthetic `messages` rows whose answers the teacher scores,
half the rounds the student's own samples (`lmbda=0.5`); it prints the held-out divergence before and after."""

import sys

from datasets import Dataset
from trl import get_peft_config

from trl_unified import GKDTrainer
from trl_unified.scripts import distillation, trl_scripts


DEMO_DEFAULTS = {**distillation.DEMO_DEFAULTS, "output_dir": "outputs/gkd-demo", "max_new_tokens": 12, "lmbda": 0.5}
del DEMO_DEFAULTS["max_completion_length"]  # GKD's budget is max_new_tokens


def conversations(prompts: Dataset) -> Dataset:
    """Each prompt as a user turn answered with its words reversed (the completions of off-policy rounds)."""
    return Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": p}, {"role": "assistant", "content": " ".join(reversed(p.split()))}]
                for p in prompts["prompt"]
            ]
        }
    )


def demo_parser(name: str, prog=None):
    parser = trl_scripts.make_parser(name, prog)
    parser.set_defaults(**DEMO_DEFAULTS)
    return parser


def demo(name: str, argv: list[str]) -> None:
    _, training_args, model_args, _ = demo_parser(name).parse_args_and_config(argv)
    model, teacher, train_prompts, eval_prompts = distillation.demo_models_and_data(training_args)
    trainer = GKDTrainer(
        model,
        teacher,
        args=training_args,
        train_dataset=conversations(train_prompts),
        eval_dataset=conversations(eval_prompts),
        peft_config=get_peft_config(model_args),
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    after = trainer.evaluate()["eval_loss"]
    trainer.accelerator.print(f"held-out divergence (beta={training_args.beta}): {before:.4f} -> {after:.4f}")
    trainer.accelerator.print(f"student, tokenizer and model card saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub()


make_parser, main = trl_scripts.entry_points("gkd", sys.modules[__name__])  # the demo is above


if __name__ == "__main__":
    main()
