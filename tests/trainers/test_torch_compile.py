"""`torch_compile=True` trains every trainer (issue 28 item 3): the Trainer wraps the policy in torch.compile's
`OptimizedModule`, and generation decodes the module it wraps. The default suite compiles with the "eager" dynamo
backend (the same wrapper and graph capture, no code generation); the inductor run is in the slow group."""

import pytest
import torch
from datasets import Dataset

from tests.helpers import PROMPTS, count_a, prompt_dataset, tiny_run_args
from trl_unified import (
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
from trl_unified.testing import build_causal_lm, build_sequence_classifier


COMPILE = dict(torch_compile=True, torch_compile_backend="eager")
PAIRS = Dataset.from_dict({"prompt": PROMPTS[:4] * 2, "chosen": [" a a"] * 8, "rejected": [" b"] * 8})


def build(name, llama_path, tokenizer, tmp_path, **compile_args):
    out = tmp_path / name
    if name in ("rloo", "grpo"):
        config, trainer = (RLOOConfig, RLOOTrainer) if name == "rloo" else (GRPOConfig, GRPOTrainer)
        args = tiny_run_args(config, out, num_generations=2, max_completion_length=4, **compile_args)
        return trainer(llama_path, reward_funcs=count_a, args=args, train_dataset=prompt_dataset(8))
    if name == "ppo":
        args = tiny_run_args(PPOConfig, out, max_steps=-1, total_episodes=8, response_length=4, num_ppo_epochs=1,
                             num_sample_generations=0, **compile_args)  # fmt: skip
        data = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in PROMPTS[:8]]})
        reward, value = build_sequence_classifier(tokenizer, seed=2), build_sequence_classifier(tokenizer, seed=1)
        return PPOTrainer(args, tokenizer, build_causal_lm(tokenizer, "llama"), None, reward, data, value)
    if name in ("dpo", "kto"):
        config, trainer = (DPOConfig, DPOTrainer) if name == "dpo" else (KTOConfig, KTOTrainer)
        return trainer(llama_path, args=tiny_run_args(config, out, **compile_args), train_dataset=PAIRS)
    rows = {"prompt": PROMPTS[:8], "completion": [" <answer> a </answer>"] * 8, "answer": ["a"] * 8}
    args = tiny_run_args(GRMConfig, out, max_completion_length=4, per_device_eval_batch_size=4, **compile_args)
    data = Dataset.from_dict(rows)
    return GRMTrainer(llama_path, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer)


@pytest.mark.parametrize("name", ["rloo", "grpo", "ppo", "dpo", "kto", "grm"])
def test_every_trainer_trains_compiled(name, llama_path, tokenizer, tmp_path):
    trainer = build(name, llama_path, tokenizer, tmp_path, **COMPILE)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    assert type(model).__name__ == "OptimizedModule"  # the run really was compiled
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    if name == "grm":  # generative evaluation decodes with the compiled model's module
        assert 0.0 <= trainer.evaluate()["eval_accuracy"] <= 1.0


@pytest.mark.slow
def test_rloo_trains_compiled_with_inductor(llama_path, tokenizer, tmp_path):
    trainer = build("rloo", llama_path, tokenizer, tmp_path, torch_compile=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
