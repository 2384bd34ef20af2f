"""PPOTrainer: the critic maths against hand computations, TRL 1.12's surface, training, PEFT, gradient accumulation,
bad input. (Equivalence with TRL 1.12 itself, which cannot be installed beside TRL 1.16: benchmarks/ppo_vs_trl.py.)"""

import math
import os

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from tests.helpers import PROMPTS, UNSET, count_a, tiny_run_args
from trl_unified import PPOConfig, PPOTrainer
from trl_unified.online.critic import (
    clipped_value_loss,
    gae_advantages,
    kl_per_token,
    masked_mean,
    masked_var,
    masked_whiten,
    per_token_rewards,
    score_positions,
    value_mask,
)
from trl_unified.testing import build_causal_lm, build_sequence_classifier, build_tokenizer


# ------------------------------------------------------------------ the maths, by hand
def test_gae_equals_a_loop_written_here():
    rewards = torch.tensor([[0.1, -0.2, 1.0, 0.0], [0.5, 0.0, 0.0, 2.0]])
    values = torch.tensor([[0.3, 0.1, -0.4, 0.2], [0.0, 0.7, 0.2, 0.5]])
    gamma, lam = 0.9, 0.8
    expected = torch.zeros_like(rewards)
    for b in range(2):
        running = 0.0
        for t in (3, 2, 1, 0):
            next_value = values[b, t + 1].item() if t < 3 else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            running = delta + gamma * lam * running
            expected[b, t] = running
    torch.testing.assert_close(gae_advantages(rewards, values, gamma, lam), expected)
    # gamma = lambda = 1: the advantage is the reward-to-go minus the value
    torch.testing.assert_close(
        gae_advantages(rewards, values, 1.0, 1.0), rewards.flip(1).cumsum(1).flip(1) - values, rtol=1e-6, atol=1e-6
    )


def test_whitening_matches_the_formula():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -7.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]]).float()
    kept = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, -7.0])
    assert masked_mean(x, mask).item() == pytest.approx(kept.mean().item())
    assert masked_var(x, mask).item() == pytest.approx(kept.var().item())  # unbiased, as torch.var
    whitened = masked_whiten(x, mask)
    expected = (kept - kept.mean()) / math.sqrt(kept.var().item() + 1e-8)
    torch.testing.assert_close(whitened[mask.bool()], expected)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False)[mask.bool()], expected + kept.mean())


def test_kl_estimators_and_score_placement_by_hand():
    logps, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_per_token(logps, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    r = torch.exp(ref - logps)  # π_ref / π
    torch.testing.assert_close(kl_per_token(logps, ref, "k3"), (r - 1) - torch.log(r))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    # one after the last token; the last token itself when the completion fills the width; 0 when empty
    assert score_positions(mask).tolist() == [2, 3, 0]
    assert value_mask(mask).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def test_per_token_rewards_and_clipped_value_loss_by_hand():
    kl = torch.tensor([[0.5, -1.0, 0.0], [0.2, 0.2, 0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards, non_score = per_token_rewards(torch.tensor([2.0, 3.0]), kl, 0.1, mask)
    torch.testing.assert_close(non_score, -0.1 * kl)
    # row 0: the score one after its last token; row 1 fills the width: on its last token
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 2.0], [-0.02, -0.02, 2.98]]))
    values, old, returns = (
        torch.tensor([[1.0, 0.0, 5.0]]),
        torch.tensor([[0.5, 0.0, 0.0]]),
        torch.tensor([[0.0, 1.0, 0.0]]),
    )
    loss, clipfrac = clipped_value_loss(values, old, returns, 0.2, torch.tensor([[1.0, 1.0, 0.0]]))
    # position 0: clip(1.0) = 0.7, max(1.0², 0.7²) = 1.0; position 1: unclipped, 1.0; position 2 masked out
    torch.testing.assert_close(loss, torch.tensor(0.5 * (1.0 + 1.0) / 2))
    torch.testing.assert_close(clipfrac, torch.tensor(0.0))
    loss, clipfrac = clipped_value_loss(
        torch.tensor([[-1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), 0.5, torch.ones(1, 1)
    )
    torch.testing.assert_close(loss, torch.tensor(0.5 * 4.0))  # clip(-1) = -0.5: (−1 − 1)² = 4 > (−0.5 − 1)² = 2.25
    assert clipfrac.item() == 0.0
    loss, clipfrac = clipped_value_loss(
        torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[1.5]]), 0.5, torch.ones(1, 1)
    )
    torch.testing.assert_close(loss, torch.tensor(0.5 * 1.0))  # clip(2) = 0.5: (0.5 − 1.5)² = 1 > (2 − 1.5)² = 0.25
    assert clipfrac.item() == 1.0


