"""GRPOTrainer: TRL's config and constructor, advantages by hand, the usage surface of trl.GRPOTrainer, learning."""

import dataclasses
import inspect
import logging
import math
from statistics import mean, stdev

import pytest
import torch
import trl
from datasets import IterableDataset

from tests.helpers import count_a, grpo_args, prompt_dataset, varied_reward
from trl_unified import GRPOConfig, GRPOTrainer
from trl_unified.testing import build_causal_lm


# ------------------------------------------------------------------ config and constructor parity
def test_config_has_every_trl_field_with_the_same_default():
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for f in dataclasses.fields(trl.GRPOConfig):
        assert f.name in ours, f.name
        if f.default is not dataclasses.MISSING:
            assert ours[f.name].default == f.default, (f.name, ours[f.name].default, f.default)
        else:
            assert ours[f.name].default_factory() == f.default_factory(), f.name
    for name in ("loss_type", "scale_rewards", "top_entropy_quantile"):
        assert f"{name} (`" in GRPOConfig.__doc__ and GRPOConfig.__dataclass_fields__[name].metadata["help"]


def test_constructor_takes_trl_arguments_in_trl_order():
    theirs = list(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    ours = list(inspect.signature(GRPOTrainer.__init__).parameters)
    assert ours[: len(theirs)] == theirs, (ours, theirs)


@pytest.mark.parametrize("field, value", [("log_completions_hub_repo", "me/logs")])
def test_unimplemented_fields_raise_when_set(field, value, tmp_path):
    with pytest.raises(NotImplementedError, match=f"{field}={value!r} is accepted for compatibility"):
        grpo_args(tmp_path, **{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("vllm_importance_sampling_correction", False),
        ("vllm_importance_sampling_mode", "token_mask"),
        ("vllm_mode", "server"),
        ("vllm_gpu_memory_utilization", 0.9),
    ],
)
def test_vllm_only_fields_without_vllm_are_ignored_with_a_warning(field, value, tmp_path, caplog):
    """As TRL: the vLLM fields only matter with use_vllm=True; set without it they change nothing (TRL's scripts
    pass them by default), so they are accepted and named in one warning."""
    with caplog.at_level("WARNING", logger="trl_unified.online.config"):
        args = grpo_args(tmp_path, **{field: value})
    assert getattr(args, field) == value
    assert f"{field} only apply to vLLM generation (use_vllm=True), which is off: ignored" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trl_unified.online.config"):
        grpo_args(tmp_path)
    assert "vLLM" not in caplog.text  # the defaults pass silently


def test_bad_values_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"loss_type='ppo' is not one of \['grpo'"):
        grpo_args(tmp_path, loss_type="ppo")
    with pytest.raises(ValueError, match=r"scale_rewards='std' is not one of"):
        grpo_args(tmp_path, scale_rewards="std")
    with pytest.raises(ValueError, match=r"top_entropy_quantile=1.5 must be in \[0, 1\]"):
        grpo_args(tmp_path, top_entropy_quantile=1.5)
    assert grpo_args(tmp_path, scale_rewards=False).scale_rewards == "none"  # TRL's boolean spelling
    assert grpo_args(tmp_path, scale_rewards=True).scale_rewards == "group"


# ------------------------------------------------------------------ advantages by hand
def test_group_batch_and_unscaled_advantages_match_hand_computation(llama_path, tmp_path):
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, float("nan")])  # 3 prompts, G=2; last row unscorable
    per_func = rewards.unsqueeze(1)
    g = 1 / (2.0**0.5 + 1e-4)  # the pair (1, 3): mean 2, Bessel std sqrt(2); (2, 2) has std 0 -> 0; NaN -> 0
    expected = {"group": torch.tensor([-g, g, 0.0, 0.0, 0.0, 0.0]), "none": torch.tensor([-1.0, 1.0, 0, 0, 0, 0])}
    for scale, exp in expected.items():
        trainer = GRPOTrainer(llama_path, varied_reward, args=grpo_args(tmp_path, scale_rewards=scale),
                              train_dataset=prompt_dataset())  # fmt: skip
        torch.testing.assert_close(trainer.compute_advantages(rewards, per_func, None, "train"), exp)
    batch = GRPOTrainer(llama_path, varied_reward, args=grpo_args(tmp_path, scale_rewards="batch"),
                        train_dataset=prompt_dataset())  # fmt: skip
    std = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0]).std()
    exp = torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]) / (std + 1e-4)
    torch.testing.assert_close(batch.compute_advantages(rewards, per_func, None, "train"), exp)


