# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified distillation`: on-policy distillation of a student into a teacher's distribution.

With no model and no config it runs an offline demo on CPU: a tiny student and a larger tiny teacher (same
word-level tokenizer, a sharpened random teacher) built locally, synthetic prompts, a held-out split; it prints the
held-out divergence before and after training. With arguments it is TRL's distillation script:

    trl-unified distillation --model_name_or_path <student> --teacher_model_name_or_path <teacher> \\
        --dataset_name <prompts dataset> --max_completion_length 128 --beta 0.5 --output_dir distilled
"""

import os
import sys
from dataclasses import dataclass, field

import torch
from datasets import Dataset, load_dataset
from transformers import AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_unified import DistillationConfig, DistillationTrainer


@dataclass
class DistillationScriptArguments(ScriptArguments):
    dataset_name: str | None = field(default=None, metadata={"help": "Dataset id or path. None runs the demo."})


DEMO_DEFAULTS = dict(
    per_device_train_batch_size=8, per_device_eval_batch_size=8, max_completion_length=12, learning_rate=1e-2,
    beta=0.5, max_steps=40, logging_steps=5, save_strategy="no", report_to="none", gradient_checkpointing=False,
    bf16=False, seed=0, output_dir="outputs/distillation-demo",
)  # fmt: skip


def is_demo(argv) -> bool:
    return "--model_name_or_path" not in " ".join(argv) and "--config" not in argv


def make_parser(prog=None, argv=None):
    parser = TrlParser((DistillationScriptArguments, DistillationConfig, ModelConfig), prog=prog)
    if is_demo(sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**DEMO_DEFAULTS)
    return parser


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


def main():
    demo = is_demo(sys.argv[1:])
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    if demo:
        model, teacher, train_dataset, eval_dataset = demo_models_and_data(training_args)
    else:
        model, teacher = model_args.model_name_or_path, training_args.teacher_model_name_or_path
        training_args.model_init_kwargs = {
            "revision": model_args.model_revision, "dtype": model_args.dtype,
            **(training_args.model_init_kwargs or {}),
        }  # fmt: skip
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        train_dataset = dataset[script_args.dataset_train_split]
        eval_dataset = dataset.get(script_args.dataset_test_split) if training_args.eval_strategy != "no" else None
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    trainer = DistillationTrainer(
        model, teacher, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, peft_config=None if demo else get_peft_config(model_args),
    )  # fmt: skip
    before = trainer.evaluate()["eval_loss"] if eval_dataset is not None else None
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if before is not None:
        after = trainer.evaluate()["eval_loss"]
        if trainer.accelerator.is_main_process:
            print(f"held-out divergence (beta={training_args.beta}): {before:.4f} -> {after:.4f}")
    if trainer.accelerator.is_main_process:
        print(f"student, tokenizer and model card saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
