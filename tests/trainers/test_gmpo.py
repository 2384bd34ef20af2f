"""GMPOTrainer: TRL's config and defaults (the clipping range in log space), the loss by hand at its clip edges, equal
to TRL 1.16's `trl.experimental.gmpo.GMPOTrainer` with generation fixed (losses, per-step gradients, parameters,
metrics), GRPO's loss_type="gmpo", and learning."""

import dataclasses
import math
import os
import types
from statistics import mean

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

import trl_unified
from tests.helpers import count_a, prompt_dataset, tiny_run_args, varied_reward
from tests.trainers.test_rloo_equivalence import fake_generate, run
from trl_unified import GMPOConfig, GMPOTrainer, GRPOConfig
from trl_unified.online.policy_losses import LOSSES, LossTerms
from trl_unified.testing import build_causal_lm


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def test_config_has_every_trl_field_with_the_same_default():
    from trl.experimental.gmpo import GMPOConfig as TRLConfig

    ours = {f.name: f for f in dataclasses.fields(GMPOConfig)}
    for f in dataclasses.fields(TRLConfig):
        assert f.name in ours, f.name
        if f.default is not dataclasses.MISSING:
            assert ours[f.name].default == f.default, (f.name, ours[f.name].default, f.default)
    config = GMPOConfig(output_dir="out", bf16=False)
    assert (config.epsilon, config.epsilon_high, config.loss_type) == (0.4, None, "gmpo")
    with pytest.raises(ValueError, match="GMPO's loss is the geometric mean"):
        GMPOConfig(output_dir="out", bf16=False, loss_type="grpo")


def test_the_loss_by_hand_at_the_clip_edges():
    """Two sequences, ε = 0.2: a positive advantage clips log-ratios above 0.2 (and keeps those below -0.2), a
    negative one clips log-ratios below -0.2 (and keeps those above); the geometric mean is over the masked tokens."""
    log_ratio = torch.tensor([[0.5, -0.5, 0.1], [0.5, -0.5, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([[2.0], [-1.0]])
    args = types.SimpleNamespace(epsilon=0.2, epsilon_high=None)
    terms = LossTerms(
        logps=log_ratio, old_logps=torch.zeros_like(log_ratio), log_ratio=log_ratio, ratio=log_ratio.exp(),
        advantages=advantages, mask=mask, low=0.8, high=1.2, args=args, inputs=None,
    )  # fmt: skip
    loss, ratio = LOSSES["gmpo"].token_loss(terms)
    # A > 0: min(l, clip(l)) = (0.2, -0.5, 0.1), mean 0.2/3 ... -0.2/3; A < 0: max(l, clip(l)) = (0.5, -0.2)
    expected = torch.tensor([[-2.0 * math.exp((0.2 - 0.5 + 0.1) / 3)], [1.0 * math.exp((0.5 - 0.2) / 2)]])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(ratio, log_ratio.exp())


OFF_POLICY = dict(num_iterations=2, learning_rate=2e-3)  # the second pass sees ratios != 1
CASES = {
    "default": dict(**OFF_POLICY),
    "narrow_clip": dict(epsilon=0.01, epsilon_high=0.005, **OFF_POLICY),  # many tokens at a clip edge
    "top_entropy": dict(top_entropy_quantile=0.5, **OFF_POLICY),
    "beta_without_bias_correction": dict(beta=0.1, use_bias_correction_kl=False, **OFF_POLICY),
    "grad_accumulation": dict(per_device_train_batch_size=3, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("case", [c if c == "narrow_clip" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_gmpo_matches_trl(case, qwen2_path, tmp_path, monkeypatch):
    import trl.experimental.gmpo as trl_gmpo

    monkeypatch.setattr(Qwen2ForCausalLM, "generate", fake_generate)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen2_path)
    theirs_module = types.SimpleNamespace(
        __name__="trl", GMPOTrainer=trl_gmpo.GMPOTrainer, GMPOConfig=trl_gmpo.GMPOConfig
    )
    results = [run(module, qwen2_path, tokenizer, tmp_path, False, "GMPO", **CASES[case])
               for module in (theirs_module, trl_unified)]  # fmt: skip
    (ref_losses, ref_grads, ref_params, ref_logs), (losses, grads, params, logs) = results
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    for step, (g, ref_g) in enumerate(zip(grads, ref_grads, strict=True)):
        assert any(v.abs().sum() > 0 for v in g.values()) == any(v.abs().sum() > 0 for v in ref_g.values()), step
        for name in ref_g:
            torch.testing.assert_close(g[name], ref_g[name], rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-4, atol=1e-5, msg=name)
    metrics = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
               "clip_ratio/high_max", "entropy", "reward"] + (["kl"] if "beta" in CASES[case] else [])  # fmt: skip
    for key in metrics:
        ours = [log[key] for log in logs if key in log]
        theirs = [log[key] for log in ref_logs if key in log]
        assert len(ours) == len(theirs) > 0, key
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5, msg=key)
    if case == "narrow_clip":
        assert max(log["clip_ratio/region_mean"] for log in logs if "clip_ratio/region_mean" in log) > 0.1


def test_grpo_takes_the_gmpo_loss_type(tokenizer, tmp_path):
    """The same table entry in GRPO (loss_type="gmpo"): a few steps change every parameter."""
    args = tiny_run_args(GRPOConfig, tmp_path, loss_type="gmpo", num_generations=2, max_completion_length=6)
    trainer = trl_unified.GRPOTrainer(
        build_causal_lm(tokenizer),
        varied_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert "clip_ratio/region_mean" in trainer.state.log_history[0]


@pytest.mark.slow
def test_gmpo_learns_the_toy_reward(tokenizer, tmp_path):
    """count_a (the fraction of "a" in a completion) from about 0.05 to well above."""
    args = tiny_run_args(GMPOConfig, tmp_path, max_steps=60, per_device_train_batch_size=8, num_generations=4,
                         max_completion_length=8, learning_rate=1e-2, logging_steps=1)  # fmt: skip
    trainer = GMPOTrainer(build_causal_lm(tokenizer), count_a, args=args, train_dataset=prompt_dataset(64),
                          processing_class=tokenizer)  # fmt: skip
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.2, rewards
