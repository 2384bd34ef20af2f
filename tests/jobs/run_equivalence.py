"""Run by test_multiprocess.py and test_engines.py: 2 steps of RLOO, GRPO, GRM, DPO or KTO (apo_zero_unpaired, no
per-device KL) with a given layout (ddp: 2 processes x bs 4; fsdp: the same under an FSDP2 accelerate config; single:
1 x bs 8; ga: 1 x bs 4 x accumulation 2); the main process saves the final parameters (whole tensors) and whether
they were sharded."""

import sys

import torch


torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from trl_unified import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    GRMConfig,
    GRMTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    PPOConfig,
    PPOTrainer,
    RLOOConfig,
    RLOOTrainer,
)
from trl_unified.testing import build_causal_lm, build_sequence_classifier, build_tokenizer  # noqa: E402


kind, out, layout = sys.argv[1], sys.argv[2], sys.argv[3]
batch = {
    "ddp": dict(per_device_train_batch_size=4),
    "fsdp": dict(per_device_train_batch_size=4),
    "single": dict(per_device_train_batch_size=8),
    "ga": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
}[layout]
common = dict(
    output_dir=f"{out}/{layout}",
    max_steps=2,
    optim="sgd",
    learning_rate=0.1,
    bf16=False,
    report_to=[],
    save_strategy="no",
    gradient_checkpointing=False,
    seed=0,
    logging_steps=1,
    max_grad_norm=1e9,
    lr_scheduler_type="constant",
    disable_tqdm=True,
    **batch,
)


def fake_generate(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
    """Completions that depend only on the prompt and its occurrence in the call, not on the process layout."""
    seen, rows = {}, []
    for prompt, mask in zip(input_ids, attention_mask):
        key = tuple(prompt[mask.bool()].tolist())
        k = seen[key] = seen.get(key, -1) + 1
        rows.append([(sum(key) * 3 + 11 * k + 7 * j) % 60 + 10 for j in range(5)])
    return torch.cat([input_ids, torch.tensor(rows)], dim=1)


tokenizer = build_tokenizer()
model = build_causal_lm(tokenizer, "llama")
if kind in ("rloo", "grpo"):
    LlamaForCausalLM.generate = fake_generate
    online = {  # GRPO: DAPO's token normalisation across processes and KL with the bias correction
        "rloo": (RLOOTrainer, RLOOConfig(num_generations=4, max_completion_length=5, beta=0.1, **common)),
        "grpo": (GRPOTrainer, GRPOConfig(num_generations=4, max_completion_length=5, beta=0.1, **common)),
    }
    trainer_class, args = online[kind]
    trainer = trainer_class(
        model,
        lambda completion_ids, **kw: [(ids[0] % 5) / 5 for ids in completion_ids],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b c", "d e"]}),
        processing_class=tokenizer,
    )
elif kind == "ppo":  # whitening is per process (as TRL's): 2 processes are checked for their sync, not equality
    LlamaForCausalLM.generate = fake_generate
    ppo = {k: v for k, v in common.items() if k not in ("max_steps", "lr_scheduler_type")}
    args = PPOConfig(num_ppo_epochs=2, response_length=5, total_episodes=16, num_sample_generations=0, **ppo)
    trainer = PPOTrainer(
        args,
        tokenizer,
        model,
        train_dataset=Dataset.from_dict({"prompt": ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q", "r s"]}),
        value_model=build_sequence_classifier(tokenizer, seed=1),
        reward_funcs=lambda completion_ids, **kw: [(ids[0] % 5) / 5 for ids in completion_ids],
    )
elif kind in ("dpo", "kto"):
    pairs = {
        "prompt": ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q", "r s t u"],
        "chosen": [" a b", " c", " d e f", " g", " h i", " j", " k l m", " n"],
        "rejected": [" o", " p q", " r", " s t u", " v", " w x", " y", " z a"],
    }
    if kind == "dpo":
        args = DPOConfig(beta=0.1, max_length=32, **common)
        trainer = DPOTrainer(model, args=args, train_dataset=Dataset.from_dict(pairs), processing_class=tokenizer)
    else:
        rows = {
            "prompt": pairs["prompt"],
            "completion": [c if i % 2 else r for i, (c, r) in enumerate(zip(pairs["chosen"], pairs["rejected"]))],
            "label": [bool(i % 2) for i in range(8)],
        }
        args = KTOConfig(loss_type="apo_zero_unpaired", beta=0.1, max_length=32, **common)
        trainer = KTOTrainer(model, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tokenizer)
else:
    data = Dataset.from_dict(
        {
            "prompt": [f"which is larger : {a} or {b} ?" for a, b in [(1, 2), (3, 9), (4, 0), (7, 5)] * 2],
            "completion": [
                "<answer> 2 </answer>",
                "it is <answer> 9 </answer>",
                "<answer> 4 </answer>",
                "so the answer is <answer> 7 </answer>",
            ]
            * 2,
        }
    )
    trainer = GRMTrainer(model, args=GRMConfig(**common), train_dataset=data, processing_class=tokenizer)
trainer.train()
unwrapped = trainer.accelerator.unwrap_model(trainer.model)
sharded = any(hasattr(p, "full_tensor") for p in unwrapped.parameters())  # FSDP2 parameters are DTensor shards
params = {  # full_tensor() gathers a shard on every rank (a collective: each rank runs this line)
    n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
    for n, p in unwrapped.named_parameters()
}
rank = trainer.accelerator.process_index
logs = trainer.state.log_history
summary = {"params": params, "processes": trainer.accelerator.num_processes, "sharded": sharded}
torch.save({**summary, "logs": logs}, f"{out}/{kind}-{layout}-rank{rank}.pt")
if trainer.accelerator.is_main_process:
    torch.save(summary, f"{out}/{kind}-{layout}.pt")
