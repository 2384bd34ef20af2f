"""Run by test_resume.py in a subprocess: train (mode=full), train and SIGKILL itself right after checkpoint-3
(mode=kill), or resume from the last checkpoint (mode=resume). Writes final parameters and the log history."""

import json
import os
import signal
import sys

import torch


torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_unified import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    GRMConfig,
    GRMTrainer,
    PPOConfig,
    PPOTrainer,
    RLOOConfig,
    RLOOTrainer,
)
from trl_unified.testing import build_causal_lm, build_sequence_classifier, build_tokenizer  # noqa: E402


kind, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]


class KillAfterCheckpoint(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 3:
            os.kill(os.getpid(), signal.SIGKILL)


def varied(completions, **kwargs):
    return [sum(ord(w[0]) % 7 for w in c.split()) / (7 * max(1, len(c.split()))) for c in completions]


tokenizer = build_tokenizer()
model = build_causal_lm(tokenizer, "llama")
common = dict(
    output_dir=f"{out}/{kind}",
    max_steps=6,
    save_strategy="steps",
    save_steps=3,
    logging_steps=1,
    learning_rate=1e-2,
    bf16=False,
    report_to=[],
    gradient_checkpointing=False,
    seed=3,
    disable_tqdm=True,
)
callbacks = [KillAfterCheckpoint()] if mode == "kill" else []
if kind == "grm":
    data = Dataset.from_dict(
        {
            "prompt": [f"which is larger : {a} or {b} ?" for a in range(4) for b in range(4)],
            "completion": [f"<answer> {max(a, b)} </answer>" for a in range(4) for b in range(4)],
        }
    )
    trainer = GRMTrainer(
        model,
        args=GRMConfig(per_device_train_batch_size=4, **common),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
elif kind.startswith("dpo"):  # dpo: reference copy; dpo_precompute: precomputed reference log-probs
    pairs = {
        "prompt": ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q", "r s t u"] * 2,
        "chosen": [" a b", " c", " d e f", " g", " h i", " j", " k l m", " n"] * 2,
        "rejected": [" o", " p q", " r", " s t u", " v", " w x", " y", " z a"] * 2,
    }
    args = DPOConfig(per_device_train_batch_size=4, precompute_ref_log_probs=kind == "dpo_precompute", **common)
    trainer = DPOTrainer(
        model, args=args, train_dataset=Dataset.from_dict(pairs), processing_class=tokenizer, callbacks=callbacks
    )
elif kind == "ppo":  # two optimiser steps per rollout: checkpoint-3 falls inside the second rollout
    prompts = ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q", "r s t u"]
    args = PPOConfig(
        per_device_train_batch_size=4,
        num_ppo_epochs=2,
        response_length=6,
        stop_token="eos",
        num_sample_generations=0,
        **common,
    )
    trainer = PPOTrainer(
        args,
        tokenizer,
        model,
        reward_model=build_sequence_classifier(tokenizer, seed=2),
        train_dataset=Dataset.from_dict({"prompt": prompts * 2}),
        value_model=build_sequence_classifier(tokenizer, seed=1),
        callbacks=callbacks,
    )
else:
    prompts = ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q", "r s t u"]
    args = RLOOConfig(
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        beta=0.1,
        num_iterations=2 if kind == "rloo_mu2" else 1,
        **common,
    )
    trainer = RLOOTrainer(
        model,
        varied,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts * 2}),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
trainer.train(resume_from_checkpoint=(mode == "resume"))
torch.save({n: p.detach() for n, p in trainer.model.named_parameters()}, f"{out}/{kind}-{mode}.pt")
json.dump(trainer.state.log_history, open(f"{out}/{kind}-{mode}.json", "w"))
