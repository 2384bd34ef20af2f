"""A2POTrainer (A*-PO): TRL's config and constructor, V* by hand, the all-incorrect filter, equal to TRL 1.16's
`trl.experimental.a2po.A2POTrainer` with generation fixed (losses, per-step gradients, parameters, metrics), a resume
that reads V* back instead of sampling again, and learning."""

import dataclasses
import inspect
import math
import os
import types
from statistics import mean

import pytest
import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

import trl_unified
from tests.helpers import tiny_run_args
from tests.trainers.test_rloo_equivalence import GradRecorder
from trl_unified import A2POConfig, A2POTrainer
from trl_unified.testing import build_causal_lm


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
PROMPTS = ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q", "r s t u"]


def test_config_and_constructor_are_trls():
    from trl.experimental.a2po import A2POConfig as TRLConfig
    from trl.experimental.a2po import A2POTrainer as TRLTrainer

    ours = {f.name: f for f in dataclasses.fields(A2POConfig)}
    for f in dataclasses.fields(TRLConfig):
        assert f.name in ours, f.name
        if f.default is not dataclasses.MISSING:
            assert ours[f.name].default == f.default, (f.name, ours[f.name].default, f.default)
    theirs = list(inspect.signature(TRLTrainer.__init__).parameters)
    assert list(inspect.signature(A2POTrainer.__init__).parameters)[: len(theirs)] == theirs
    with pytest.raises(ValueError, match="beta=0.1 does not apply to A\\*-PO"):
        A2POConfig(output_dir="out", bf16=False, beta=0.1)


def alternating(completions, **kwargs):
    """0, 1, 0, 1, ...: each prompt's two reference samples score 0 and 1."""
    return [float(i % 2) for i in range(len(completions))]


def only_target(completions, target, **kwargs):
    return [float(t) for t in target]


def test_v_star_by_hand_and_the_all_incorrect_filter(tokenizer, tmp_path):
    """n = 2 samples per prompt scoring 0 and 1, β₁ = 0.5: V* = 0.5 (log(e⁰ + e²) - log 2); a prompt whose samples
    all score 0 is dropped from training (filter_all_incorrect)."""
    args = tiny_run_args(
        A2POConfig,
        tmp_path,
        num_value_samples=2,
        beta1=0.5,
        max_completion_length=4,
        max_steps=1,
        per_device_train_batch_size=2,
    )
    trainer = A2POTrainer(
        build_causal_lm(tokenizer),
        alternating,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}),
    )
    trainer.before_training(None)
    expected = 0.5 * (math.log(1 + math.exp(2.0)) - math.log(2))
    assert trainer._optimal_values == pytest.approx(dict.fromkeys(PROMPTS[:4], expected))
    rows = Dataset.from_dict({"prompt": PROMPTS[:3], "target": [1, 0, 1]})
    trainer = A2POTrainer(
        build_causal_lm(tokenizer), only_target, args=args, processing_class=tokenizer, train_dataset=rows
    )
    trainer.train()
    assert trainer._optimal_values[PROMPTS[1]] == 0.0
    assert list(trainer.train_dataset["prompt"]) == [PROMPTS[0], PROMPTS[2]]


def same_for_every_sample(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
    """A fixed 'generation' that depends on each prompt only (TRL's reference pass asks for n sequences per prompt
    with num_return_sequences, ours repeats the prompt n times: the same tokens either way). Some end with EOS, as
    their last token: TRL's A2PO rewards the text generated past an EOS too (ours stops at it), so no token follows
    one here."""
    n = getattr(generation_config, "num_return_sequences", 1) or 1
    input_ids = input_ids.repeat_interleave(n, dim=0)
    attention_mask = attention_mask.repeat_interleave(n, dim=0)
    eos, vocab, rows = self.config.eos_token_id, self.config.vocab_size, []
    for prompt, mask in zip(input_ids, attention_mask, strict=True):
        seed = int((prompt * mask).sum()) * 7
        tokens = [(seed + 5 * j + j * j) % (vocab - 10) + 5 for j in range(5)]
        if seed % 3 != 2:
            tokens[-1] = eos
        rows.append(tokens)
    return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=1)