# ------------------------------------------------------------------ the trainer
@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ppo_args(tmp_path, **overrides):
    defaults = dict(
        max_steps=UNSET, total_episodes=16, learning_rate=1e-3, num_ppo_epochs=2, response_length=6, stop_token="eos",
        num_sample_generations=0,
    )  # fmt: skip
    return tiny_run_args(PPOConfig, tmp_path / "ppo", **{**defaults, **overrides})


def token_dataset(tok, n=16):
    return Dataset.from_dict({"input_ids": [tok(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(n)]})


def build(tok, tmp_path, peft=False, **overrides):
    return PPOTrainer(
        ppo_args(tmp_path, **overrides),
        tok,
        build_causal_lm(tok, "llama"),
        None,
        build_sequence_classifier(tok, seed=2),
        token_dataset(tok),
        build_sequence_classifier(tok, seed=1),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None,
    )


def test_trl_112_layout_and_derived_batch_sizes(tmp_path):
    args = ppo_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4, num_mini_batches=2)
    assert (args.local_batch_size, args.batch_size, args.micro_batch_size) == (8, 8, 2)
    assert (args.local_mini_batch_size, args.mini_batch_size) == (4, 4)
    assert args.num_total_batches == 2 and args.max_steps == 2 * 2 * 2  # rollouts x epochs x mini-batches
    assert args.gradient_accumulation_steps == 2  # micro-batches per mini-batch: one optimiser step each
    assert (args.kl_coef, args.cliprange, args.vf_coef, args.gamma, args.lam) == (0.05, 0.2, 0.1, 1.0, 0.95)


def test_defaults_are_trl_112s(tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), bf16=False)
    expected = dict(
        learning_rate=3e-6, num_mini_batches=1, total_episodes=None, local_rollout_forward_batch_size=64,
        num_sample_generations=10, response_length=53, stop_token=None, stop_token_id=None, temperature=0.7,
        missing_eos_penalty=None, num_ppo_epochs=4, whiten_rewards=False, kl_coef=0.05, kl_estimator="k1",
        cliprange=0.2, vf_coef=0.1, cliprange_value=0.2, gamma=1.0, lam=0.95, ds3_gather_for_generation=True,
        sft_model_path="EleutherAI/pythia-160m", reward_model_path="EleutherAI/pythia-160m",
    )  # fmt: skip
    assert {k: getattr(args, k) for k in expected} == expected


def test_rollout_rewards_advantages_and_returns_by_hand(tok, tmp_path):
    trainer = build(tok, tmp_path, kl_coef=0.3, missing_eos_penalty=1.5, gamma=0.9, lam=0.8)
    trainer.model.train()
    batch = trainer._prepare_inputs([trainer.train_dataset[i] for i in range(4)])
    rows = trainer._rollout.select(torch.argsort(trainer._rollout.row_index))
    mask = rows.completion_mask.float()
    kl = (rows.old_logps - rows.ref_logps) * mask
    # the reward model's score on the sampled ids, minus the penalty where no EOS was generated
    prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(rows.prompt_ids, rows.prompt_mask)]
    completion_ids = [ids[m.bool()].tolist() for ids, m in zip(rows.completion_ids, rows.completion_mask)]
    scores = torch.tensor(trainer.rewards.funcs[0]([], [], completion_ids, prompt_ids))
    scores = scores - 1.5 * rows.is_truncated.float()
    token_rewards = -0.3 * kl
    for b in range(4):
        last = int(mask[b].sum()) - 1
        token_rewards[b, last + 1 if last + 1 < mask.size(1) else last] += scores[b]
    values = rows.values
    assert values.shape == mask.shape and (values * (1 - value_mask(rows.completion_mask))).abs().sum() == 0
    advantages = gae_advantages(token_rewards, values, 0.9, 0.8)
    torch.testing.assert_close(rows.returns, advantages + values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows.advantages, masked_whiten(advantages, mask) * mask, rtol=1e-5, atol=1e-6)
    assert len(batch) == 4


