r"""The self-distillation core of SDFT and SDPO (TRL 1.16's `trl.experimental.sdft` / `.sdpo`): the policy is its own
teacher (`online/teachers.py`, `SelfTeacher`: as it started, as it is, or an EMA of it), re-prompted with privileged
context, and the student learns the teacher's next-token distribution on the student's own completions:

    student:  x     -> y ~ π_θ(·|x)                       (the policy, on the plain prompt)
    teacher:  x + c -> π_T(·|x + c, y_<t) at every t       (the self-teacher, on the prompt with privileged context c)
    loss:     (1/B) Σ_i (1/|M_i|) Σ_{t ∈ M_i} w_t · ℓ_t    (ℓ_t: `self_distillation_divergence`, core/divergence.py)

with M_i the row's loss tokens (the completion, less what a trainer masks) and w_t = min(π_θ(y_t) / π_old(y_t),
`distillation_is_clip`) where the policy moved since sampling (π_old exists), else 1. A micro-batch with no loss
token gives 0 with the student's graph kept. Both models' logits are divided by `temperature`.

A trainer names the teacher's context (`teacher_context_class`, `online/teacher_contexts.py`: SDFT, the row's
demonstration; SDPO, a successful sibling rollout or the environment's feedback) and, for SDPO, its rewards and policy
loss; the core does the teacher's inputs, both forwards, the divergence, the teacher on the vLLM generation server
(`use_teacher_server`, live teacher), the EMA updates, and TRL's callback events (`on_generation_prompts_selected`,
`on_self_distillation_batch_prepared`, `on_generation_batch_built`).
"""

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import TrainerCallback

from ..core.config import document_fields, option
from ..core.divergence import (
    SELF_DISTILLATION_MODES,
    clipped_importance_weights,
    sampled_token_divergence,
    self_distillation_divergence,
    support_divergence,
)
from ..data.datasets import pad
from ..generation.prompts import encode_prompts, keep_last_tokens, normalize_prompts
from ..models.loading import get_tokenizer
from .config import OnlineConfig
from .rollout import RolloutBatch, Samples
from .teacher_contexts import TeacherContext
from .teachers import SELF_TEACHER_KINDS, SelfTeacher, build_teacher_request_inputs, teacher_client
from .trainer import OnlineTrainer


@document_fields
@dataclass
class SelfDistillationConfig(OnlineConfig):
    """The fields SDFT and SDPO share (TRL 1.16's `_BaseConfig` of `trl.experimental.sdft` / `.sdpo`)."""

    _min_num_generations: ClassVar[int] = 1

    learning_rate: float = option(5e-5, "Initial AdamW learning rate (TRL keeps transformers' default).")
    max_completion_length: int | None = option(256, "Maximum length of each generated completion.")
    disable_dropout: bool = option(True, "Set every dropout probability of the policy to 0.")
    max_prompt_length: int | None = option(512, "Student prompt tokens kept, the last ones (None: all).")
    use_teacher_server: bool = option(
        False, "Score the teacher on the vLLM generation server (vllm_mode='server', teacher_model_kind='live')."
    )
    teacher_model_kind: str = option("base", "The self-teacher: 'base' (frozen start), 'live' or 'ema'.")
    teacher_update_rate: float = option(0.05, "EMA teacher: r in θ_T ← (1 - r) θ_T + r θ_S.")
    teacher_sync_steps: int = option(1, "EMA teacher: optimiser steps between updates.")
    distillation_alpha: float = option(0.5, "D's interpolation: 0 forward KL, 1 reverse KL, between: the JSD.")
    distillation_mode: str = option("topk_logits", "'sampled_token', 'full_logits' or 'topk_logits'.")
    distillation_topk: int | None = option(100, "topk_logits: the student's top-k tokens D is taken over.")
    distillation_is_clip: float | None = option(2.0, "Cap of the importance weight π_θ / π_old (None: no weight).")
    distillation_add_tail: bool = option(False, "topk_logits: a bucket for the mass outside the top-k.")

    def __post_init__(self):
        super().__post_init__()
        if self.distillation_mode == "sampled_token" and self.distillation_alpha != 1.0:
            raise ValueError(
                "`distillation_mode='sampled_token'` only supports reverse KL, so it requires "
                f"`distillation_alpha=1.0`, got {self.distillation_alpha}."
            )
        if self.distillation_mode not in SELF_DISTILLATION_MODES:
            raise ValueError(
                f"distillation_mode must be one of: {SELF_DISTILLATION_MODES}, got {self.distillation_mode!r}"
            )
        if self.teacher_model_kind not in SELF_TEACHER_KINDS:
            raise ValueError(f"teacher_model_kind={self.teacher_model_kind!r} is not one of {SELF_TEACHER_KINDS}.")
        if self.use_teacher_server:
            self._check_teacher_server()

    def _check_teacher_server(self) -> None:
        if not (self.use_vllm and self.vllm_mode == "server"):
            raise ValueError("`use_teacher_server=True` requires `use_vllm=True` and `vllm_mode='server'`.")
        if self.teacher_model_kind != "live":
            raise ValueError(
                "`use_teacher_server=True` requires `teacher_model_kind='live'`: the server holds the policy's "
                "current weights."
            )
        if self.distillation_mode == "full_logits":
            raise ValueError("`use_teacher_server=True` supports distillation_mode 'sampled_token' or 'topk_logits'.")

    def uses_reference_model(self) -> bool:
        return False  # the teacher is the policy itself (`SelfTeacher`), never a reference model


