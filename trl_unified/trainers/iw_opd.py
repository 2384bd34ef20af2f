r"""Importance-weighted on-policy distillation (IW-OPD: Xie et al., 2026, "On the Position Bias of On-Policy
Distillation", arXiv:2606.22600), a drop-in for `trl.experimental.iw_opd` 1.16 on the distillation core. Per sampled
token, a_t = log p_T(y_t) - log p_roll(y_t) (p_roll: vLLM's sampling log-probs, else the student's, detached), and
tokens before much |a| has accumulated weigh more (w and a detached; N the optimiser step's tokens, all processes):

    w_t = 1 + gamma (1 - S_t / Z),  S_t = sum_{j<t} |a_j|,  Z = max(sum_j |a_j|, epsilon),
    loss = - sum_{i,t} w_t a_t log p_S(y_t) / N.

`distillation_objective="jsd"`: D on the teacher's whole distribution (`loss_top_k=0`), its top-1 and the sampled
token (beta > 0, `loss_top_k=1`), or a top-k support, from a local teacher or a server (`use_teacher_server`).
"""

from dataclasses import dataclass
from operator import attrgetter

import torch

from ..core.config import document_fields, option
from ..core.divergence import position_weighted_advantages, topk_generalized_jsd_loss
from ..online.teachers import build_teachers
from .distillation import DistillationConfig, MessagesDistillationTrainer


@document_fields
@dataclass
class IWOPDConfig(DistillationConfig):
    """Configuration of `IWOPDTrainer`: every field of `trl.experimental.iw_opd.IWOPDConfig` 1.16, same defaults."""

    _unimplemented_fields = {
        **DistillationConfig._unimplemented_fields,
        "vllm_sync_frequency": "Weights reach vLLM at every optimiser step (vllm_sync_frequency=1).",
        "log_completions_steps": "Completions are logged at each logging step (log_completions, logging_steps).",
        "generation_batch_size": "Rounds are steps_per_generation micro-batches (1: each draws on/off-policy).",
    }

    remove_unused_columns: bool | None = option(True, "TRL's default; the trainer keeps every column (as TRL's).")
    disable_dropout: bool = option(True, "Disable dropout in the student.")
    max_length: int | None = option(1024, "Prompt + completion budget of the collator.")
    max_prompt_length: int | None = option(None, "Prompt budget (None: max_length - max_completion_length).")
    lmbda: float = option(1.0, "Probability that a round is the student's own samples (on-policy).")
    distillation_objective: str = option("iw_opd", "'iw_opd' (importance-weighted) or 'jsd' (the divergence).")
    iw_opd_gamma: float = option(0.5, "Weight amplification gamma: w_t in [1, 1 + gamma].")
    iw_opd_epsilon: float = option(1e-8, "Floor of the weights' denominator Z.")
    reverse_kl_top_1_mode: str = option("sampled", "The reverse-KL token of the top-1 support: 'sampled' or 'argmax'.")
    use_teacher_server: bool = option(False, "Score with the teacher server at teacher_model_server_url.")
    top_p: float = option(0.95, "Nucleus sampling of the student's completions.")
    vllm_server_port: int = option(8001, "Server mode: port of the student's vLLM server.")
    vllm_sync_frequency: int = option(1, "Optimiser steps between weight syncs to vLLM (only 1).")
    log_completions_steps: int = option(100, "TRL's completion-logging interval (see _unimplemented_fields).")
    steps_per_generation: int | None = option(1, "Micro-steps per round: 1 draws on/off-policy per micro-batch.")

    def __post_init__(self):
        iw_opd, server, k = self.distillation_objective == "iw_opd", self.use_teacher_server, self.loss_top_k
        mode, url = self.reverse_kl_top_1_mode, self.teacher_model_server_url
        liger, beta = self.use_liger_kernel, self.beta
        objective_known = self.distillation_objective in ("jsd", "iw_opd")
        rules = [
            (not 0 <= self.lmbda <= 1, f"lmbda must be in [0.0, 1.0], got {self.lmbda}."),
            (not 0 <= beta <= 1, f"beta must be in [0.0, 1.0], got {beta}."),
            (not objective_known, "distillation_objective must be one of: 'jsd', 'iw_opd'"),
            (self.iw_opd_gamma < 0, f"iw_opd_gamma must be non-negative, got {self.iw_opd_gamma}."),
            (self.iw_opd_epsilon <= 0, f"iw_opd_epsilon must be positive, got {self.iw_opd_epsilon}."),
            (mode not in ("sampled", "argmax"), "reverse_kl_top_1_mode must be one of: 'sampled', 'argmax'"),
            (self.max_completion_length >= (self.max_length or 1e9), "max_completion_length must be < max_length."),
            (server and liger, "use_liger_kernel=True is not supported with use_teacher_server=True."),
            (iw_opd and liger, "use_liger_kernel=True is not supported with distillation_objective='iw_opd'."),
            (iw_opd and self.lmbda < 1, "distillation_objective='iw_opd' requires lmbda=1.0 (on-policy)."),
            (iw_opd and mode != "sampled", "distillation_objective='iw_opd' requires reverse_kl_top_1_mode='sampled'"),
            (server and not url, "teacher_model_server_url must be set when use_teacher_server=True."),
            (server and beta == 0 and k < 1, f"loss_top_k must be positive with a server and beta=0, got {k}."),
            (server and mode == "argmax", "reverse_kl_top_1_mode='argmax' is not supported with use_teacher_server."),
            (server and beta > 0 and k != 1, "loss_top_k must be 1 when using use_teacher_server=True with beta>0"),
        ]  # fmt: skip
        for failed, message in rules:
            if failed:
                raise ValueError(message)
        if self.max_prompt_length is None and self.max_length is not None:
            self.max_prompt_length = self.max_length - self.max_completion_length
        super().__post_init__()

    def _check_server_support(self) -> None:
        """The server rules are IW-OPD's own (above), and apply only with `use_teacher_server`."""


