r"""Self-Distillation Policy Optimization (SDPO), Hübotter et al., 2026, "Reinforcement Learning via Self-Distillation"
(arXiv:2601.20802): a drop-in for TRL 1.16's `trl.experimental.sdpo.SDPOTrainer` on the self-distillation core
(`online/self_distillation.py`, which states the distillation loss L_SD).

Each prompt x gets G completions and their rewards r (the weighted sum of the reward functions; a row no function
scored reads 0). The teacher of completion y_i is the policy (an EMA of it by default) re-prompted with a successful
sibling: the first y_j of the group with r_j >= `success_reward_threshold` (j ≠ i with `dont_reprompt_on_self_success`)
written into `reprompt_template`, and with `include_environment_feedback` the row's `privileged_context` (the
environment's feedback) too; rows with neither are left out of L_SD (`self_distillation_mask` = 0), still counted in
its mean over rows. With w = `distillation_weight`:

    L = (1 - w) L_PG + w L_SD,    L_PG = GRPO's clipped surrogate, -min(ρ_t A_i, clip(ρ_t, 1 - ε, 1 + ε_high) A_i),

with ρ_t = π_θ / π_old per token (per sequence with `importance_sampling_level="sequence"`) and the group-relative
advantage A_i = (r_i - mean_group(r)) / (std + 1e-4), std the group's (`scale_rewards="group"`), the batch's ("batch")
or 1 ("none"). L_PG is normalised by `loss_type`: "grpo" the mean over rows of each row's token mean; "bnpo" and
"dapo" the micro-batch's token mean; "dr_grpo" the token sum over B · `max_completion_length`. The default w = 1 is
pure self-distillation (the rewards only choose the demonstrations).
"""

import logging
import re
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object

from ..core.config import document_fields, option
from ..models.loading import get_tokenizer
from ..online.metrics import DegenerateRoundWarnings
from ..online.policy_losses import (
    clipped_surrogate,
    per_max_length,
    per_micro_batch_token,
    per_sequence,
    policy_loss_terms,
)
from ..online.rewards import group_relative_advantages
from ..online.self_distillation import SelfDistillationConfig, SelfDistillationCore, fill_teacher_template


logger = logging.getLogger(__name__)

# SDPO's policy-loss normalisers (the online core's loss table's): "dapo" is the micro-batch's token mean here
SDPO_NORMALISERS = {"grpo": per_sequence, "bnpo": per_micro_batch_token, "dr_grpo": per_max_length,
                    "dapo": per_micro_batch_token}  # fmt: skip
SDPO_LOSS_TYPES = tuple(SDPO_NORMALISERS)
FLAT_REWARDS = (
    "Observed flat SDPO rewards across all sampled generations. Policy advantages will collapse to zero, and SDPO "
    "will not learn. Check reward density, reward shaping, or `success_reward_threshold`."
)
INACTIVE = (
    "SDPO self-distillation is inactive because no reprompted samples were constructed. This usually means no "
    "rollout exceeded `success_reward_threshold` and no usable privileged feedback was available."
)
NO_SUCCESS = (
    "SDPO did not find any successful rollouts in the current generation groups. If this persists, reduce task "
    "difficulty, adjust reward shaping, or lower `success_reward_threshold`."
)


@document_fields
@dataclass
class SDPOConfig(SelfDistillationConfig):
    """Configuration of `SDPOTrainer`: every field of `trl.experimental.sdpo.SDPOConfig` 1.16, same names and
    defaults; the sampling, vLLM and logging fields are the online core's."""

    _inapplicable_fields = ("beta", "async_rollouts")
    _inapplicable_reason = "SDPO (no reference model or KL term; rollouts are synchronous)"

    loss_type: str = option("dapo", "Normaliser of the policy loss: 'grpo', 'bnpo', 'dr_grpo' or 'dapo'.")
    importance_sampling_level: str = option("token", "The ratio per 'token' or per 'sequence'.")
    scale_rewards: str | bool = option("group", "Advantage scale: 'group', 'batch' or 'none' (True / False).")
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
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        super().__post_init__()
        if not 0.0 <= self.distillation_weight <= 1.0:
            raise ValueError(f"`distillation_weight` must be in [0, 1], got {self.distillation_weight}.")
        if self.loss_type not in SDPO_LOSS_TYPES or self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(
                f"loss_type={self.loss_type!r} must be one of {SDPO_LOSS_TYPES} and scale_rewards="
                f"{self.scale_rewards!r} one of 'group', 'batch', 'none'."
            )
        if self.use_teacher_server and self.distillation_weight != 1.0:
            raise ValueError("`use_teacher_server=True` requires `distillation_weight=1.0` (no local policy loss).")
        self.epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high


