r"""Policy-gradient losses on the online core: one table, `LOSSES`, of per-token losses and their normalisers, as
`trl.GRPOTrainer` 1.16 computes each `loss_type` (GRPO and GMPO read it by `loss_type`; SDPO's policy term reuses its
clipped surrogate and normalisers). The ratio and the other inputs of a micro-batch are built once, by
`policy_loss_terms`.

Per token t of completion i, with the importance ratio w = pi_theta / pi_old per token, or per sequence
exp(mean_t log(pi_theta / pi_old)) with importance_sampling_level="sequence" (GSPO, arXiv:2507.18071):

    grpo, bnpo, dr_grpo, dapo, luspo:  l = -min(w A, clip(w, 1 - eps, 1 + eps_high) A),  w capped at `delta` when
        set (two-sided clipping, INTELLECT-2, arXiv:2505.07291)
    cispo (MiniMax-M1, arXiv:2506.13585):  l = -sg(min(w, eps_high)) A log pi_theta
    sapo (arXiv:2511.20347):  l = -(4 / tau) sigmoid(tau (w - 1)) A,  tau = sapo_temperature_pos if A > 0 else _neg
    vespo (arXiv:2602.10693):  l = -sg(phi(W)) A log pi_theta,  phi(W) = e^lambda W^k e^(-lambda W),
        W = clamp(exp(sum_t log w)), (k, lambda) by the sign of A
    gmpo (arXiv:2507.20673), per sequence:  l = -exp(1/|o| sum_t c_t) A,  the geometric mean of the token ratios,
        c_t = min(log w_t, clip(log w_t, -eps, eps_high)) if A > 0 else max(...) (clipping in log space, over the
        tokens top_entropy_quantile keeps; `GMPOTrainer`, or loss_type="gmpo")
    then, when beta > 0:  l += beta * KL,  KL = exp(ref - logp) - (ref - logp) - 1   (k3 estimator, Schulman 2020),
        multiplied by w when use_bias_correction_kl (DeepSeek-V3.2, arXiv:2512.02556)

Tokens outside the top `top_entropy_quantile` of entropies (Beyond the 80/20 Rule, arXiv:2506.01939) and sequences
with A < 0 whose mean KL(pi_old || pi_theta) exceeds `off_policy_mask_threshold` (DeepSeek-V3.2) drop out of l.
With M_i completion tokens, B rows in the micro-batch, GA accumulation steps and N loss tokens in the whole
generation batch (all processes), the loss of one micro-batch is

    grpo, sapo, gmpo:  1/B sum_i (1/M_i sum_t l_it) / GA      bnpo (arXiv:2506.02864):  sum_it l / sum_i M_i / GA
    dr_grpo:     sum_it l / (B * max_completion_length) / GA     luspo (arXiv:2602.05261):  1/B sum_it l / GA
    dapo (arXiv:2503.14476), cispo, vespo:  sum_it l / (N / processes * GA / steps_per_generation)

minus `entropy_coef` times the mean token entropy / GA (adaptive as in Skywork-OR1, arXiv:2505.22312). The table
holds l and the normaliser; the KL term, the token masks and the entropy bonus are GRPO's (`trainers/grpo.py`).
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..core.config import option
from .rollout import RolloutBatch


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossTerms:
    """What every loss type reads, for one micro-batch of B rows and C completion positions: `logps` log π_θ and
    `old_logps` log π_old `(B, C)`, `log_ratio` log(π_θ / π_old) per token `(B, C)`, `ratio` w per token `(B, C)` or
    per sequence `(B, 1)`, `advantages` `(B, 1)`, `mask` `(B, C)`, the clipping bounds, the config, the batch, and
    `keep` `(B, C)`: the tokens `top_entropy_quantile` keeps (None: all), `cap`: the ratio's upper cap (GRPO's
    `delta`; None: none)."""

    logps: torch.Tensor
    old_logps: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    low: float
    high: float
    args: Any
    inputs: RolloutBatch
    keep: torch.Tensor | None = None
    cap: float | None = None


@dataclass(frozen=True)
class LossType:
    """One entry of `LOSSES`. `token_loss(terms) -> (l, stat)`: the per-token loss l `(B, C)` (or `(B, 1)`) and what
    `log` reads; `normalise(trainer, masked l, terms, accumulation, mode)`: the micro-batch's loss; `log(trainer,
    stat, terms)`: the type's metrics; `check(config)`: its config rules, run by `GRPOConfig`;
    `folds_sampling_correction`: vLLM's importance-sampling ratio enters `token_loss` itself (else it multiplies l);
    `reads_kept_tokens`: `token_loss` applies `terms.keep` itself (GMPO's geometric mean; else it multiplies l)."""

    token_loss: Callable[[LossTerms], tuple[torch.Tensor, torch.Tensor | None]]
    normalise: Callable
    log: Callable = lambda trainer, stat, terms: None
    check: Callable = lambda config: None
    folds_sampling_correction: bool = False
    reads_kept_tokens: bool = False


def policy_loss_terms(logps, old_logps, mask, advantages, level: str, low: float, high: float, args, inputs,
                      keep=None, cap=None) -> LossTerms:  # fmt: skip
    """The terms of `LossTerms` for a micro-batch: the ratio w = π_θ / π_old per token, or per sequence
    exp(mean_t log w_t) with `level="sequence"` (GSPO, arXiv:2507.18071); π_old = π_θ detached when `old_logps` is
    None (one update per rollout: w = 1, gradients unchanged); `advantages` `(B,)` or `(B, 1)`."""
    old_logps = old_logps if old_logps is not None else logps.detach()
    log_ratio = logps - old_logps  # (B, C)
    log_weight = log_ratio  # log w per token
    if level == "sequence":  # mean over the sequence's tokens, (B, 1)
        log_weight = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    return LossTerms(logps, old_logps, log_ratio, torch.exp(log_weight), advantages, mask, low, high, args, inputs,
                     keep, cap)  # fmt: skip


def clipped_surrogate(t: LossTerms):
    """-min(w A, clip(w, 1 - eps, 1 + eps_high) A), w capped at `delta` when set (two-sided clipping)."""
    clipped = torch.clamp(t.ratio, t.low, t.high)
    ratio = torch.clamp(t.ratio, max=t.cap) if t.cap is not None else t.ratio
    return -torch.min(ratio * t.advantages, clipped * t.advantages), ratio


def _cispo(t: LossTerms):
    """-sg(min(w, eps_high)) A log π_θ."""
    return -torch.clamp(t.ratio, max=t.high - 1).detach() * t.advantages * t.logps, t.ratio


def _sapo(t: LossTerms):
    """-(4 / tau) sigmoid(tau (w - 1)) A, tau by the sign of A."""
    tau = torch.where(t.advantages > 0, t.args.sapo_temperature_pos, t.args.sapo_temperature_neg)
    return -torch.sigmoid(tau * (t.ratio - 1)) * 4 / tau * t.advantages, None


def _vespo(t: LossTerms):
    """-sg(phi(W)) A log π_θ (`_vespo_weights`)."""
    phi = _vespo_weights(t.advantages, t.log_ratio, t.mask, t.args, t.inputs.importance_sampling_ratio)
    return -phi * t.advantages * t.logps, phi


def _gmpo(t: LossTerms):
    """-exp(mean_t clip(log w_t)) A per sequence `(B, 1)`: the geometric mean of the token ratios, each log-ratio
    clipped to [-eps, eps_high] on the side that would raise the objective (PPO's min, in log space), the mean over
    the tokens `keep` keeps."""
    high = t.args.epsilon_high if t.args.epsilon_high is not None else t.args.epsilon
    clamped = torch.clamp(t.log_ratio, -t.args.epsilon, high)
    clipped = torch.where(t.advantages > 0, torch.minimum(t.log_ratio, clamped), torch.maximum(t.log_ratio, clamped))
    kept = t.mask if t.keep is None else t.mask * t.keep
    log_weight = (clipped * kept).sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    return -torch.exp(log_weight) * t.advantages, torch.exp(t.log_ratio)


def per_sequence(trainer, masked, t, accumulation, mode):  # 1/B sum_i (1/M_i sum_t l_it) / GA
    return (masked.sum(-1) / t.mask.sum(-1).clamp(min=1.0)).mean() / accumulation


def per_micro_batch_token(trainer, masked, t, accumulation, mode):  # sum_it l / sum_i M_i / GA
    return masked.sum() / t.mask.sum().clamp(min=1.0) / accumulation


def per_max_length(trainer, masked, t, accumulation, mode):  # sum_it l / (B * max_completion_length) / GA
    return masked.sum() / (masked.size(0) * t.args.max_completion_length) / accumulation


def sequence_sums(trainer, masked, t, accumulation, mode):  # 1/B sum_it l / GA
    return masked.sum(-1).mean() / accumulation


def per_generation_token(trainer, masked, t, accumulation, mode):  # sum_it l / (N / processes * GA / S)
    normaliser = max(t.inputs.num_loss_tokens, 1.0) / trainer.accelerator.num_processes
    if mode == "train":  # N spans the generation batch: rescale it to one accumulation window
        normaliser = normaliser * accumulation / t.args.steps_per_generation
    return masked.sum() / normaliser


def _log_clip_ratios(trainer, ratio, t):
    trainer.log_clip_ratios(ratio, t.advantages, t.mask, t.low, t.high)


def _log_gmpo(trainer, ratio, t):  # the token ratios against the log-space bounds
    high = t.args.epsilon_high if t.args.epsilon_high is not None else t.args.epsilon
    trainer.log_clip_ratios(ratio, t.advantages, t.mask, math.exp(-t.args.epsilon), math.exp(high))


def _log_cispo(trainer, ratio, t):
    clipped = ((ratio > t.high - 1) & (t.advantages > 0)).float()
    trainer.log_metric("cispo_clip_ratio", trainer.masked_global_mean(clipped, t.mask))


def _log_vespo(trainer, phi, t):
    trainer.log_metric("vespo/phi_seq_mean", trainer.masked_global_mean(phi, t.mask))


def _warn_token_sum_at_sequence_level(config):
    if config.importance_sampling_level == "sequence":
        logger.warning(
            f"When using `importance_sampling_level='sequence'`, the `'{config.loss_type}'` loss sums per-token "
            "contributions, which effectively weights each sequence by its completion length instead of "
            "optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'`."
        )