class IWOPDTrainer(MessagesDistillationTrainer):
    """IW-OPD (see the module docstring). Same constructor as `trl.experimental.iw_opd.IWOPDTrainer` 1.16."""

    _name = "IW-OPD"
    _tag_names = ["trl", "iw-opd", "trl_unified"]
    config_class = IWOPDConfig
    temperature = generation_config = None  # TRL's plain attributes, set in setup() (its tests set them too)

    def setup(self) -> None:  # TRL's plain attributes, set at construction
        super().setup()
        a = self.args
        self.temperature, self.lmbda, self.use_teacher_server = a.temperature, a.lmbda, a.use_teacher_server
        self.iw_opd_gamma, self.iw_opd_epsilon = a.iw_opd_gamma, a.iw_opd_epsilon
        self.generation_config = self.make_generation_config(True, a.max_completion_length)

    collator_prompt_budget = property(attrgetter("args.max_prompt_length"))

    def build_teachers(self, student_vocabulary: int):
        """The teacher server (`use_teacher_server`), or the local teacher; none is allowed until the loss runs."""
        a = self.args
        sources, urls = (None, a.teacher_model_server_url) if a.use_teacher_server else (self._teacher_source, None)
        if sources is None and not urls:
            return []
        return build_teachers(sources, urls, None, a, self.accelerator, student_vocabulary, self._where)

    generalized_jsd_loss = staticmethod(topk_generalized_jsd_loss)  # TRL's IW-OPD loss API (with top_k, add_tail)

    @property
    def local_support_size(self) -> int:
        return self.args.loss_top_k  # 0: the teacher's whole distribution; TRL's default 1: its top-1 and the sample

    def token_divergence(
        self, model, input_ids, attention_mask, width, mask=None, labels=None, prompt_mask=None, routing=None
    ):
        """`jsd`: the core's D; `iw_opd`: IW-OPD's per-token loss in its place (the callers sum it over the loss's
        tokens and normalise it as the divergence)."""
        if not self.teachers:
            raise ValueError("No teacher model or teacher server configured.")
        if self.args.distillation_objective == "jsd":
            return super().token_divergence(
                model, input_ids, attention_mask, width, mask, labels, prompt_mask, routing
            )
        logits, teacher = self.sampled_token_logprobs(
            model, self.teachers[0], input_ids, attention_mask, width, labels, prompt_mask
        )
        valid = torch.ones_like(teacher, dtype=torch.bool) if mask is None else mask.bool()
        terms = self._iw_opd_terms(logits, input_ids[:, -width:], valid, teacher, self._rollout_logps)
        with torch.no_grad():
            log_probs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        return terms, -(log_probs.exp() * log_probs).sum(-1)

    _rollout_logps = None  # the sampling engine's log-probs of the batch being scored (vLLM), else None

    def compute_policy_loss(self, model, inputs, num_items_in_batch=None):
        self._rollout_logps = inputs.get("rollout_logprobs" if isinstance(inputs, dict) else "sampling_logps")
        try:
            return super().compute_policy_loss(model, inputs, num_items_in_batch)
        finally:
            self._rollout_logps = None

    def _iw_opd_terms(self, logits, tokens, valid, teacher, rollout=None):
        """Per-token `-w_t a_t log p_S(y_t)` (the module docstring) and TRL's `iw_opd/*` metrics of the batch."""
        student = torch.log_softmax(logits.float() / self.temperature, dim=-1).gather(-1, tokens[..., None])[..., 0]
        rollout = student if rollout is None else rollout[:, -tokens.size(1) :]
        advantage, weights = position_weighted_advantages(
            teacher, rollout, valid, self.iw_opd_gamma, self.iw_opd_epsilon
        )
        weighted = weights * advantage
        if valid.any():
            kept = weights[valid]
            metrics = dict(mean_advantage=weighted[valid].mean(), mean_abs_advantage=advantage[valid].abs().mean(),
                           mean_weight=kept.mean(), min_weight=kept.min(), max_weight=kept.max())  # fmt: skip
            for name, value in metrics.items():
                self.log_metric(f"iw_opd/{name}", value.item())
        return (-student * weighted).masked_fill(~valid, 0.0)

    def _compute_iw_opd_loss(
        self,
        student_logits,
        completion_tokens,
        labels,
        teacher_actual_logprobs,
        rollout_logprobs=None,
        num_items_in_batch=None,
    ):
        """TRL's method: IW-OPD's loss on completion positions (`labels` -100 off the completion), the sum over them
        divided by `num_items_in_batch` when given, else by their number."""
        valid = labels != -100
        terms = self._iw_opd_terms(student_logits, completion_tokens, valid, teacher_actual_logprobs, rollout_logprobs)
        return terms.sum() / (num_items_in_batch if num_items_in_batch is not None else valid.sum().clamp_min(1))