class SDPOTrainer(SelfDistillationCore):
    """SDPO (see the module docstring). TRL 1.16's constructor."""

    _name = "SDPO"
    config_class = SDPOConfig

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
        self._feedback_warned = False  # the ignored-feedback warning, once
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

    def teacher_prompts(self, batch, samples, mode) -> list:
        """TRL's `SuccessfulRolloutTeacherContextBuilder`, over the whole generation batch (all processes): each
        row's demonstration (module docstring) and feedback, `batch.self_distillation_mask`, the context metrics."""
        a, size = self.args, self.group_size(mode)
        rewards = batch.gather_global(batch.rewards).nan_to_num(0.0).tolist()
        pad_id = get_tokenizer(self.processing_class).pad_token_id
        completions = self.accelerator.pad_across_processes(batch.completion_ids, dim=1, pad_index=pad_id)
        completions = self.accelerator.gather(completions)
        prompts = gather_object(list(samples.prompts))
        feedbacks = gather_object([row.get("privileged_context") for row in samples.rows])
        has_feedback = [isinstance(f, str) and f.strip() != "" for f in feedbacks]
        demos = [None] * len(rewards)
        if a.use_successful_as_teacher:
            demos = successful_demonstrations(
                rewards, size, a.success_reward_threshold, a.dont_reprompt_on_self_success
            )
        use_feedback = [
            a.include_environment_feedback
            and f
            and not (a.environment_feedback_only_without_solution and d is not None)
            for f, d in zip(has_feedback, demos, strict=True)
        ]
        mask = torch.tensor([float(d is not None or u) for d, u in zip(demos, use_feedback, strict=True)])
        batch.self_distillation_mask = mask.to(batch.completion_ids.device)[batch.row_index]
        if any(has_feedback) and not a.include_environment_feedback and not self._feedback_warned:
            self._feedback_warned = True
            logger.warning(
                "SDPO received environment feedback (`privileged_context`) in the batch, but "
                "`include_environment_feedback=False`, so it is being ignored (no reprompting from feedback). "
                "Set `include_environment_feedback=True` to use it."
            )
        self._log_context_metrics(mode, rewards, size, demos, has_feedback, use_feedback, mask)
        teacher_prompts = []
        for i in batch.row_index.tolist():
            solution = "" if demos[i] is None else self._solution_text(completions[demos[i]], pad_id)
            feedback = a.feedback_template.format(feedback_raw=feedbacks[i]) if use_feedback[i] else ""
            if solution or feedback:
                fields = dict(solution=solution, feedback=feedback)
                teacher_prompts.append(fill_teacher_template(a.reprompt_template, prompts[i], **fields))
            else:  # neither a demonstration nor feedback: the teacher reads the prompt unchanged
                teacher_prompts.append(prompts[i])
        return teacher_prompts

    def _solution_text(self, completion_ids, pad_id: int) -> str:
        text = self.processing_class.decode(completion_ids[completion_ids != pad_id], skip_special_tokens=True)
        if self.args.remove_thinking_from_demonstration:
            text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL).strip()
        return self.args.solution_template.format(successful_previous_attempt=text)

    def _log_context_metrics(self, mode, rewards, size, demos, has_feedback, use_feedback, mask) -> None:
        threshold, total = self.args.success_reward_threshold, max(len(rewards), 1)
        groups = [rewards[start : start + size] for start in range(0, len(rewards), size)]
        success_groups = sum(any(r >= threshold for r in group) for group in groups) / max(1, len(rewards) // size)
        metrics = {
            "success_group_fraction": success_groups,
            "success_sample_fraction": sum(d is not None for d in demos) / total,
            "feedback_available_fraction": sum(has_feedback) / total,
            "feedback_used_fraction": sum(map(bool, use_feedback)) / total,
            "reprompt_sample_fraction": mask.mean().item(),
        }
        for name, value in metrics.items():
            self.log_metric(f"self_distillation/{name}", value)
        tolerance = self.args.diagnostics_flat_tolerance
        inactive = metrics["reprompt_sample_fraction"] <= tolerance
        self._degenerate_rounds.observe(mode, "inactive_self_distillation", inactive, INACTIVE)
        self._degenerate_rounds.observe(mode, "no_successful_rollouts", success_groups <= tolerance, NO_SUCCESS)

    # ------------------------------------------------------------------ the loss
    def compute_policy_loss(self, model, inputs, num_items_in_batch=None):
        weight = self.args.distillation_weight
        student_logits = self.student_logits(model, inputs)
        if weight == 0.0:
            return self.policy_loss(inputs, student_logits)  # no teacher forward
        distillation = self.distillation_loss(model, inputs, student_logits)
        if weight == 1.0:
            return distillation
        return (1 - weight) * self.policy_loss(inputs, student_logits) + weight * distillation

    def policy_loss(self, inputs, student_logits) -> torch.Tensor:
        """L_PG of the module docstring for a micro-batch, logged as `self_distillation/policy_loss`."""
        mask, ids = inputs["completion_mask"], inputs["completion_ids"]
        logps = student_logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        old_logps = inputs.get("old_logps", inputs.get("old_per_token_logps"))
        bounds = (1 - self.epsilon_low, 1 + self.epsilon_high)
        level, advantages = self.importance_sampling_level, inputs["advantages"]
        terms = policy_loss_terms(logps, old_logps, mask, advantages, level, *bounds, self.args, inputs)
        per_token_loss, _ = clipped_surrogate(terms)
        loss = SDPO_NORMALISERS[self.loss_type](self, per_token_loss * mask, terms, 1.0, self.mode)
        self.log_metric("self_distillation/policy_loss", loss.item())
        return loss


def successful_demonstrations(rewards: list[float], size: int, threshold: float, exclude_self: bool) -> list:
    """For each row of the generation batch, the index of its demonstration: the first row of its group (groups of
    `size` contiguous rows) whose reward reaches `threshold`, the row itself excluded with `exclude_self`; None where
    there is none."""
    demos = []
    for i in range(len(rewards)):
        start = i - i % size
        candidates = [j for j in range(start, start + size) if not (exclude_self and j == i)]
        demos.append(next((j for j in candidates if rewards[j] >= threshold), None))
    return demos
