r"""Self-Distillation Policy Optimization (SDPO), Hübotter et al., 2026, "Reinforcement Learning via Self-Distillation"
(arXiv:2601.20802): a drop-in for TRL 1.16's `trl.experimental.sdpo.SDPOTrainer` on the self-distillation core
(`online/self_distillation.py`, which states the distillation loss L_SD).

Each prompt x gets G completions and their rewards r (the weighted sum of the reward functions; a row no function
scored reads 0). The teacher of completion y_i is the policy (an EMA of it by default) re-prompted with a successful
sibling: the first y_j of the group with r_j >= `success_reward_threshold` (j ≠ i with `dont_reprompt_on_self_success`)
written into `reprompt_template`, and with `include_environment_feedback` the row's `privileged_context` (the
environment's feedback) too (`SuccessfulRolloutContext`, `online/teacher_contexts.py`); rows with neither are left
out of L_SD (`self_distillation_mask` = 0), still counted in its mean over rows. With w = `distillation_weight`:

    L = (1 - w) L_PG + w L_SD,    L_PG = GRPO's clipped surrogate, -min(ρ_t A_i, clip(ρ_t, 1 - ε, 1 + ε_high) A_i),

with ρ_t = π_θ / π_old per token (per sequence with `importance_sampling_level="sequence"`) and the group-relative
advantage A_i = (r_i - mean_group(r)) / (std + 1e-4), std the group's (`scale_rewards="group"`), the batch's ("batch")
or 1 ("none"). L_PG is normalised by `loss_type`: "grpo" the mean over rows of each row's token mean; "bnpo" and
"dapo" the micro-batch's token mean; "dr_grpo" the token sum over B · `max_completion_length`. The default w = 1 is
pure self-distillation (the rewards only choose the demonstrations).
"""

from dataclasses import dataclass

import torch

from ..core.config import document_fields, option
from ..online.metrics import DegenerateRoundWarnings
from ..online.policy_losses import (
    PolicyLossConfig,
    clipped_surrogate,
    per_max_length,
    per_micro_batch_token,
    per_sequence,
    policy_loss_terms,
)
from ..online.rewards import group_relative_advantages
from ..online.self_distillation import SelfDistillationConfig, SelfDistillationCore
from ..online.teacher_contexts import SuccessfulRolloutContext


# SDPO's policy-loss normalisers (the online core's loss table's): "dapo" is the micro-batch's token mean here
SDPO_NORMALISERS = {"grpo": per_sequence, "bnpo": per_micro_batch_token, "dr_grpo": per_max_length,
                    "dapo": per_micro_batch_token}  # fmt: skip
SDPO_LOSS_TYPES = tuple(SDPO_NORMALISERS)
FLAT_REWARDS = (
    "Observed flat SDPO rewards across all sampled generations. Policy advantages will collapse to zero, and SDPO "
    "will not learn. Check reward density, reward shaping, or `success_reward_threshold`."
)


@document_fields
@dataclass
class SDPOConfig(PolicyLossConfig, SelfDistillationConfig):
    """Configuration of `SDPOTrainer`: every field of `trl.experimental.sdpo.SDPOConfig` 1.16, same names and
    defaults; the sampling, vLLM and logging fields are the online core's."""

    _inapplicable_fields = ("beta", "async_rollouts")
    _inapplicable_reason = "SDPO (no reference model or KL term; rollouts are synchronous)"
    _loss_types = SDPO_LOSS_TYPES

    distillation_weight: float = option(1.0, "w in L = (1 - w) L_PG + w L_SD, in [0, 1].")
    distillation_alpha: float = option(1.0, "D's interpolation: 0 forward KL, 1 reverse KL, between: the JSD.")
    distillation_mode: str = option("sampled_token", "'sampled_token', 'full_logits' or 'topk_logits'.")
    distillation_topk: int | None = option(None, "topk_logits: the student's top-k tokens D is taken over.")
    teacher_model_kind: str = option("ema", "The self-teacher: 'base' (frozen start), 'live' or 'ema'.")
    max_reprompt_len: int = option(10240, "Teacher prompt tokens kept, the last ones.")
    use_successful_as_teacher: bool = option(True, "Reprompt the teacher with a successful sibling completion.")
    success_reward_threshold: float = option(1.0, "A completion is successful when its reward reaches this.")
    dont_reprompt_on_self_success: bool = option(True, "A completion never serves as its own demonstration.")
    reprompt_template: str = option(
        "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n", "The teacher's prompt."
    )
    solution_template: str = option(
        "\nCorrect solution:\n\n{successful_previous_attempt}\n\n", "The demonstration's place in reprompt_template."
    )
    feedback_template: str = option(
        "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n",
        "The environment feedback's place in reprompt_template.",
    )
    include_environment_feedback: bool = option(False, "Reprompt with the row's privileged_context (feedback).")
    environment_feedback_only_without_solution: bool = option(False, "Use feedback only where no sibling succeeded.")
    remove_thinking_from_demonstration: bool = option(False, "Strip <think>...</think> from demonstrations.")
    diagnostics_warning_interval: int = option(10, "Warn on degenerate rounds at the 1st and every N-th (0: never).")
    diagnostics_flat_tolerance: float = option(1e-8, "Reward spread below which rewards count as flat.")

    def __post_init__(self):
        self.check_policy_loss()
        super().__post_init__()
        if not 0.0 <= self.distillation_weight <= 1.0:
            raise ValueError(f"`distillation_weight` must be in [0, 1], got {self.distillation_weight}.")
        if self.use_teacher_server and self.distillation_weight != 1.0:
            raise ValueError("`use_teacher_server=True` requires `distillation_weight=1.0` (no local policy loss).")
        self.epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high


