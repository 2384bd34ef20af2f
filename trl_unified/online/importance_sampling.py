r"""Importance-sampling correction for the mismatch between the generation engine and the trainer (vLLM), as TRL 1.16
computes it (truncated importance sampling, Yao et al., 2025, "Your efficient RL framework secretly brings you
off-policy RL training"; the masked variant of Liu et al., 2025, "When speed kills stability").

vLLM samples completions with its own kernels, so the log-probs it reports, log pi_vllm, differ from the trainer's
log pi_old of the same tokens under the same weights. With mask m (1 on the model's completion tokens):

    token level:     log w_t = (log pi_old_t - log pi_vllm_t) m_t                           shape (B, C)
    sequence level:  log w   = sum_t (log pi_old_t - log pi_vllm_t) m_t                     shape (B, 1)
    w = exp(log w);  tokens vLLM gave no log-prob for (NaN) contribute 0 (w = 1)
    *_truncate:  w <- clamp(w, C_min, C_max)        *_mask:  w <- 0 where w < C_min or w > C_max

The per-token policy loss is multiplied by w (GRPO; VESPO folds it into its weights instead).
"""

import math
import warnings
from dataclasses import dataclass, fields

import torch
from accelerate.utils import gather

from ..core.config import option
from .rollout import RolloutBatch, RolloutPlan


IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
_REDUCTION_BY_SUFFIX = {"min": torch.min, "mean": torch.mean, "max": torch.max}  # of the gathered `sampling/*` values


@dataclass
class ImportanceSamplingConfig:
    """The correction's config fields, with `trl.GRPOConfig` 1.16's names and defaults: mixed into the config of a
    trainer that applies it, before its `OnlineConfig` base (so that `output_dir` stays the first field). Used only
    with `use_vllm` (`OnlineConfig` raises when one is set without it); `check_importance_sampling` validates them."""

    vllm_importance_sampling_correction: bool = option(
        True, "With use_vllm: correct the loss for the vLLM/trainer log-prob mismatch (online/importance_sampling.py)."
    )
    vllm_importance_sampling_mode: str = option(
        "sequence_mask", f"The correction's level and rule: one of {', '.join(IS_MODES)}."
    )
    vllm_importance_sampling_clip_max: float | None = option(3.0, "Upper bound C_max of the ratio (None: none).")
    vllm_importance_sampling_clip_min: float | None = option(None, "Lower bound C_min of the ratio (None: none).")
    vllm_importance_sampling_cap: float | None = option(None, "Deprecated: vllm_importance_sampling_clip_max.")

    def check_importance_sampling(self) -> None:
        """TRL's checks: the deprecated cap moves to `clip_max` (FutureWarning), C_min < C_max, a known mode."""
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "The `vllm_importance_sampling_cap` argument is deprecated and will be removed in v2.0.0. "
                "Use `vllm_importance_sampling_clip_max` instead.",
                FutureWarning,
                stacklevel=3,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({low}) must be less than vllm_importance_sampling_clip_max "
                f"({high})."
            )
        if self.vllm_importance_sampling_mode not in IS_MODES:
            raise ValueError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is not one of {list(IS_MODES)}."
            )


IMPORTANCE_SAMPLING_FIELDS = tuple(f.name for f in fields(ImportanceSamplingConfig))


class ImportanceSamplingMixin:
    """The correction as an online trainer's hooks: mix in before `OnlineTrainer`, with `ImportanceSamplingConfig`."""

    @property
    def corrects_sampling(self) -> bool:
        """Whether this run applies the correction: it generates with vLLM and the correction is on."""
        return self.vllm_engine is not None and self.args.vllm_importance_sampling_correction

    def rollout_plan(self) -> RolloutPlan:
        if self.corrects_sampling:
            return RolloutPlan(old_logps_train=True, old_logps_eval=True)
        return super().rollout_plan()

    def correct_sampling(self, batch: RolloutBatch) -> None:
        """The ratio w of the module docstring into `batch.importance_sampling_ratio`, and TRL's `sampling/*`
        metrics over every process."""
        if not self.corrects_sampling:
            return
        a, mask = self.args, batch.loss_mask
        if batch.sampling_logps is None:  # a tool loop or rollout_func: no engine log-probs, w = 1 (TRL's NaN rule)
            batch.sampling_logps = torch.full_like(batch.old_logps, float("nan"))
        mode = a.vllm_importance_sampling_mode
        low, high = a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max
        ratio = importance_sampling_ratio(batch.old_logps, batch.sampling_logps, mask, mode, low, high)
        batch.importance_sampling_ratio = ratio
        for name, value in mismatch_metrics(batch.old_logps, batch.sampling_logps, mask, ratio, mode).items():
            values = gather(value.reshape(1))
            reduce = _REDUCTION_BY_SUFFIX.get(name.rsplit("/", 1)[-1], torch.mean)
            self.log_metric(name, reduce(values[~torch.isnan(values)]).item() if values.numel() else 0.0)
        if a.async_rollouts:  # the correction split by how old the sampling weights were
            name = f"sampling/importance_sampling_ratio/staleness_{batch.staleness}"
            self.log_metric(name, self.masked_global_mean(ratio, mask))


def importance_sampling_ratio(
    old_logps, sampling_logps, mask, mode: str, clip_min: float | None = None, clip_max: float | None = 3.0
) -> torch.Tensor:
    """The ratio w of the module docstring: `(B, 1)` for the sequence modes, `(B, C)` for the token modes."""
    if mode not in IS_MODES:
        raise ValueError(f"Unknown vLLM importance sampling mode {mode!r}: expected one of {list(IS_MODES)}.")
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def mismatch_metrics(
    old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor, mode: str
) -> dict[str, torch.Tensor]:
    """This process's `sampling/sampling_logp_difference/{mean,max}` (|log pi_old - log pi_vllm| over the masked
    tokens vLLM scored) and `sampling/importance_sampling_ratio/{min,mean,max}` (over rows for the sequence modes,
    masked tokens for the token modes); 0 when there is nothing to measure, as TRL."""
    mask = mask.bool()
    delta = torch.abs(old_logps - sampling_logps)
    delta = delta[mask & ~torch.isnan(delta)]
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[mask]
    stat = lambda values, fn: fn(values) if values.numel() else old_logps.new_zeros(())
    return {
        "sampling/sampling_logp_difference/mean": stat(delta, torch.mean),
        "sampling/sampling_logp_difference/max": stat(delta, torch.max),
        "sampling/importance_sampling_ratio/min": stat(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": stat(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": stat(flat, torch.max),
    }
