r"""The self-teacher's privileged contexts (TRL 1.16's teacher context builders): what the policy, as its own teacher,
reads in place of the student's prompt before the student's completion. A self-distillation trainer names its kind
(`teacher_context_class`), as a policy-gradient trainer names its loss in `online/policy_losses.py`; the core builds
it once, as `trainer.teacher_context_builder` (TRL's attribute), and asks it for each round's teacher prompts.

- `DemonstrationContext` (SDFT, TRL's `DemonstrationTeacherContextBuilder`): `teacher_prompt_template` filled with the
  prompt and the row's `privileged_context` (a demonstration or a hint), for every row.
- `SuccessfulRolloutContext` (SDPO, TRL's `SuccessfulRolloutTeacherContextBuilder`): completion i's demonstration is
  the first completion j of its group (over all processes) with r_j >= `success_reward_threshold` (j ≠ i with
  `dont_reprompt_on_self_success`), written into `solution_template`; with `include_environment_feedback` the row's
  `privileged_context` goes into `feedback_template` too (only where no sibling succeeded, with
  `environment_feedback_only_without_solution`); both go into `reprompt_template`. A row with neither keeps its
  prompt and is left out of the distillation loss (`self_distillation_mask` = 0).

A prompt that is a conversation has its last user turn's text formatted into the template and replaced, the other
turns kept (`fill_teacher_template`).
"""

import logging
import re

import torch

from ..models.loading import get_tokenizer
from .metrics import DegenerateRoundWarnings
from .rollout import RolloutBatch, Samples


logger = logging.getLogger(__name__)

IGNORED_FEEDBACK = (
    "SDPO received environment feedback (`privileged_context`) in the batch, but `include_environment_feedback=False`,"
    " so it is being ignored (no reprompting from feedback). Set `include_environment_feedback=True` to use it."
)
INACTIVE = (
    "SDPO self-distillation is inactive because no reprompted samples were constructed. This usually means no "
    "rollout exceeded `success_reward_threshold` and no usable privileged feedback was available."
)
NO_SUCCESS = (
    "SDPO did not find any successful rollouts in the current generation groups. If this persists, reduce task "
    "difficulty, adjust reward shaping, or lower `success_reward_threshold`."
)


class TeacherContext:
    """A kind of privileged context, built by the self-distillation core for its trainer."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.last_metrics: dict[str, float] = {}  # TRL's: the last round's context metrics

    def teacher_prompts(self, batch: RolloutBatch, samples: Samples, mode: str) -> list:
        """The teacher's prompt of each row of this process (texts or conversations); may set
        `batch.self_distillation_mask`."""
        raise NotImplementedError(f"{type(self).__name__} must implement teacher_prompts.")


class DemonstrationContext(TeacherContext):
    """SDFT's context (module docstring): the row's own demonstration."""

    def teacher_prompts(self, batch: RolloutBatch, samples: Samples, mode: str) -> list:
        return self.compose(samples.rows, samples.prompts)

    def compose(self, rows: list[dict], prompts: list) -> list:
        """`teacher_prompt_template` filled with each prompt and its row's privileged context as text."""
        template = self.trainer.args.teacher_prompt_template
        return [
            fill_teacher_template(template, prompt, privileged_context=privileged_text(row.get("privileged_context")))
            for row, prompt in zip(rows, prompts, strict=True)
        ]


