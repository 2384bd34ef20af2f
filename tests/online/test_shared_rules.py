"""The pieces GRPO, GMPO, SDPO, SDFT, GKD and IW-OPD share, against hand computations: group-relative advantages,
the loss table's ratio terms and normalisers, the teacher-template filler, the degenerate-round warnings."""

import logging
import math
import types

import pytest
import torch

from trl_unified.core.divergence import position_weighted_advantages
from trl_unified.online.metrics import DegenerateRoundWarnings
from trl_unified.online.policy_losses import (
    clipped_surrogate,
    per_max_length,
    per_micro_batch_token,
    per_sequence,
    policy_loss_terms,
)
from trl_unified.online.rewards import group_relative_advantages
from trl_unified.online.teacher_contexts import fill_teacher_template


def test_group_relative_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 3.0])  # two groups of 2
    group, std = group_relative_advantages(rewards, 2, "group")
    s = math.sqrt(0.5)  # Bessel-corrected std of (1, 0); the second group's: sqrt(2)
    torch.testing.assert_close(group, torch.tensor([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), -1 / (2 * s + 1e-4),
                                                    1 / (2 * s + 1e-4)]))  # fmt: skip
    torch.testing.assert_close(std, torch.tensor([s, s, 2 * s, 2 * s]))
    batch, _ = group_relative_advantages(rewards, 2, "batch")
    batch_std = torch.tensor([1.0, 0.0, 1.0, 3.0]).std()
    torch.testing.assert_close(batch, torch.tensor([0.5, -0.5, -1.0, 1.0]) / (batch_std + 1e-4))
    none, std = group_relative_advantages(rewards, 2, "none")
    torch.testing.assert_close(none, torch.tensor([0.5, -0.5, -1.0, 1.0]))
    torch.testing.assert_close(std, torch.tensor([s, s, 2 * s, 2 * s]))  # the group's, for the zero-std metric


def test_group_relative_advantages_leave_unscorable_rows_out():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 0.0, 0.0, 0.0])  # groups of 3; the first has one NaN
    advantages, std = group_relative_advantages(rewards, 3, "group")
    torch.testing.assert_close(advantages[[0, 2]], torch.tensor([-1.0, 1.0]) / (math.sqrt(2) + 1e-4))
    assert torch.isnan(advantages[1])  # the trainer reads a NaN advantage as 0
    torch.testing.assert_close(advantages[3:], torch.zeros(3))
    assert std[3:].eq(0).all()


def test_policy_loss_terms_and_the_clipped_surrogate_by_hand():
    logps = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    args = types.SimpleNamespace(max_completion_length=4)
    token = policy_loss_terms(logps, old, mask, torch.tensor([2.0]), "token", 0.8, 1.2, args, None)
    torch.testing.assert_close(token.ratio, torch.exp(torch.tensor([[0.5, 0.0, -1.0]])))
    loss, _ = clipped_surrogate(token)
    # A > 0: -min(w A, clip(w) A) = -A * min(w, 1.2) per token
    expected = -2.0 * torch.tensor([[1.2, 1.0, math.exp(-1.0)]])
    torch.testing.assert_close(loss, expected)
    masked = loss * mask
    torch.testing.assert_close(per_sequence(None, masked, token, 1.0, "train"), (expected[0, :2].sum() / 2))
    torch.testing.assert_close(per_micro_batch_token(None, masked, token, 2.0, "train"), expected[0, :2].sum() / 4)
    torch.testing.assert_close(per_max_length(None, masked, token, 1.0, "train"), expected[0, :2].sum() / 4)
    sequence = policy_loss_terms(logps, old, mask, torch.tensor([[2.0]]), "sequence", 0.8, 1.2, args, None)
    torch.testing.assert_close(sequence.ratio, torch.tensor([[math.exp(0.25)]]))  # exp of the masked mean
    capped = policy_loss_terms(logps, old, mask, torch.tensor([-1.0]), "token", 0.8, 1.2, args, None, cap=1.1)
    loss, ratio = clipped_surrogate(capped)  # A < 0: -min(min(w, cap) A, clip(w) A) = max(w_capped, clip(w))
    torch.testing.assert_close(ratio[0, 0], torch.tensor(1.1))
    torch.testing.assert_close(loss[0, 0], torch.tensor(1.2))
    free = policy_loss_terms(logps, None, mask, torch.tensor([1.0]), "token", 0.8, 1.2, args, None)
    torch.testing.assert_close(free.ratio, torch.ones(1, 3))  # no π_old: w = 1, the gradient is log π_θ's
    clipped_surrogate(free)[0].sum().backward()
    torch.testing.assert_close(logps.grad, -torch.ones(1, 3))


def test_fill_teacher_template_keeps_braces_and_other_turns():
    template = "{prompt} | {solution}"
    assert fill_teacher_template(template, "x = {y}?", solution="{z}") == "x = {y}? | {z}"
    conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    filled = fill_teacher_template(template, conversation, solution="a")
    assert filled == [{"role": "system", "content": "s"}, {"role": "user", "content": "q | a"}]
    assert conversation[1]["content"] == "q"  # the student's prompt is left as it was
    with pytest.raises(ValueError, match="end with a user turn"):
        fill_teacher_template(template, [{"role": "assistant", "content": "a"}], solution="")


def test_degenerate_round_warnings_at_the_first_and_every_nth_consecutive(caplog):
    warnings = DegenerateRoundWarnings(interval=3)
    with caplog.at_level(logging.WARNING):
        for degenerate in (True, True, True, False, True, True, True, True, True, True):
            warnings.observe("train", "flat", degenerate, "Flat.")
        warnings.observe("eval", "flat", True, "Flat in eval.")
    counts = [r.getMessage() for r in caplog.records]
    # rounds 1 and 3 of the first streak; after the reset: 1, 3 and 6
    assert counts == [f"Flat. Consecutive degenerate steps: {n}." for n in (1, 3, 1, 3, 6)] + [
        "Flat in eval. Consecutive degenerate steps: 1."
    ]
    caplog.clear()
    silent = DegenerateRoundWarnings(interval=0)
    with caplog.at_level(logging.WARNING):
        silent.observe("train", "flat", True, "Flat.")
    assert not caplog.records


def test_position_weights_refuse_missing_teacher_logprobs():
    teacher = torch.tensor([[-1.0, float("-inf")]])
    with pytest.raises(ValueError, match="missing for required IW-OPD positions: 1/2"):
        position_weighted_advantages(teacher, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.5, 1e-8)
    position_weighted_advantages(teacher, torch.zeros(1, 2), torch.tensor([[True, False]]), 0.5, 1e-8)
