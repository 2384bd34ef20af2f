# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""The offline demo of `trl-unified rloo|grpo|online_dpo` (and of `examples/<name>.py` with no model and no
config): a tiny model built locally, synthetic prompts, the reward "fraction of the word `target_word`". Every flag
of TRL's script is accepted (its parser, plus `--target_word`); the demo's defaults are `DEMO_DEFAULTS`."""

from dataclasses import dataclass, field

from datasets import Dataset
from trl import TrlParser, get_peft_config

from trl_unified.scripts.trl_scripts import ReportCallback, demo_model, make_parser, trainer_class


@dataclass
class DemoArguments:
    target_word: str = field(
        default="a", metadata={"help": "Demo reward: fraction of completion words equal to this."}
    )


DEMO_DEFAULTS = dict(
    per_device_train_batch_size=16, num_generations=4, max_completion_length=12, learning_rate=1e-2, beta=0.0,
    max_steps=120, logging_steps=5, save_strategy="no", report_to="none", gradient_checkpointing=False, seed=0,
)  # fmt: skip


# Per command: online DPO samples pairs (2 completions per prompt; the batch counts prompts) with a DPO beta.
DEMO_OVERRIDES = {"online_dpo": dict(num_generations=2, per_device_train_batch_size=8, max_new_tokens=12, beta=0.1,
                                     learning_rate=3e-3, temperature=1.0)}  # fmt: skip


def target_fraction(word: str):
    def reward(completions, **kwargs):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [t.split().count(word) / max(1, len(t.split())) for t in texts]

    reward.__name__ = f"fraction_of_{word}"
    return reward


def demo_model_and_data(training_args):
    """A tiny model (`trl_scripts.demo_model`: loaded by path, as a Hub id), its tokenizer and synthetic prompts."""
    from trl_unified.testing import build_tokenizer

    path = demo_model(training_args, "online-demo-base-model", hidden_size=64)
    words = "b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    prompts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(1 + i % 5)) for i in range(256)]
    return path, build_tokenizer(), Dataset.from_dict({"prompt": prompts}), None


def demo_parser(name: str, prog=None) -> TrlParser:
    parser = TrlParser((*make_parser(name).dataclass_types, DemoArguments), prog=prog)
    parser.set_defaults(**{**DEMO_DEFAULTS, **DEMO_OVERRIDES.get(name, {})}, output_dir=f"outputs/{name}-demo")
    return parser


def demo(name: str, argv: list[str]) -> None:
    """Train on the toy reward, save, print the first and last logged reward, plot it (`reward_curve.png`)."""
    _, training_args, model_args, _, demo_args = demo_parser(name).parse_args_and_config(argv)
    model, tokenizer, train_dataset, eval_dataset = demo_model_and_data(training_args)
    trainer = trainer_class(name)(
        model,
        reward_funcs=[target_fraction(demo_args.target_word)],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    trainer.add_callback(ReportCallback(trainer))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"model, tokenizer, model card and reward curve saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub()
