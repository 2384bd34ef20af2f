r"""Self-Distillation Fine-Tuning (SDFT), Shenfeld et al., 2026, "Self-Distillation Enables Continual Learning"
(arXiv:2601.19897): a drop-in for TRL 1.16's `trl.experimental.sdft.SDFTTrainer` on the self-distillation core
(`online/self_distillation.py`, which states the loss).

Each dataset row holds a `prompt` x and a `privileged_context` c (a demonstration or a hint: text, messages, or
anything `str()` renders). The student samples y ~ π_θ(·|x) (with `generate_from_teacher`, from the teacher's prompt
instead); the teacher, the policy as it started (`teacher_model_kind="base"`, default), is read on
`teacher_prompt_template.format(prompt=x, privileged_context=c)` followed by the same y, and the student learns its
next-token distribution there: by default D = the Jensen-Shannon divergence (α = 0.5) over the student's top-100
tokens, the first `num_loss_tokens_to_skip` completion tokens left out. No rewards.
"""

from dataclasses import dataclass

from datasets import IterableDataset

from ..core.config import document_fields, option
from ..online.rollout import RolloutPlan
from ..online.self_distillation import SelfDistillationConfig, SelfDistillationCore
from ..online.teacher_contexts import DemonstrationContext


@document_fields
@dataclass
class SDFTConfig(SelfDistillationConfig):
    """Configuration of `SDFTTrainer`: every field of `trl.experimental.sdft.SDFTConfig` 1.16, same names and
    defaults; the sampling, vLLM and logging fields are the online core's."""

    _inapplicable_fields = (
        "beta", "epsilon", "epsilon_high", "reward_weights", "mask_truncated_completions", "async_rollouts",
    )  # fmt: skip
    _inapplicable_reason = "SDFT (no rewards, ratio or clipping; rollouts are synchronous)"

    generate_from_teacher: bool = option(False, "Sample completions from the teacher's prompt (no π_old then).")
    teacher_prompt_template: str = option(
        "{prompt}\n\n{privileged_context}", "The teacher's prompt, from the row's prompt and privileged_context."
    )
    num_loss_tokens_to_skip: int = option(0, "Leading completion tokens left out of the distillation loss.")

    def __post_init__(self):
        super().__post_init__()
        if (
            "{prompt}" not in self.teacher_prompt_template
            or "{privileged_context}" not in self.teacher_prompt_template
        ):
            raise ValueError(
                "teacher_prompt_template must contain both `{prompt}` and `{privileged_context}` placeholders"
            )


class SDFTTrainer(SelfDistillationCore):
    """SDFT (see the module docstring). TRL 1.16's constructor."""

    _name = "SDFT"
    config_class = SDFTConfig
    teacher_context_class = DemonstrationContext  # the row's privileged_context in teacher_prompt_template

    def __init__(
        self,
        model,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        if isinstance(train_dataset, IterableDataset):
            raise NotImplementedError("Iterable datasets are not yet supported in SDFTTrainer.")
        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        if any(isinstance(d, IterableDataset) for d in evals):
            raise NotImplementedError("Iterable eval datasets are not yet supported in SDFTTrainer.")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        super().__init__(
            model,
            None,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )

    num_loss_tokens_to_skip = property(lambda self: self.args.num_loss_tokens_to_skip)
    generate_from_teacher = property(lambda self: self.args.generate_from_teacher)

    def build_rewards(self) -> None:
        return None  # the teacher's distribution is the signal

    def rollout_plan(self) -> RolloutPlan:
        """TRL's rule for π_old (the importance weight's denominator), except when the teacher's prompt sampled: the
        student's π_old of those tokens is not what sampled them, so none (TRL's)."""
        plan = RolloutPlan.trl(self.args)
        return RolloutPlan(plan.old_logps_train and not self.args.generate_from_teacher, False)

    def generation_prompts(self, rows, prompts) -> list:
        if self.args.generate_from_teacher:
            return self.teacher_context_builder.compose(rows, prompts)
        return prompts