def stage_dependent_reward():
    """The parity of a completion's word count in the value-estimation pass (its first three calls, 12 prompts in
    batches of 4), the opposite afterwards: advantages r - V* far from 0 although every sample of a prompt is alike."""
    calls = []

    def reward(completions, **kwargs):
        calls.append(len(completions))
        flip = len(calls) > 3
        return [float((len(c.split()) % 2) != flip) for c in completions]

    return reward


def run(module, model_path, tokenizer, tmp_path):
    args = module.A2POConfig(
        output_dir=str(tmp_path / module.__name__),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        seed=7,
        max_completion_length=5,
        num_value_samples=2,
        beta2=0.1,
        filter_all_incorrect=False,
    )
    recorder = GradRecorder()
    trainer = module.A2POTrainer(
        model_path,
        reward_funcs=stage_dependent_reward(),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS + [p + " x" for p in PROMPTS[:4]]}),  # 3 steps, one epoch
        processing_class=tokenizer,
        callbacks=[recorder],
    )
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer.state.log_history, recorder.grads, params, trainer._optimal_values


def test_a2po_matches_trl(qwen2_path, tmp_path, monkeypatch):
    import trl.experimental.a2po as trl_a2po

    monkeypatch.setattr(Qwen2ForCausalLM, "generate", same_for_every_sample)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen2_path, padding_side="left")
    theirs_module = types.SimpleNamespace(
        __name__="trl", A2POConfig=trl_a2po.A2POConfig, A2POTrainer=trl_a2po.A2POTrainer
    )
    ref_logs, ref_grads, ref_params, ref_values = run(theirs_module, qwen2_path, tokenizer, tmp_path)
    logs, grads, params, values = run(trl_unified, qwen2_path, tokenizer, tmp_path)
    assert values == pytest.approx(ref_values)
    for step, (g, ref_g) in enumerate(zip(grads, ref_grads, strict=True)):
        assert any(v.abs().sum() > 0 for v in g.values()), f"no gradient at step {step}"
        for name in ref_g:
            torch.testing.assert_close(g[name], ref_g[name], rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")
    for name in params:  # Adam's normalised steps widen float noise in near-zero gradients (as in DPO's test)
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-4, atol=3e-5, msg=name)
    for key in ("loss", "reward", "v_star", "implicit_reward", "advantage"):
        ours, theirs = [log[key] for log in logs if key in log], [log[key] for log in ref_logs if key in log]
        assert len(ours) == len(theirs) == 3, key
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5, msg=key)


def test_a_resume_reads_v_star_back_instead_of_sampling_again(tokenizer, tmp_path, monkeypatch):
    def make():
        args = tiny_run_args(
            A2POConfig,
            tmp_path,
            num_value_samples=2,
            max_completion_length=4,
            max_steps=4,
            per_device_train_batch_size=2,
            save_strategy="steps",
            save_steps=2,
        )
        return A2POTrainer(
            build_causal_lm(tokenizer),
            alternating,
            args=args,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}),
        )

    first = make()
    first.train()
    estimated = []
    monkeypatch.setattr(A2POTrainer, "_estimate_optimal_values", lambda self: estimated.append(self))
    resumed = make()
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert estimated == [] and resumed._optimal_values == first._optimal_values
    assert resumed.state.global_step == 4


def contains_a(completions, **kwargs):
    return [float("a" in c.split()) for c in completions]


@pytest.mark.slow
def test_a2po_learns_a_binary_reward(tokenizer, tmp_path):
    """Reward 1 when the completion says "a": the mean reward of the policy's samples rises."""
    args = tiny_run_args(
        A2POConfig,
        tmp_path,
        max_steps=60,
        per_device_train_batch_size=8,
        max_completion_length=8,
        num_value_samples=4,
        learning_rate=1e-2,
        beta2=0.1,
        filter_all_incorrect=False,
        logging_steps=1,
    )
    prompts = Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(64)]})
    trainer = A2POTrainer(
        build_causal_lm(tokenizer), contains_a, args=args, train_dataset=prompts, processing_class=tokenizer
    )
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.2, rewards
