# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified distillation`: TRL's distillation script with trl_unified's classes (`scripts/trl_scripts.py`; usage:
docs/cli.md), or with no model and no config an offline demo on CPU: a tiny student and a larger, sharpened tiny
teacher (one word-level tokenizer) built locally, synthetic prompts and a held-out split; it prints the held-out
divergence before and after training. `examples/distill.py` distils SmolLM2-135M-Instruct instead."""

import os
import sys

import torch
from datasets import Dataset
from trl import get_peft_config

from trl_unified import DistillationTrainer
from trl_unified.scripts import trl_scripts


DEMO_DEFAULTS = dict(
    per_device_train_batch_size=8, per_device_eval_batch_size=8, max_completion_length=12, learning_rate=1e-2,
    beta=0.5, max_steps=40, logging_steps=5, save_strategy="no", report_to="none", gradient_checkpointing=False,
    bf16=False, seed=0, output_dir="outputs/distillation-demo",
)  # fmt: skip


def demo_models_and_data(training_args):
    """(student path, teacher path, train prompts, held-out prompts), the models saved in the trl_unified cache."""
    from trl_unified.pretrained import cache_dir
    from trl_unified.testing import build_causal_lm, build_tokenizer, save_tiny_model

    student, teacher = (os.path.join(cache_dir(), f"distillation-demo-{n}") for n in ("student", "teacher"))
    with training_args.main_process_first(desc="build the demo models"):
        if training_args.process_index == 0:
            tokenizer = build_tokenizer()
            save_tiny_model(build_causal_lm(tokenizer, "qwen2", hidden_size=32), tokenizer, student)
            big = build_causal_lm(tokenizer, "qwen2", hidden_size=64, num_layers=3, seed=1)
            with torch.no_grad():
                big.lm_head.weight.mul_(8.0)  # a peaked teacher, far from the random student
            save_tiny_model(big, tokenizer, teacher)
    words = "b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    prompts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(1 + i % 5)) for i in range(320)]
    return student, teacher, Dataset.from_dict({"prompt": prompts[:256]}), Dataset.from_dict({"prompt": prompts[256:]})


def demo_parser(name: str, prog=None):
    parser = trl_scripts.make_parser(name, prog)
    parser.set_defaults(**DEMO_DEFAULTS)
    return parser


def demo(name: str, argv: list[str]) -> None:
    _, training_args, model_args, _ = demo_parser(name).parse_args_and_config(argv)
    model, teacher, train_dataset, eval_dataset = demo_models_and_data(training_args)
    trainer = DistillationTrainer(
        model, teacher, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )  # fmt: skip
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    after = trainer.evaluate()["eval_loss"]
    trainer.accelerator.print(f"held-out divergence (beta={training_args.beta}): {before:.4f} -> {after:.4f}")
    trainer.accelerator.print(f"student, tokenizer and model card saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub()


make_parser, main = trl_scripts.entry_points("distillation", sys.modules[__name__])  # the demo is above


if __name__ == "__main__":
    main()