def test_normalize_then_sum_normalises_each_function_in_its_group(llama_path, tmp_path):
    trainer = GRPOTrainer(llama_path, [varied_reward, varied_reward], train_dataset=prompt_dataset(),
                          args=grpo_args(tmp_path, multi_objective_aggregation="normalize_then_sum",
                                         reward_weights=[1.0, 2.0]))  # fmt: skip
    per_func = torch.tensor([[0.0, 10.0], [1.0, 30.0], [5.0, 0.0], [7.0, 0.0]])  # 2 groups of 2, 2 functions

    def z(lo, hi):  # a pair normalised in its group: (x - mean) / (Bessel std + 1e-4), std = |hi - lo| / sqrt(2)
        return (torch.tensor([lo, hi]) - (lo + hi) / 2) / (abs(hi - lo) / 2.0**0.5 + 1e-4)

    summed = torch.cat([z(0.0, 1.0) + 2 * z(10.0, 30.0), z(5.0, 7.0) + 2 * z(0.0, 0.0)])  # weights 1 and 2
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    got = trainer.compute_advantages(per_func @ torch.tensor([1.0, 2.0]), per_func, None, "train")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ training and TRL's usage surface
def test_training_changes_every_parameter_and_logs_trl_metrics(llama_path, tmp_path):
    trainer = GRPOTrainer(llama_path, varied_reward, args=grpo_args(tmp_path, max_steps=3, beta=0.1, num_iterations=2),
                          train_dataset=prompt_dataset())  # fmt: skip
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for name, p in trainer.model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not change"
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["step"] for log in logs] == [1, 2, 3]
    # Step 1 runs the policy that sampled the batch, equal to the reference: KL 0, ratio 1 (no clipping). Step 3
    # samples afresh and scores with the parameters that sampled: ratio 1 again. Step 2 reuses step 1's batch.
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    for log in logs:
        clipped = log["clip_ratio/region_mean"]
        assert clipped == 0.0 if log["step"] in (1, 3) else 0.0 <= clipped <= 1.0
        assert log["kl"] >= -1e-6 and log["step_time"] > 0
    generated = [log for log in logs if "reward" in log]  # num_iterations=2: steps 1 and 3 generate, 2 reuses
    assert [log["step"] for log in generated] == [1, 3]
    for log in generated:
        assert 0 <= log["reward"] <= 6 / 7 and log["reward"] == log["rewards/varied_reward/mean"]
        assert 1 <= log["completions/mean_length"] <= 6  # max_completion_length
    assert 0 < generated[0]["num_tokens"] < generated[1]["num_tokens"]  # a running total
    # The last generation (step 3: 2 prompts x 2 completions) is in trainer._logs: its metrics by hand.
    rewards = list(trainer._logs["rewards"]["varied_reward"])
    assert generated[1]["reward"] == pytest.approx(mean(rewards), abs=1e-6)
    assert generated[1]["reward_std"] == pytest.approx(stdev(rewards), abs=1e-6)  # Bessel-corrected, over the batch
    groups = [rewards[0:2], rewards[2:4]]
    assert generated[1]["frac_reward_zero_std"] == mean(float(a == b) for a, b in groups)
    expected = [(r - mean(g)) / (stdev(g) + 1e-4) for g in groups for r in g]  # scale_rewards="group"
    assert list(trainer._logs["advantages"]) == pytest.approx(expected, abs=1e-4)
    for log in logs:
        assert 0 < log["entropy"] <= math.log(len(trainer.processing_class)) + 1e-4
    assert trainer.ref_model is not None and trainer.reward_funcs == [varied_reward]
    assert trainer.reward_func_names == ["varied_reward"] and len(trainer.reward_processing_classes) == 1
    assert len(trainer._logs["advantages"]) == len(trainer._logs["prompt"]) == trainer.args.generation_batch_size


def test_iterable_dataset_and_all_none_rewards_warn(llama_path, tmp_path, caplog):
    data = IterableDataset.from_generator(lambda: ({"prompt": p} for p in ["a b", "c", "d e f", "g"] * 8))
    trainer = GRPOTrainer(llama_path, lambda completions, **kw: [None] * len(completions),
                          args=grpo_args(tmp_path), train_dataset=data)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 2
    assert "All reward functions returned None" in caplog.text
    assert all(a == 0.0 for a in trainer._logs["advantages"])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_grpo_learns_toy_reward(loss_type, tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=32, seed=0)
    args = grpo_args(tmp_path, max_steps=80, per_device_train_batch_size=8, num_generations=4,
                     max_completion_length=12, learning_rate=1e-2, loss_type=loss_type)  # fmt: skip
    trainer = GRPOTrainer(model, count_a, args=args, train_dataset=prompt_dataset(64), processing_class=tokenizer)
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.3, rewards