class SuccessfulRolloutContext(TeacherContext):
    """SDPO's context (module docstring): a successful sibling and, where asked, the environment's feedback."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.feedback_ignored_warned = False  # the ignored-feedback warning, once
        self.degenerate_rounds = DegenerateRoundWarnings(trainer.args.diagnostics_warning_interval)

    def teacher_prompts(self, batch: RolloutBatch, samples: Samples, mode: str) -> list:
        """The rule is taken over the whole generation batch (every process's rows); this process's rows get their
        prompts and `batch.self_distillation_mask`, and TRL's context metrics are logged."""
        a, size = self.trainer.args, self.trainer.group_size(mode)
        rewards = batch.gather_global(batch.rewards).nan_to_num(0.0).tolist()
        feedbacks = [row.get("privileged_context") for row in samples.rows]  # this process's rows, as the batch's
        local_has_feedback = [int(isinstance(f, str) and f.strip() != "") for f in feedbacks]
        has_feedback = batch.gather_global(batch.rewards.new_tensor(local_has_feedback).long()).bool().tolist()
        demos = [None] * len(rewards)
        if a.use_successful_as_teacher:
            threshold, exclude_self = a.success_reward_threshold, a.dont_reprompt_on_self_success
            demos = successful_demonstrations(rewards, size, threshold, exclude_self)
        only_without_solution = a.environment_feedback_only_without_solution
        use_feedback = [
            a.include_environment_feedback and available and not (only_without_solution and demo is not None)
            for available, demo in zip(has_feedback, demos, strict=True)
        ]
        mask = torch.tensor([float(d is not None or u) for d, u in zip(demos, use_feedback, strict=True)])
        batch.self_distillation_mask = mask.to(batch.completion_ids.device)[batch.row_index]
        if any(has_feedback) and not a.include_environment_feedback and not self.feedback_ignored_warned:
            self.feedback_ignored_warned = True
            logger.warning(IGNORED_FEEDBACK)
        self.log_context_metrics(mode, rewards, size, demos, has_feedback, use_feedback, mask)
        completions = self.global_completions(batch)
        teacher_prompts = []
        for i, prompt, feedback_raw in zip(batch.row_index.tolist(), samples.prompts, feedbacks, strict=True):
            solution = "" if demos[i] is None else self.solution_text(completions[demos[i]])
            feedback = a.feedback_template.format(feedback_raw=feedback_raw) if use_feedback[i] else ""
            if solution or feedback:
                fields = dict(solution=solution, feedback=feedback)
                teacher_prompts.append(fill_teacher_template(a.reprompt_template, prompt, **fields))
            else:  # neither a demonstration nor feedback: the teacher reads the prompt unchanged
                teacher_prompts.append(prompt)
        return teacher_prompts

    def global_completions(self, batch: RolloutBatch) -> torch.Tensor:
        """`(N_global, C_max)`: every process's completion ids, in generation order, right-padded to one width."""
        accelerator, pad_id = self.trainer.accelerator, get_tokenizer(self.trainer.processing_class).pad_token_id
        return batch.gather_global(accelerator.pad_across_processes(batch.completion_ids, dim=1, pad_index=pad_id))

    def solution_text(self, completion_ids: torch.Tensor) -> str:
        """A demonstration in `solution_template` (its `<think>` blocks removed with
        `remove_thinking_from_demonstration`)."""
        a, processing_class = self.trainer.args, self.trainer.processing_class
        pad_id = get_tokenizer(processing_class).pad_token_id
        text = processing_class.decode(completion_ids[completion_ids != pad_id], skip_special_tokens=True)
        if a.remove_thinking_from_demonstration:
            text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL).strip()
        return a.solution_template.format(successful_previous_attempt=text)

    def log_context_metrics(self, mode, rewards, size, demos, has_feedback, use_feedback, mask) -> None:
        """TRL's `self_distillation/*` context metrics, and its warnings about rounds with nothing to distil."""
        threshold, total = self.trainer.args.success_reward_threshold, max(len(rewards), 1)
        groups = [rewards[start : start + size] for start in range(0, len(rewards), size)]
        success_groups = sum(any(r >= threshold for r in group) for group in groups) / max(1, len(rewards) // size)
        metrics = {
            "success_group_fraction": success_groups,
            "success_sample_fraction": sum(d is not None for d in demos) / total,
            "feedback_available_fraction": sum(has_feedback) / total,
            "feedback_used_fraction": sum(map(bool, use_feedback)) / total,
            "reprompt_sample_fraction": mask.mean().item(),
        }
        self.last_metrics = {f"self_distillation/{name}": value for name, value in metrics.items()}
        for name, value in self.last_metrics.items():
            self.trainer.log_metric(name, value)
        tolerance = self.trainer.args.diagnostics_flat_tolerance
        inactive = metrics["reprompt_sample_fraction"] <= tolerance
        self.degenerate_rounds.observe(mode, "inactive_self_distillation", inactive, INACTIVE)
        self.degenerate_rounds.observe(mode, "no_successful_rollouts", success_groups <= tolerance, NO_SUCCESS)


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


def privileged_text(context) -> str:
    """A row's privileged context as text: a string as it is, messages as their non-empty text contents joined by
    newlines, anything else `str()`; None raises."""
    if context is None:
        raise ValueError("`privileged_context` must not be None for self-distillation teacher prompt construction.")
    if isinstance(context, str):
        return context
    if isinstance(context, list) and context and isinstance(context[0], dict):
        texts = [message_text(message.get("content", "")) for message in context]
        return "\n".join(text for text in texts if text)
    return str(context)


def message_text(content) -> str:
    """A message's content as text (a list of parts: its text parts joined by spaces)."""
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
    return str(content)


def last_user_text(conversation: list) -> str:
    """The text of a conversation's last turn, which must be the user's."""
    last = conversation[-1]
    if last.get("role") != "user":
        raise ValueError(
            "Self-distillation teacher prompt construction expects the conversation to end with a user turn, but "
            f"the last message has role {last.get('role')!r}. End each prompt with the user's question."
        )
    return message_text(last.get("content", ""))


def fill_teacher_template(template: str, prompt, **fields):
    """A teacher prompt: `template` formatted with the prompt's text as `{prompt}` and `fields`; for a conversation,
    its last user turn's text is formatted and replaced, the other turns kept (TRL's context builders). One
    `format` call: braces inside the prompt or the fields stay as they are."""
    if isinstance(prompt, list):
        text = template.format(prompt=last_user_text(prompt), **fields)
        return [*prompt[:-1], {"role": "user", "content": text}]
    return template.format(prompt=prompt, **fields)
