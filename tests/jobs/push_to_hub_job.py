"""Run in a subprocess by test_hub.py (HF_ENDPOINT must be set before huggingface_hub is imported)."""

import sys

import torch


torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402

from trl_unified import DPOConfig, DPOTrainer, GRMConfig, GRMTrainer, RLOOConfig, RLOOTrainer  # noqa: E402
from trl_unified.testing import build_causal_lm, build_tokenizer, save_tiny_model  # noqa: E402


kind, out, token = sys.argv[1], sys.argv[2], sys.argv[3]
tokenizer = build_tokenizer()
path = save_tiny_model(build_causal_lm(tokenizer, "llama"), tokenizer, f"{out}/base")
common = dict(
    output_dir=f"{out}/run",
    max_steps=1,
    bf16=False,
    report_to=[],
    save_strategy="no",
    gradient_checkpointing=False,
    hub_model_id=f"tester/tiny-{kind}",
    hub_token=token,
    logging_steps=1,
)
data = Dataset.from_dict({"prompt": ["a b", "c d"] * 4, "completion": ["<answer> a </answer>"] * 8})
if kind == "dpo":
    pairs = Dataset.from_dict({"prompt": ["a b", "c d"] * 4, "chosen": [" e"] * 8, "rejected": [" f g"] * 8})
    trainer = DPOTrainer(path, args=DPOConfig(per_device_train_batch_size=4, **common), train_dataset=pairs)
elif kind == "grm":
    trainer = GRMTrainer(path, args=GRMConfig(per_device_train_batch_size=4, **common), train_dataset=data)
else:
    trainer = RLOOTrainer(
        path,
        lambda completions, **kw: [float(len(c)) for c in completions],
        args=RLOOConfig(per_device_train_batch_size=4, num_generations=2, max_completion_length=4, **common),
        train_dataset=data.remove_columns("completion"),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if kind == "rloo_peft" else None,
    )
trainer.train()
trainer.push_to_hub(dataset_name="tester/toy-prompts")
print("pushed")