@pytest.mark.parametrize("peft", [False, True])
def test_old_logps_are_read_from_sampling_and_equal_the_forward(tok, tmp_path, monkeypatch, peft):
    """TRL's PPO reads the rollout's log-probs from generation's logits; so do we (no extra policy forward), and they
    equal what the no-grad forward over prompt + completion gives, at the sampling temperature."""
    trainer = build(tok, tmp_path, peft=peft, temperature=0.7)
    generated = []
    original = trainer.generate
    monkeypatch.setattr(trainer, "generate", lambda *a, **k: generated.append(original(*a, **k)) or generated[-1])
    trainer.model.train()
    rows = trainer.rollout([trainer.train_dataset[i] for i in range(4)])
    assert generated[-1].logprobs is not None  # the lean loop returned them: the rollout ran no policy forward
    input_ids, attention_mask, _ = rows.model_inputs()
    with torch.no_grad():
        forward = trainer.token_logprobs(trainer.model, input_ids, attention_mask, rows.completion_ids.size(1)).logps
    mask = rows.completion_mask.float()
    assert rows.old_logps.shape == forward.shape and (rows.old_logps * (1 - mask)).abs().sum() == 0
    torch.testing.assert_close(rows.old_logps * mask, forward * mask, rtol=1e-5, atol=1e-5)
    # with lean decoding off, generate decodes and the forward computes them, as before
    trainer.args.lean_decoding = False
    rows = trainer.rollout([trainer.train_dataset[i] for i in range(4)])
    assert generated[-1].logprobs is None and rows.old_logps is not None


def test_loss_is_clipped_policy_plus_weighted_clipped_value_loss(tok, tmp_path):
    trainer = build(tok, tmp_path, cliprange=0.1, cliprange_value=0.05, vf_coef=0.5)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._prepare_inputs([trainer.train_dataset[i] for i in range(4)])
    rows = trainer._rollout
    rows.old_logps = rows.old_logps - 0.3 * rows.completion_mask  # an older policy: ratios away from 1
    rows.values = rows.values + 0.2 * value_mask(rows.completion_mask)  # older values: the value clip engages
    loss = trainer.compute_policy_loss(trainer.model, rows)
    input_ids, attention_mask, _ = rows.model_inputs()
    mask, v_mask = rows.completion_mask.float(), value_mask(rows.completion_mask).float()
    logps = trainer.token_logprobs(trainer.model, input_ids, attention_mask, mask.size(1)).logps
    ratio = torch.exp((logps - rows.old_logps) * mask)
    pg = torch.max(-rows.advantages * ratio, -rows.advantages * ratio.clamp(0.9, 1.1))
    values = trainer.token_values(rows) * v_mask
    clipped = values.clamp(rows.values - 0.05, rows.values + 0.05)
    vf = 0.5 * ((torch.max((values - rows.returns) ** 2, (clipped - rows.returns) ** 2) * v_mask).sum() / v_mask.sum())
    expected = (pg * mask).sum() / mask.sum() + 0.5 * vf
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert ((clipped != values) & v_mask.bool()).any()  # the test exercises the value clip


def test_training_changes_policy_and_value_and_logs_trl_metrics(tok, tmp_path):
    trainer = build(tok, tmp_path)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    assert any(n.startswith("value_model.") for n in before)
    trainer.train()
    for name, value in before.items():
        assert not torch.equal(value, trainer.model.get_parameter(name)), name
    keys = {k for log in trainer.state.log_history for k in log}
    trl_names = {
        "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
        "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
        "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr",
        "episode", "eps",
    }  # fmt: skip
    assert trl_names <= keys, trl_names - keys
    assert [log["episode"] for log in trainer.state.log_history if "episode" in log] == [4, 8, 12, 16]
    # 4 rollouts x 2 epochs: the learning rate moves once per rollout (a linear schedule over 4 rollouts)
    lrs = [log["lr"] for log in trainer.state.log_history if "lr" in log]
    assert lrs == pytest.approx([1e-3, 1e-3, 7.5e-4, 7.5e-4, 5e-4, 5e-4, 2.5e-4, 2.5e-4])
    trainer.save_model(str(tmp_path / "saved"))  # the policy alone, as TRL saves it
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert not any(k.startswith("value_model") for k in saved) and "lm_head.weight" in saved
    assert not os.path.exists(tmp_path / "saved" / "value_model")


