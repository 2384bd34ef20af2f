# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""The offline demo of `trl-unified dpo|kto|orpo|cpo|tpo` (and of `examples/<name>.py` with no model and no config): a
tiny model learns to prefer completions of the words a-m over n-z; the held-out reward accuracy and margin are
evaluated before training and at every `eval_steps`, printed and plotted (`rewards.png`)."""

import random

from datasets import Dataset
from trl import get_peft_config, unpair_preference_dataset

from trl_unified.scripts.trl_scripts import demo_model, make_parser, report, trainer_class


DEMO_DEFAULTS = dict(
    per_device_train_batch_size=8, per_device_eval_batch_size=32, max_steps=40, learning_rate=3e-3, logging_steps=5,
    eval_strategy="steps", eval_steps=10, save_strategy="no", report_to="none", gradient_checkpointing=False,
    bf16=False, seed=0,
)  # fmt: skip


def toy_preferences(n: int, seed: int, reference: bool = False) -> Dataset:
    """Prompts of random words; the chosen completion uses words a-m, the rejected one words n-z; with `reference`,
    a gold completion of words a-m too (TPO's third completion)."""
    rng = random.Random(seed)
    words = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    rows = {"prompt": [], "chosen": [], "rejected": [], **({"reference": []} if reference else {})}
    for _ in range(n):
        rows["prompt"].append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))))
        rows["chosen"].append(" " + " ".join(rng.choice(words[:13]) for _ in range(3)))
        rows["rejected"].append(" " + " ".join(rng.choice(words[13:]) for _ in range(3)))
        if reference:
            rows["reference"].append(" " + " ".join(rng.choice(words[:13]) for _ in range(3)))
    return Dataset.from_dict(rows)


def demo_parser(name: str, prog=None):
    parser = make_parser(name, prog)
    parser.set_defaults(**DEMO_DEFAULTS, output_dir=f"outputs/{name}-demo")
    return parser


def demo(name: str, argv: list[str]) -> None:
    _, training_args, model_args, _ = demo_parser(name).parse_args_and_config(argv)
    cls, model = trainer_class(name), demo_model(training_args, "preference-demo-base-model", hidden_size=32)
    reference = "reference" in cls.completion_keys  # TPO: a gold completion per row
    train_dataset, eval_dataset = toy_preferences(256, 0, reference), toy_preferences(64, 1, reference)
    if not cls.paired:  # KTO: unpaired rows, mixed so each batch holds both labels
        train_dataset = unpair_preference_dataset(train_dataset).shuffle(seed=0)
        eval_dataset = unpair_preference_dataset(eval_dataset).shuffle(seed=0)
    trainer = cls(
        model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )  # fmt: skip
    start = {**trainer.evaluate(), "step": 0}  # before training (DPO, KTO: the policy is the reference, margin 0)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        report([start, *trainer.state.log_history], training_args.output_dir, trainer._name)
        print(f"model, tokenizer, model card and rewards.png saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub()