def _check_luspo(config):
    if config.importance_sampling_level != "sequence":
        logger.warning("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'`.")


def _check_vespo(config):
    token_level = config.vllm_importance_sampling_mode in ("token_truncate", "token_mask")
    if config.use_vllm and config.vllm_importance_sampling_correction and not token_level:
        raise ValueError(
            "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. "
            f"Got: {config.vllm_importance_sampling_mode}."
        )


# The loss types of the module docstring, one entry each: per-token loss, normaliser, metrics, config rules.
LOSSES = {
    "grpo": LossType(clipped_surrogate, per_sequence, _log_clip_ratios),
    "dr_grpo": LossType(clipped_surrogate, per_max_length, _log_clip_ratios, _warn_token_sum_at_sequence_level),
    "dapo": LossType(clipped_surrogate, per_generation_token, _log_clip_ratios, _warn_token_sum_at_sequence_level),
    "bnpo": LossType(clipped_surrogate, per_micro_batch_token, _log_clip_ratios, _warn_token_sum_at_sequence_level),
    "cispo": LossType(_cispo, per_generation_token, _log_cispo, _warn_token_sum_at_sequence_level),
    "sapo": LossType(_sapo, per_sequence),
    "luspo": LossType(clipped_surrogate, sequence_sums, _log_clip_ratios, _check_luspo),
    "vespo": LossType(_vespo, per_generation_token, _log_vespo, _check_vespo, folds_sampling_correction=True),
    "gmpo": LossType(_gmpo, per_sequence, _log_gmpo, reads_kept_tokens=True),
}
LOSS_TYPES = tuple(LOSSES)