def test_save_value_model_on_request(tok, tmp_path):
    trainer = build(tok, tmp_path, save_value_model=True, total_episodes=8, num_ppo_epochs=1)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    assert os.path.exists(tmp_path / "saved" / "value_model" / "config.json")


def test_peft_trains_the_adapter_and_the_critic(tok, tmp_path):
    trainer = build(tok, tmp_path, peft=True)
    assert trainer.reference_model.kind == "adapter_disabled"
    trainable = {n: p.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    frozen = {n: p.clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    assert any("lora" in n for n in trainable) and any("value_model" in n for n in trainable)
    assert not any("lora" in n for n in trainable if "value_model" in n)  # the adapter stays on the policy
    trainer.train()
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in trainable.items())
    assert all(torch.equal(p, trainer.model.get_parameter(n)) for n, p in frozen.items())


def test_gradient_accumulation_equals_a_bigger_batch(tok, tmp_path):
    """Full-length completions (no stop token) give every micro-batch the same token count, so the mean of two
    micro-batch means is the mean over the batch: (2 x GA 2) and (4 x GA 1) make the same updates."""
    common = dict(stop_token=None, total_episodes=8, num_ppo_epochs=2, optim="sgd")
    small = build(tok, tmp_path / "a", per_device_train_batch_size=2, gradient_accumulation_steps=2, **common)
    small.train()  # built and trained before the other is built: the same random state at the start of both
    big = build(tok, tmp_path / "b", per_device_train_batch_size=4, gradient_accumulation_steps=1, **common)
    big.train()
    for (name, p), q in zip(small.model.named_parameters(), big.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_ppo_learns_toy_reward(tok, tmp_path):
    policy = build_causal_lm(tok, "qwen2", hidden_size=32, seed=0)
    args = ppo_args(
        tmp_path, per_device_train_batch_size=16, num_ppo_epochs=2, response_length=12, stop_token=None,
        total_episodes=16 * 60, learning_rate=1e-2, kl_coef=0.0, vf_coef=0.5, logging_steps=2,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": PROMPTS * 8})
    trainer = PPOTrainer(args, tok, policy, None, None, dataset, build_sequence_classifier(tok), reward_funcs=count_a)
    trainer.train()
    rewards = [log["objective/scores"] for log in trainer.state.log_history if "objective/scores" in log]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards


# ------------------------------------------------------------------ bad input, before training
@pytest.mark.parametrize(
    "overrides, kwargs, error, pattern",
    [
        (dict(num_mini_batches=3, gradient_accumulation_steps=4), {}, ValueError, "num_mini_batches=3 must divide"),
        (dict(response_length=600), {}, ValueError, "beyond the model's maximum of 512"),
        (dict(stop_token="eos", stop_token_id=3), {}, ValueError, "both `stop_token` and `stop_token_id`"),
        (dict(kl_estimator="k2"), {}, ValueError, "kl_estimator must be either 'k1'"),
        (dict(beta=0.1), {}, NotImplementedError, "kl_coef"),
        ({}, dict(reward_model=None), ValueError, "No reward source provided"),
        ({}, dict(value_model=None), ValueError, "value_model is required"),
        ({}, dict(value_model="other_vocab"), ValueError, "value model's embedding table has 10 rows, too few"),
        ({}, dict(data_collator=len), ValueError, "data_collator is not used"),
    ],
)
def test_bad_input_is_rejected_before_training(overrides, kwargs, error, pattern, tok, tmp_path):
    other = build_tokenizer(["zz", "yy", *"abc"])
    models = dict(reward_model=build_sequence_classifier(tok), value_model=build_sequence_classifier(tok))
    models.update(kwargs)
    if models["value_model"] == "other_vocab":
        models["value_model"] = build_sequence_classifier(other)
    with pytest.raises(error, match=pattern):
        PPOTrainer(
            ppo_args(tmp_path, **overrides), tok, build_causal_lm(tok, "llama"),
            train_dataset=token_dataset(tok), **models,
        )  # fmt: skip
