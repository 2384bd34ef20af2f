"""OnlineDPOTrainer: TRL 1.16's config fields and constructor, losses and gradients equal to TRL's trainer with
generation fixed (both loss types, with and without a missing-EOS penalty, PEFT), the pair ranking and metrics
against a hand computation, and a toy task it learns."""

import dataclasses
import inspect
import os
from statistics import mean

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from tests.helpers import count_a, prompt_dataset, tiny_run_args
from tests.trainers.test_rloo_equivalence import GradRecorder
from trl_unified import OnlineDPOConfig, OnlineDPOTrainer
from trl_unified.testing import build_causal_lm


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_online_dpo = pytest.importorskip("trl.experimental.online_dpo")
LENGTH = 6


def test_config_has_every_trl_field_with_the_same_default():
    ours = {f.name: f for f in dataclasses.fields(OnlineDPOConfig)}
    for f in dataclasses.fields(trl_online_dpo.OnlineDPOConfig):
        assert f.name in ours, f.name
        mine = ours[f.name]
        theirs = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        mine = mine.default if mine.default is not dataclasses.MISSING else mine.default_factory()
        assert mine == theirs, (f.name, mine, theirs)
    assert OnlineDPOConfig(output_dir="x", use_cpu=True).beta == 0.1  # a one-entry list becomes its value (TRL)


def test_constructor_takes_trl_arguments_in_trl_order():
    theirs = list(inspect.signature(trl_online_dpo.OnlineDPOTrainer.__init__).parameters)
    ours = list(inspect.signature(OnlineDPOTrainer.__init__).parameters)
    assert ours[: len(theirs)] == theirs, (ours, theirs)


def paired_generate(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
    """Fixed 'generation': each row's tokens from its prompt's content and how many earlier rows of the call repeat
    that prompt (so TRL's layout, the pair's rows B apart, and ours, the pair side by side, get the same pairs)."""
    rows, seen, eos, vocab = [], {}, self.config.eos_token_id, self.config.vocab_size
    for ids, mask in zip(input_ids, attention_mask):
        key = tuple(ids[mask.bool()].tolist())
        k, seen[key] = seen.get(key, 0), seen.get(key, 0) + 1
        seed = sum(key) * 7 + k * 31
        tokens = [(seed + 5 * j + j * j * (k + 1)) % (vocab - 10) + 5 for j in range(LENGTH)]
        if (seed + k) % 3:
            tokens[2 + k] = eos
        rows.append(tokens)
    return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=1)


def reward_first_tokens(completion_ids, **kwargs):
    return [float(sum(ids[:3]) % 7) / 7 for ids in completion_ids]


def run(module, model_path, tokenizer, tmp_path, peft, **overrides):
    kwargs = dict(output_dir=str(tmp_path / module.__name__), per_device_train_batch_size=2, max_new_tokens=LENGTH,
                  max_steps=3, learning_rate=1e-3, logging_steps=1, bf16=False, report_to=[], save_strategy="no",
                  gradient_checkpointing=False, seed=7, use_cpu=True, **overrides)  # fmt: skip
    if module is not trl_online_dpo:
        kwargs["lean_decoding"] = False  # model.generate, the fixed one, as TRL
    recorder = GradRecorder()
    trainer = module.OnlineDPOTrainer(
        model_path, reward_funcs=reward_first_tokens, args=module.OnlineDPOConfig(**kwargs),
        train_dataset=Dataset.from_dict({"prompt": ["a b c", "d e"]}), processing_class=tokenizer,
        callbacks=[recorder], peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]) if peft else None,
    )  # fmt: skip
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer.state.log_history, recorder.grads, params


