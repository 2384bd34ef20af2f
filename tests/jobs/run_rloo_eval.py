"""Launched by test_multiprocess.py with `accelerate launch` (2 CPU processes, gloo): a few RLOO steps, then the
generative evaluation. The main process writes what the test checks to <out>/result.json."""

import json
import os
import sys

import torch


torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402

from trl_unified import RLOOConfig, RLOOTrainer  # noqa: E402
from trl_unified.testing import build_causal_lm, build_tokenizer, save_tiny_model  # noqa: E402


out = sys.argv[1]
tokenizer = build_tokenizer()
model_path = save_tiny_model(  # each process writes its own copy of the same seeded model
    build_causal_lm(tokenizer, "llama"), tokenizer, os.path.join(out, f"model-{os.environ.get('RANK', '0')}")
)

prompts = ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q"]  # 7 eval rows: uneven across 2 processes


def varied(completions, **kwargs):
    return [sum(ord(w[0]) % 7 for w in c.split()) / (7 * max(1, len(c.split()))) for c in completions]


args = RLOOConfig(
    output_dir=out,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=6,
    max_steps=3,
    learning_rate=1e-2,
    beta=0.1,
    logging_steps=1,
    bf16=False,
    report_to=[],
    save_strategy="no",
    gradient_checkpointing=False,
    per_device_eval_batch_size=4,
    answer_extractor=r"regex:(\S+)\s*$",
)
trainer = RLOOTrainer(
    model_path,
    varied,
    args=args,
    train_dataset=Dataset.from_dict({"prompt": prompts * 4}),
    eval_dataset=Dataset.from_dict({"prompt": prompts, "answer": ["a", "b", "c", "d", "e", "f", "g"]}),
)
before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
trainer.train()
changed = sum(
    not torch.equal(before[n], p.detach())
    for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
)
metrics = trainer.evaluate()
if trainer.accelerator.is_main_process:
    records = [json.loads(line) for line in open(trainer.last_eval_records_path)]
    json.dump(
        {
            "num_processes": trainer.accelerator.num_processes,
            "metrics": metrics,
            "records": records,
            "changed": changed,
            "total": len(before),
            "logs": trainer.state.log_history,
        },
        open(os.path.join(out, "result.json"), "w"),
    )