class SDPOTrainer(SelfDistillationCore):
    """SDPO (see the module docstring). TRL 1.16's constructor."""

    _name = "SDPO"
    config_class = SDPOConfig
    teacher_context_class = SuccessfulRolloutContext  # a successful sibling or the feedback (its docstring's rule)

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        if not reward_funcs:
            raise ValueError("`reward_funcs` is required for SDPOTrainer because SDPO must score rollouts.")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            reward_processing_classes,
            callbacks,
            optimizers,
            peft_config=peft_config,
        )
        self._degenerate_rounds = DegenerateRoundWarnings(self.args.diagnostics_warning_interval)

    # TRL's attributes
    loss_type = property(lambda self: self.args.loss_type)
    importance_sampling_level = property(lambda self: self.args.importance_sampling_level)
    scale_rewards = property(lambda self: self.args.scale_rewards)
    epsilon_low = property(lambda self: self.args.epsilon)
    epsilon_high = property(lambda self: self.args.epsilon_high)
    mask_truncated_completions = property(lambda self: self.args.mask_truncated_completions)

    # ------------------------------------------------------------------ rewards and advantages
    def assign_advantages(self, rewards, rewards_per_func, batch, mode: str) -> torch.Tensor:
        """The module docstring's advantages (an unscored row reads reward 0, TRL's `nansum`), and the round's reward
        diagnostics."""
        rewards, size = rewards.nan_to_num(0.0), self.group_size(mode)
        advantages, _ = group_relative_advantages(rewards, size, self.scale_rewards)
        batch.advantages = advantages[batch.row_index]
        group_std = rewards.view(-1, size).std(dim=1)
        group_std = torch.ones_like(group_std) if self.scale_rewards == "none" else group_std  # TRL's diagnostics
        self._record_reward_diagnostics(mode, rewards, rewards_per_func, group_std)
        return advantages

    def _record_reward_diagnostics(self, mode, rewards, rewards_per_func, group_std) -> None:
        tolerance = self.args.diagnostics_flat_tolerance
        spread = rewards.std().item() if rewards.numel() > 1 else 0.0
        flat_groups = (group_std <= tolerance).float().mean().item() if group_std.numel() else 1.0
        metrics = {
            "reward_mean": rewards.mean().item(),
            "reward_std": spread,
            "reward_min": rewards.min().item(),
            "reward_max": rewards.max().item(),
            "group_reward_std_mean": group_std.mean().item() if group_std.numel() else spread,
            "flat_group_fraction": flat_groups,
        }
        for name, mean in zip(self.reward_func_names, rewards_per_func.nanmean(dim=0).tolist(), strict=True):
            metrics[f"rewards/{name}"] = mean
        for name, value in metrics.items():
            self.log_metric(f"self_distillation/{name}", value)
        flat = spread <= tolerance and flat_groups >= 1.0 - tolerance
        self._degenerate_rounds.observe(mode, "flat_rewards", flat, FLAT_REWARDS)

    # ------------------------------------------------------------------ the teacher's context
    def teacher_prompt_length(self) -> int:
        return self.args.max_reprompt_len  # reprompts keep their last tokens; the student's limit does not apply

    # ------------------------------------------------------------------ the loss
    def reads_whole_distributions(self) -> bool:
        return self.args.distillation_weight > 0.0 and super().reads_whole_distributions()  # L_PG reads logps

    def compute_policy_loss(self, model, inputs, num_items_in_batch=None):
        weight = self.args.distillation_weight
        student = self.student_outputs(model, inputs)
        if weight == 0.0:
            return self.policy_loss(inputs, student.logps)  # no teacher forward
        distillation = self.distillation_loss(model, inputs, student)
        if weight == 1.0:
            return distillation
        return (1 - weight) * self.policy_loss(inputs, student.logps) + weight * distillation

    def policy_loss(self, inputs, logps) -> torch.Tensor:
        """L_PG of the module docstring for a micro-batch, from the completion tokens' log-probs `(B, C)`, logged as
        `self_distillation/policy_loss`."""
        mask = inputs["completion_mask"]
        old_logps = inputs.get("old_logps", inputs.get("old_per_token_logps"))
        bounds = (1 - self.epsilon_low, 1 + self.epsilon_high)
        level, advantages = self.importance_sampling_level, inputs["advantages"]
        terms = policy_loss_terms(logps, old_logps, mask, advantages, level, *bounds, self.args, inputs)
        per_token_loss, _ = clipped_surrogate(terms)
        loss = SDPO_NORMALISERS[self.loss_type](self, per_token_loss * mask, terms, 1.0, self.mode)
        self.log_metric("self_distillation/policy_loss", loss.item())
        return loss
