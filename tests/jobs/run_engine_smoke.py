"""Run by test_engines.py under a DeepSpeed/FSDP accelerate config: RLOO (beta > 0: a prepared reference model)
trains a few steps, GRM trains and evaluates (generative accuracy). The main process writes a summary."""

import json
import os
import sys

import torch


torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402

from trl_unified import GRMConfig, GRMTrainer, RLOOConfig, RLOOTrainer  # noqa: E402
from trl_unified.testing import build_causal_lm, build_tokenizer, save_tiny_model  # noqa: E402


kind, out = sys.argv[1], sys.argv[2]
tokenizer = build_tokenizer()
path = save_tiny_model(build_causal_lm(tokenizer, "llama"), tokenizer, f"{out}/model-{os.environ.get('RANK', '0')}")
common = dict(
    output_dir=f"{out}/{kind}",
    max_steps=3,
    learning_rate=1e-2,
    bf16=False,
    report_to=[],
    save_strategy="no",
    gradient_checkpointing=False,
    logging_steps=1,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    disable_tqdm=True,
)
data = Dataset.from_dict(
    {
        "prompt": [f"which is larger : {a} or {b} ?" for a, b in [(1, 2), (3, 9), (4, 0), (7, 5)] * 2],
        "completion": [f"<answer> {max(a, b)} </answer>" for a, b in [(1, 2), (3, 9), (4, 0), (7, 5)] * 2],
    }
)
if kind == "rloo":
    trainer = RLOOTrainer(
        path,
        lambda completion_ids, **kw: [(ids[0] % 5) / 5 for ids in completion_ids],
        args=RLOOConfig(num_generations=4, max_completion_length=5, beta=0.1, **common),
        train_dataset=data.remove_columns("completion"),
        processing_class=tokenizer,
    )
else:
    trainer = GRMTrainer(
        path,
        args=GRMConfig(max_completion_length=6, **common),
        train_dataset=data,
        eval_dataset=data.select(range(5)),
        processing_class=tokenizer,
    )
gathers = []
if trainer.is_deepspeed_enabled:
    import deepspeed

    original = deepspeed.zero.GatheredParameters

    def counting(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    deepspeed.zero.GatheredParameters = counting
ref = trainer.reference_model.model
summary = {
    "ref_partitioned": ref is not None and any(hasattr(p, "ds_id") for p in ref.parameters()),
    "engine": str(trainer.accelerator.distributed_type),
    "processes": trainer.accelerator.num_processes,
    "reference": trainer.reference_model.kind,
    "reference_type": type(trainer.reference_model.model).__name__,
}
trainer.train()
metrics = trainer.evaluate() if kind == "grm" else {}
summary.update(logs=trainer.state.log_history, metrics=metrics, gathers=len(gathers))
if trainer.accelerator.is_main_process:
    json.dump(summary, open(f"{out}/{kind}-summary.json", "w"), default=str)