@dataclass
class PolicyLossConfig:
    """The policy-loss fields GRPO and SDPO share, with TRL 1.16's names and defaults: mixed into a trainer's config
    before its `OnlineConfig` base; `check_policy_loss` validates them, `loss_type` against the config's
    `_loss_types` (GRPO: every entry of `LOSSES`; SDPO: its four normalisers)."""

    _loss_types: ClassVar[tuple[str, ...]] = LOSS_TYPES

    loss_type: str = option("dapo", "The policy loss, an entry of the loss table (online/policy_losses.py).")
    importance_sampling_level: str = option("token", "The ratio per 'token' or per 'sequence' (GSPO).")
    scale_rewards: str = option(
        "group", "Divide advantages by the 'group', 'batch' or 'none' std (True: 'group', False: 'none')."
    )

    def check_policy_loss(self) -> None:
        """`scale_rewards` True / False read as TRL does; a value outside its choices raises, naming them."""
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        for name, allowed in (
            ("loss_type", self._loss_types),
            ("scale_rewards", ("group", "batch", "none")),
            ("importance_sampling_level", ("token", "sequence")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}.")


@torch.no_grad()
def _vespo_weights(advantages, log_ratio, mask, a, is_ratio=None) -> torch.Tensor:
    """phi(W) = e^lambda W^k e^(-lambda W) in log space, W = clamp(exp(sum_t clamp(log w_t))); `(B, 1)`, detached.
    With vLLM's importance-sampling ratio r (online/importance_sampling.py), log W gains sum_t clamp(log r_t), as
    TRL: log(pi_theta / pi_vllm) = log(pi_theta / pi_old) + log(pi_old / pi_vllm)."""
    floor = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(is_ratio), floor, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, floor, 20.0).detach()
    positive = advantages >= 0
    k = torch.where(positive, a.vespo_k_pos, a.vespo_k_neg)
    lam = torch.where(positive, a.vespo_lambda_pos, a.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