CASES = {
    "sigmoid": {},
    "ipo": dict(loss_type="ipo", beta=0.5),
    "eos_penalty": dict(missing_eos_penalty=1.0),
    "peft": dict(peft=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_losses_and_gradients_equal_trl(case, qwen2_path, tmp_path, monkeypatch):
    monkeypatch.setattr(Qwen2ForCausalLM, "generate", paired_generate)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen2_path)
    overrides = dict(CASES[case])
    peft = overrides.pop("peft", False)
    theirs = run(trl_online_dpo, qwen2_path, tokenizer, tmp_path, peft, **overrides)
    import trl_unified

    ours = run(trl_unified, qwen2_path, tokenizer, tmp_path, peft, **overrides)
    for key in ("loss", "objective/scores", "objective/scores_margin", "rewards/chosen", "rewards/rejected",
                "rewards/margins", "logps/chosen", "logps/rejected", "val/contain_eos_token", "beta"):  # fmt: skip
        mine, reference = ([log[key] for log in logs[0] if key in log] for logs in (ours, theirs))
        assert len(mine) == len(reference) == 3, key
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(reference), rtol=1e-4, atol=1e-4, msg=key)
    assert len(ours[1]) == len(theirs[1]) == 3
    for step, (mine, reference) in enumerate(zip(ours[1], theirs[1])):
        assert any(g.abs().sum() > 0 for g in mine.values()), step
        for name in reference:
            torch.testing.assert_close(mine[name], reference[name], rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")
    for name, value in theirs[2].items():
        torch.testing.assert_close(ours[2][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_pairs_are_ranked_by_reward_and_the_loss_is_dpos(tokenizer, tmp_path):
    """By hand: sigmoid loss -log σ(β (h_w - h_l)) over pairs ranked by score (ties: the first wins)."""
    args = tiny_run_args(OnlineDPOConfig, tmp_path, per_device_train_batch_size=2, max_new_tokens=4, beta=0.5)
    trainer = OnlineDPOTrainer(build_causal_lm(tokenizer), reward_funcs=count_a, args=args,
                               train_dataset=prompt_dataset(), processing_class=tokenizer)  # fmt: skip
    assert (trainer.use_vllm, trainer.vllm_mode) == (False, None)  # TRL's online DPO attributes (GRPO: "colocate")
    with torch.no_grad():  # the policy away from the reference, so the log-ratios differ
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    trainer.model.train()
    batch = trainer.rollout([{"prompt": p} for p in ["a b", "a b", "c d", "c d"]])
    batch.scores = torch.tensor([0.2, 0.7, 0.5, 0.5])  # pair 1: the second wins; pair 2: a tie, the first
    with torch.no_grad():
        loss = trainer.compute_policy_loss(trainer.model, batch)
        per_token = trainer.policy_logprobs(trainer.model, batch).logps
    h = ((per_token - batch.ref_logps) * batch.loss_mask).sum(1)
    expected = -torch.nn.functional.logsigmoid(0.5 * torch.stack([h[1] - h[0], h[2] - h[3]])).mean()
    assert h.abs().min() > 1e-3
    torch.testing.assert_close(loss, expected)
    assert trainer._metrics["train"]["objective/scores_margin"][-1] == pytest.approx(0.25)


@pytest.mark.slow
def test_online_dpo_learns_the_toy_reward(tokenizer, tmp_path):
    """count_a is sparse: most pairs tie at 0 (the first then counts as chosen, as TRL), so the signal comes from the
    few pairs that differ; at lr 3e-3 60 steps move the score 0.01 -> 0.03, at 1e-2 to about 0.88 (seeds 0-2)."""
    args = tiny_run_args(OnlineDPOConfig, tmp_path, per_device_train_batch_size=8, max_new_tokens=12, max_steps=60,
                         learning_rate=1e-2, beta=0.1, temperature=1.0)  # fmt: skip
    trainer = OnlineDPOTrainer(build_causal_lm(tokenizer), reward_funcs=count_a, args=args,
                               train_dataset=prompt_dataset(64), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    scores = [log["objective/scores"] for log in trainer.state.log_history if "objective/scores" in log]
    assert mean(scores[-10:]) > mean(scores[:10]) + 0.5, scores
