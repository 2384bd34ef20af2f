# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""Train a generative reward model (a judge that writes an answer in <answer> tags) with GRMTrainer.

With no arguments it runs an offline demo on CPU in well under a minute: a tiny model and tokenizer are built
locally and learn the synthetic judging task "which of two numbers is larger?" (held-out pairs for evaluation); the
accuracy before and after training is printed, and the model, eval records and model card are saved.

    accelerate launch examples/grm.py
    python examples/grm.py --video     # a tiny Qwen2-VL judge on videos: "does the clip get brighter or darker?"
                                       # (needs torchvision: pip install trl_unified[vision]; about a minute)

With arguments it is a TRL-style script (script args + GRMConfig + ModelConfig, or --config file.yaml). The dataset
needs prompt/completion (the judgment) or messages (the judgment as the last assistant turn) columns, optionally
image/images for a vision-language judge, and optionally an `answer` column for generative accuracy:

    accelerate launch examples/grm.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name <judging-dataset> --use_peft --lora_r 16 --output_dir Qwen2.5-0.5B-GRM --push_to_hub
"""

import os
import random
import sys
from dataclasses import dataclass, field

from datasets import Dataset, load_dataset
from transformers import AutoProcessor
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from trl_unified import GRMConfig, GRMTrainer


DEMO_DEFAULTS = dict(
    output_dir="outputs/grm-demo",
    per_device_train_batch_size=16,
    learning_rate=3e-3,
    max_steps=150,
    logging_steps=25,
    lr_scheduler_type="constant",
    save_strategy="no",
    report_to="none",
    gradient_checkpointing=False,
    max_completion_length=6,
    per_device_eval_batch_size=20,
    seed=0,
)


@dataclass
class GRMScriptArguments(ScriptArguments):
    dataset_name: str | None = field(
        default=None, metadata={"help": "Dataset id or path. None runs the offline demo."}
    )
    video: bool = field(default=False, metadata={"help": "Demo only: the video judge (needs torchvision)."})


def judging_row(a: int, b: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": f"which is larger : {a} or {b} ?"}],
        "completion": [{"role": "assistant", "content": f"<answer> {max(a, b)} </answer>"}],
    }


def demo_model_and_data():
    from trl_unified.testing import build_causal_lm, build_tokenizer

    tokenizer = build_tokenizer()
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(0).shuffle(pairs)
    train = Dataset.from_list([judging_row(a, b) for a, b in pairs[:70]] * 4)
    held_out = Dataset.from_list([judging_row(a, b) for a, b in pairs[70:]])
    return build_causal_lm(tokenizer, "qwen2", hidden_size=64), tokenizer, train, held_out


def video_demo_model_and_data():
    from trl_unified.testing import build_video, build_vision_language_model

    def row(i):
        trend = "brighter" if i % 2 else "darker"
        return {
            "prompt": [{"role": "user", "content": "brighter or darker ?"}],
            "completion": [{"role": "assistant", "content": f"<answer> {trend} </answer>"}],
            "videos": [build_video(trend, seed=i)],  # 4 frames of 56x56; only their order tells the answer
        }

    model, processor = build_vision_language_model(
        ["brighter", "or", "darker", "?", "<answer>", "</answer>"], video=True
    )
    train = Dataset.from_list([row(i) for i in range(64)])
    held_out = Dataset.from_list([row(1000 + i) for i in range(16)])
    return model, processor, train, held_out


def main():
    demo = "--model_name_or_path" not in " ".join(sys.argv) and "--config" not in sys.argv
    parser = TrlParser((GRMScriptArguments, GRMConfig, ModelConfig))
    if demo:
        parser.set_defaults(**DEMO_DEFAULTS)
        if "--video" in sys.argv:
            parser.set_defaults(output_dir="outputs/grm-video-demo", max_steps=40, logging_steps=10)
    script_args, training_args, model_args = parser.parse_args_and_config()

    if demo and script_args.video:
        model, processing_class, train_dataset, eval_dataset = video_demo_model_and_data()
    elif demo:
        model, processing_class, train_dataset, eval_dataset = demo_model_and_data()
    else:
        model = model_args.model_name_or_path
        training_args.model_init_kwargs = {
            "revision": model_args.model_revision,
            "dtype": model_args.dtype,
            "attn_implementation": model_args.attn_implementation,
            **(training_args.model_init_kwargs or {}),
        }
        processing_class = AutoProcessor.from_pretrained(
            model, padding_side="left", trust_remote_code=training_args.trust_remote_code
        )
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        train_dataset = dataset[script_args.dataset_train_split]
        eval_dataset = dataset.get(script_args.dataset_test_split)

    trainer = GRMTrainer(
        model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processing_class,
        quantization_config=None if demo else get_quantization_config(model_args),
        peft_config=None if demo else get_peft_config(model_args),
    )
    before = trainer.evaluate() if eval_dataset is not None else {}
    trainer.train()
    after = trainer.evaluate() if eval_dataset is not None else {}
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        if "eval_accuracy" in after:
            print(
                f"eval accuracy before training: {before['eval_accuracy']:.3f}   after: {after['eval_accuracy']:.3f}"
            )
            print(f"judgments and answers: {trainer.last_eval_records_path}")
        print(
            "model, processing class, eval records and model card saved to "
            f"{os.path.abspath(training_args.output_dir)}"
        )
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