@dataclass
class SelfDistillationBatch(RolloutBatch):
    """A `RolloutBatch` with the teacher's inputs: `teacher_input_ids` / `teacher_attention_mask` `(B, Lt + C)`, the
    left-padded teacher prompt followed by the same completion block (so the last C positions align), and
    `self_distillation_mask` `(B,)` (SDPO: 1 where the row has a teacher context, else None: every row)."""

    teacher_input_ids: torch.Tensor | None = None
    teacher_attention_mask: torch.Tensor | None = None
    self_distillation_mask: torch.Tensor | None = None


@dataclass
class StudentOutputs:
    """The student's side of a micro-batch: `logps` `(B, C)`, the completion tokens' log-probs (with grad), and
    `logits` `(B, C, V)` at the temperature where the loss reads whole distributions (else None)."""

    logps: torch.Tensor
    logits: torch.Tensor | None = None


class _UpdateSelfTeacher(TrainerCallback):
    """The EMA teacher's update after each optimiser step (`SelfTeacher.update`)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        trainer.self_teacher.update(trainer.accelerator.unwrap_model(trainer.model), state.global_step)


class SelfDistillationCore(OnlineTrainer):
    """The online core with the policy as its own teacher (module docstring). A trainer names its
    `teacher_context_class`; hooks: `teacher_prompts`, `generation_prompts`, `distillation_mask`; SDPO adds a policy
    loss in `compute_policy_loss`."""

    config_class = SelfDistillationConfig
    teacher_context_class: ClassVar[type[TeacherContext]] = TeacherContext
    batch_class = SelfDistillationBatch
    loss_is_scaled_for_ga = False  # a per-micro-batch mean: the Trainer divides it by the accumulation

    def setup(self) -> None:
        super().setup()
        a = self.args
        self.self_teacher = SelfTeacher.build(
            a.teacher_model_kind, self.model, a, self.accelerator, self.adapter_is_pretrained
        )
        self.add_callback(_UpdateSelfTeacher(self))
        self.teacher_context_builder = self.teacher_context_class(self)  # TRL's attribute
        self.use_teacher_server = a.use_teacher_server  # TRL's attributes, read at loss time
        self.teacher_client = None
        if a.use_teacher_server:
            self.teacher_client = teacher_client(self.vllm_engine.base_url, a.vllm_server_timeout, self._where)

    teacher_model = property(lambda self: self.self_teacher.model)  # TRL's attribute
    num_loss_tokens_to_skip = 0  # SDFT's: leading completion tokens left out of the loss

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "privileged_context"]

    def generation_options(self) -> dict[str, Any]:
        return {**super().generation_options(), "max_prompt_length": self.args.max_prompt_length}

    def dispatch_event(self, name: str, **payload) -> None:
        """TRL's self-distillation callback events: `callback.<name>(args=, state=, control=, model=,
        processing_class=, **payload)` on every callback that defines it."""
        for callback in self.callback_handler.callbacks:
            method = getattr(callback, name, None)
            if method is not None:
                common = dict(args=self.args, state=self.state, control=self.control, model=self.model)
                method(**common, processing_class=self.processing_class, **payload)

    # ------------------------------------------------------------------ the rollout
    def generation_prompts(self, rows, prompts) -> list:
        """The prompts the policy samples from (default: the student's own; SDFT's `generate_from_teacher`: the
        teacher's). The batch always holds the student's prompts."""
        return prompts

    def sample_completions(self, rows, prompts, images, environments):
        generation_prompts = self.generation_prompts(rows, prompts)
        self.dispatch_event(
            "on_generation_prompts_selected", generation_prompts=generation_prompts, generation_prompt_text=None
        )
        if generation_prompts is prompts:
            return super().sample_completions(rows, prompts, images, environments)
        sampled = self._generate(generation_prompts, images, environments=environments)
        student_prompt_ids = [e["input_ids"] for e in self.encode_prompts(prompts, self.args.max_prompt_length)]
        conversational = isinstance(prompts[0], list)
        return self.given_completions(student_prompt_ids, sampled.generation.completion_ids_list, conversational)

    def encode_prompts(self, prompts: list, max_length: int | None) -> list[dict]:
        """Prompts tokenised as generation tokenises them (chat template with `chat_template_kwargs`), each cut to
        its last `max_length` tokens."""
        tokenizer = get_tokenizer(self.processing_class)
        normalized = normalize_prompts(prompts, tokenizer.pad_token_id)
        encoded = encode_prompts(self.processing_class, normalized, None, self.args.chat_template_kwargs or {})
        return [keep_last_tokens(e, max_length) for e in encoded] if max_length is not None else encoded

    def score_rollout(self, batch: SelfDistillationBatch, samples: Samples, mode: str) -> None:
        """Rewards and advantages where the trainer has reward functions (SDPO), then the teacher's inputs and TRL's
        events (`on_teacher_context_built`, `on_self_distillation_batch_prepared`, and `on_generation_batch_built`
        once per training round)."""
        if self.rewards is not None:
            super().score_rollout(batch, samples, mode)
        else:
            self.log_unscored_round(batch, samples)
        teacher_prompts = self.teacher_prompts(batch, samples, mode)
        self.attach_teacher_inputs(batch, teacher_prompts)
        payload = dict(
            old_per_token_logps=batch.old_logps,
            prompt_ids=batch.prompt_ids,
            completion_ids=batch.completion_ids,
            teacher_input_ids=batch.teacher_input_ids,
            teacher_attention_mask=batch.teacher_attention_mask,
        )
        if batch.self_distillation_mask is not None:
            payload["self_distillation_mask"] = batch.self_distillation_mask
        self.dispatch_event(
            "on_teacher_context_built",
            teacher_input_ids=batch.teacher_input_ids,
            teacher_attention_mask=batch.teacher_attention_mask,
            completion_mask=batch.completion_mask,
            self_distillation_mask=batch.self_distillation_mask,
        )
        self.dispatch_event("on_self_distillation_batch_prepared", **payload)
        if mode == "train":
            every = self.args.steps_per_generation * self.args.num_iterations
            steps = self.args.steps_per_generation
            self.dispatch_event("on_generation_batch_built", generate_every=every, steps_per_generation=steps)

    def teacher_prompts(self, batch: SelfDistillationBatch, samples: Samples, mode: str) -> list:
        """The teacher's prompt of each row of this process (texts or conversations), from the trainer's teacher
        context; it may set `batch.self_distillation_mask`."""
        return self.teacher_context_builder.teacher_prompts(batch, samples, mode)

    def teacher_prompt_length(self) -> int | None:
        """The teacher prompt tokens kept, the last ones (default: the student's `max_prompt_length`; SDPO:
        `max_reprompt_len`)."""
        return self.args.max_prompt_length

    def attach_teacher_inputs(self, batch: SelfDistillationBatch, teacher_prompts: list) -> None:
        """`teacher_input_ids` / `teacher_attention_mask`: each teacher prompt (cut to its last
        `teacher_prompt_length()` tokens) left-padded, then the batch's completion block."""
        encoded = self.encode_prompts(teacher_prompts, self.teacher_prompt_length())
        ids = [torch.as_tensor(e["input_ids"], dtype=torch.long).view(-1) for e in encoded]
        pad_id = get_tokenizer(self.processing_class).pad_token_id
        device = batch.completion_ids.device
        prompt_ids = pad(ids, pad_id, "left").to(device)
        prompt_mask = pad([torch.ones_like(t) for t in ids], 0, "left").to(device)
        batch.teacher_input_ids = torch.cat([prompt_ids, batch.completion_ids], dim=1)
        batch.teacher_attention_mask = torch.cat([prompt_mask, batch.completion_mask], dim=1)

    # ------------------------------------------------------------------ the loss
    def distillation_mask(self, inputs) -> torch.Tensor:
        """`(B, C)`: the completion tokens the distillation loss is taken over (SDFT: less the first
        `num_loss_tokens_to_skip`; a row with `self_distillation_mask` 0: none)."""
        mask = inputs["completion_mask"]
        if self.num_loss_tokens_to_skip > 0:
            positions = torch.arange(mask.size(1), device=mask.device).unsqueeze(0)
            mask = mask * (positions >= self.num_loss_tokens_to_skip).long()
        rows = inputs.get("self_distillation_mask")
        return mask * rows.unsqueeze(1) if rows is not None else mask

    def reads_whole_distributions(self) -> bool:
        """Whether the loss reads the student's and the teacher's distributions over the vocabulary (`full_logits`,
        `topk_logits`), or only the sampled tokens' log-probs (`sampled_token`): both forwards then take the core's
        log-prob path (each distinct prompt encoded once, the chunked head), with no `(B, C, V)` logits."""
        return self.args.distillation_mode != "sampled_token"

    def completion_logits(self, model, input_ids, attention_mask, width: int) -> torch.Tensor:
        """`(B, C, V)` logits at the C completion positions, divided by the temperature (TRL's `_forward_logits`)."""
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=width + 1)
        return logits.logits[:, :-1][:, -width:] / self.temperature

    def student_outputs(self, model, inputs) -> StudentOutputs:
        """The student's forward over prompt + completion: the completion tokens' log-probs, and their logits where
        `reads_whole_distributions`."""
        completion_ids, width = inputs["completion_ids"], inputs["completion_ids"].size(1)
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        if not self.reads_whole_distributions():
            return StudentOutputs(self.token_logprobs(model, input_ids, attention_mask, width).logps)
        logits = self.completion_logits(model, input_ids, attention_mask, width)
        return StudentOutputs(logits.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1), logits)

    def teacher_logits(self, model, inputs) -> torch.Tensor:
        """`(B, C, V)`: the self-teacher's logits at the completion positions, on its prompt, without grad."""
        width = inputs["completion_ids"].size(1)
        with torch.no_grad(), self.self_teacher.use(model, self.accelerator) as teacher:
            return self.completion_logits(
                teacher, inputs["teacher_input_ids"], inputs["teacher_attention_mask"], width
            )

    def teacher_token_logps(self, model, inputs) -> torch.Tensor:
        """`(B, C)`: the self-teacher's log-probs of the completion tokens, on its prompt, without grad (the core's
        log-prob path)."""
        width = inputs["completion_ids"].size(1)
        with torch.no_grad(), self.self_teacher.use(model, self.accelerator) as teacher:
            ids, attention_mask = inputs["teacher_input_ids"], inputs["teacher_attention_mask"]
            return self.token_logprobs(teacher, ids, attention_mask, width).logps

    def compute_policy_loss(self, model, inputs, num_items_in_batch=None):
        return self.distillation_loss(model, inputs, self.student_outputs(model, inputs))

    def distillation_loss(self, model, inputs, student: StudentOutputs) -> torch.Tensor:
        """The module docstring's loss for a micro-batch (`SelfDistillationBatch` or a dict in TRL's keys), logged as
        `self_distillation/distillation_loss` and `<trainer>/distillation_loss`; the teacher on the server when
        `use_teacher_server`."""
        mask = self.distillation_mask(inputs)
        if mask.sum() == 0:
            self._log_distillation(0.0)
            return student.logps.sum() * 0.0  # zero gradients, graph kept
        a = self.args
        if self.use_teacher_server:
            per_token = self.server_divergence(inputs, student, mask)
        elif student.logits is None:  # sampled_token
            per_token = sampled_token_divergence(student.logps, self.teacher_token_logps(model, inputs))
        else:
            per_token = self_distillation_divergence(
                student.logits,
                self.teacher_logits(model, inputs),
                inputs["completion_ids"],
                a.distillation_mode,
                a.distillation_alpha,
                a.distillation_topk,
                a.distillation_add_tail,
            )
        old_logps = inputs.get("old_logps", inputs.get("old_per_token_logps"))
        if a.distillation_is_clip is not None and old_logps is not None:
            per_token = per_token * clipped_importance_weights(student.logps, old_logps, a.distillation_is_clip)
        masked = per_token * mask
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()  # per-row token mean, then over all rows
        self._log_distillation((masked.sum() / mask.sum().clamp(min=1)).item())
        return loss

    def _log_distillation(self, value: float) -> None:
        self.log_metric("self_distillation/distillation_loss", value)
        self.log_metric(f"{self._name.lower()}/distillation_loss", value)

    def server_divergence(self, inputs, student: StudentOutputs, mask) -> torch.Tensor:
        """The per-token loss with the live teacher scored by the vLLM generation server (its weights synced first):
        the sampled token's log-prob (`sampled_token`), or the teacher's top-k (`topk_logits`, D on the teacher's
        support, as TRL: the server cannot score the student's)."""
        if self.vllm_engine is not None:
            self._synced_vllm_engine()  # the current weights score (a round is reused over iterations)
        teacher = self.server_teacher_logprobs(inputs)
        required = mask.bool()
        teacher_logps = teacher["actual_logprobs"]
        if (required & ~torch.isfinite(teacher_logps)).any():
            raise ValueError("Teacher server returned no logprob for a required completion token.")
        teacher_logps = torch.where(required, teacher_logps, torch.zeros_like(teacher_logps))
        difference = ((student.logps.detach() - teacher_logps).abs() * mask).sum() / mask.sum().clamp(min=1)
        self.log_metric("self_distillation/server_logprob_abs_diff", difference.item())
        if self.args.distillation_mode == "sampled_token":
            return sampled_token_divergence(student.logps, teacher_logps)
        keep = required.unsqueeze(-1)
        student_topk = student.logits.log_softmax(-1).gather(-1, teacher["topk_token_ids"])
        student_topk = torch.where(keep, student_topk, torch.zeros_like(student_topk))
        teacher_topk = torch.where(keep, teacher["topk_logprobs"], torch.zeros_like(teacher["topk_logprobs"]))
        return support_divergence(
            student_topk, teacher_topk, self.args.distillation_alpha, self.args.distillation_add_tail
        )

    def server_teacher_logprobs(self, inputs) -> dict[str, torch.Tensor]:
        """TRL's `_get_teacher_token_logprobs_from_server` for self-distillation: the teacher rows scored by
        `teacher_client`, each row's values at its first completion positions, `-inf` / id 0 after them."""
        ids, attention = inputs["teacher_input_ids"], inputs["teacher_attention_mask"]
        width = inputs["completion_ids"].size(1)
        if self.args.distillation_mode == "topk_logits" and self.args.distillation_topk is None:
            raise ValueError("`distillation_mode='topk_logits'` requires `distillation_topk` to be set.")
        top_k = self.args.distillation_topk if self.args.distillation_mode == "topk_logits" else 1
        sequences, prompt_lengths, _ = build_teacher_request_inputs(
            ids, attention, attention[:, : ids.size(1) - width]
        )
        result = self.teacher_client.get_sequence_logprobs(
            sequences=sequences, prompt_lengths=prompt_lengths, top_logprobs=top_k, temperature=self.temperature
        )
        rows = ids.size(0)
        actual = torch.full((rows, width), float("-inf"))
        topk = torch.full((rows, width, top_k), float("-inf"))
        topk_ids = torch.zeros((rows, width, top_k), dtype=torch.long)
        for i in range(rows):
            n = min(len(result["actual_logprobs"][i]), width)
            if n:
                actual[i, :n] = torch.tensor(result["actual_logprobs"][i], dtype=torch.float32)[:n, 0]
                topk[i, :n] = torch.tensor(result["logprobs"][i], dtype=torch.float32)[:n]
                topk_ids[i, :n] = torch.tensor(result["logprob_token_ids"][i], dtype=torch.long)[:n]
        device = ids.device
        return {
            "actual_logprobs": actual.to(device),
            "topk_logprobs": topk.to(device),
            "topk_token_ids": topk_ids.to(device),
        }

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        return {"self_teacher": self.self_teacher.state_dict()}  # an EMA teacher resumes where it was

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        if state.get("self_teacher"):
            self.self_teacher.load_state_dict(state["self_teacher"])
