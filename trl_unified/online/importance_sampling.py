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

import torch


IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")


def importance_sampling_ratio(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """The ratio w of the module docstring: `(B, 1)` for the sequence modes, `(B, C)` for the token modes."""
    if mode not in IS_MODES:
        raise ValueError(f"Unknown vLLM importance sampling mode {mode!r}: expected one of {list(IS_MODES)}.")
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
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
    zero = old_logps.new_zeros(())

    def stat(values, fn):
        return fn(values) if values.numel() else zero

    return {
        "sampling/sampling_logp_difference/mean": stat(delta, torch.mean),
        "sampling/sampling_logp_difference/max": stat(delta, torch.max),
        "sampling/importance_sampling_ratio/min": stat(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": stat(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": stat(flat, torch.max),
    }
