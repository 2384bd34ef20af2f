r"""Group Relative Policy Optimization (GRPO), Shao et al., 2024 (DeepSeekMath, arXiv:2402.03300), with the loss
variants of `trl.GRPOTrainer` 1.16: a drop-in for it on the shared online core.

Advantages, per prompt group of G completions (r: rewards weighted and summed over functions, NaN = unscorable):

    sum_then_normalize:  A_i = (r_i - mean_group r) / (s + 1e-4)
        s = std over the group (scale_rewards="group"), over the generation batch ("batch", PPO Lite,
        arXiv:2508.08221), or no division at all ("none", Dr. GRPO, arXiv:2503.20783)
    normalize_then_sum (GDPO, arXiv:2601.05242): each function's rewards are normalised within the group first,
        r'_i = sum_k w_k (r_ik - mean_group r_k) / (std_group r_k + 1e-4),
        then A_i = (r'_i - mean r') / (std r' + 1e-4)
        over the generation batch.

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

minus `entropy_coef` times the mean token entropy / GA (adaptive as in Skywork-OR1, arXiv:2505.22312).
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate.utils import gather

from ..core.config import document_fields, option
from ..online.config import OnlineConfig
from ..online.importance_sampling import IMPORTANCE_SAMPLING_FIELDS, ImportanceSamplingConfig, ImportanceSamplingMixin
from ..online.metrics import off_policy_mask
from ..online.rewards import nanstd
from ..online.rollout import RolloutBatch
from ..online.trainer import OnlineTrainer


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossTerms:
    """What every loss type reads, for one micro-batch of B rows and C completion positions: `logps` log π_θ and
    `old_logps` log π_old `(B, C)`, `log_ratio` log(π_θ / π_old) per token `(B, C)`, `ratio` w per token `(B, C)` or
    per sequence `(B, 1)`, `advantages` `(B, 1)`, `mask` `(B, C)`, the clipping bounds, the config, the batch, and
    `keep` `(B, C)`: the tokens `top_entropy_quantile` keeps (None: all)."""

    logps: torch.Tensor
    old_logps: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    low: float
    high: float
    args: "GRPOConfig"
    inputs: RolloutBatch
    keep: torch.Tensor | None = None


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


def _clipped(t: LossTerms):
    """-min(w A, clip(w, 1 - eps, 1 + eps_high) A), w capped at `delta` when set (two-sided clipping)."""
    clipped = torch.clamp(t.ratio, t.low, t.high)
    ratio = torch.clamp(t.ratio, max=t.args.delta) if t.args.delta is not None else t.ratio
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


def _per_sequence(trainer, masked, t, accumulation, mode):  # 1/B sum_i (1/M_i sum_t l_it) / GA
    return (masked.sum(-1) / t.mask.sum(-1).clamp(min=1.0)).mean() / accumulation


def _per_micro_batch_token(trainer, masked, t, accumulation, mode):  # sum_it l / sum_i M_i / GA
    return masked.sum() / t.mask.sum().clamp(min=1.0) / accumulation


def _per_max_length(trainer, masked, t, accumulation, mode):  # sum_it l / (B * max_completion_length) / GA
    return masked.sum() / (masked.size(0) * t.args.max_completion_length) / accumulation


def _sequence_sums(trainer, masked, t, accumulation, mode):  # 1/B sum_it l / GA
    return masked.sum(-1).mean() / accumulation


def _per_generation_token(trainer, masked, t, accumulation, mode):  # sum_it l / (N / processes * GA / S)
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
    "grpo": LossType(_clipped, _per_sequence, _log_clip_ratios),
    "dr_grpo": LossType(_clipped, _per_max_length, _log_clip_ratios, _warn_token_sum_at_sequence_level),
    "dapo": LossType(_clipped, _per_generation_token, _log_clip_ratios, _warn_token_sum_at_sequence_level),
    "bnpo": LossType(_clipped, _per_micro_batch_token, _log_clip_ratios, _warn_token_sum_at_sequence_level),
    "cispo": LossType(_cispo, _per_generation_token, _log_cispo, _warn_token_sum_at_sequence_level),
    "sapo": LossType(_sapo, _per_sequence),
    "luspo": LossType(_clipped, _sequence_sums, _log_clip_ratios, _check_luspo),
    "vespo": LossType(_vespo, _per_generation_token, _log_vespo, _check_vespo, folds_sampling_correction=True),
    "gmpo": LossType(_gmpo, _per_sequence, _log_gmpo, reads_kept_tokens=True),
}
LOSS_TYPES = tuple(LOSSES)


@document_fields
@dataclass
class GRPOConfig(ImportanceSamplingConfig, OnlineConfig):
    """Configuration of `GRPOTrainer`: every field of `trl.GRPOConfig` 1.16, same names and defaults."""

    _unimplemented_fields = {
        **OnlineConfig._unimplemented_fields,
        "log_completions_hub_repo": "Completion logs go to the console and W&B (`log_completions`).",
    }

    num_generations: int | None = option(8, "Completions sampled per prompt (G >= 2).")
    beta: float = option(0.0, "KL coefficient β. If 0.0, no reference model is loaded.")
    delta: float | None = option(None, "Upper cap of the ratio (two-sided clipping). None: off.")
    sapo_temperature_neg: float = option(1.05, "SAPO gate temperature for A <= 0.")
    sapo_temperature_pos: float = option(1.0, "SAPO gate temperature for A > 0.")
    vespo_k_pos: float = option(2.0, "VESPO power exponent k for A >= 0.")
    vespo_lambda_pos: float = option(3.0, "VESPO decay λ for A >= 0.")
    vespo_k_neg: float = option(3.0, "VESPO power exponent k for A < 0.")
    vespo_lambda_neg: float = option(2.0, "VESPO decay λ for A < 0.")
    importance_sampling_level: str = option("token", "Ratio per 'token' or per 'sequence' (GSPO).")
    multi_objective_aggregation: str = option("sum_then_normalize", "'sum_then_normalize' or 'normalize_then_sum'.")
    scale_rewards: str = option("group", "Divide advantages by the 'group', 'batch' or 'none' std.")
    loss_type: str = option("dapo", f"One of {', '.join(LOSS_TYPES)} (see the module docstring).")
    top_entropy_quantile: float = option(1.0, "Keep the top-ρ quantile of tokens by entropy.")
    entropy_coef: float = option(0.0, "Weight of the mean-token-entropy bonus. 0.0: off.")
    use_adaptive_entropy: bool = option(False, "Adapt entropy_coef each step (Skywork-OR1).")
    entropy_coef_min: float = option(0.0, "Lower bound of the adaptive entropy_coef.")
    entropy_coef_max: float = option(1.0, "Upper bound of the adaptive entropy_coef.")
    entropy_coef_delta: float = option(0.005, "Step of the adaptive entropy_coef.")
    entropy_target: float = option(0.2, "Entropy (nats) at or below which the bonus applies.")
    off_policy_mask_threshold: float | None = option(None, "Drop sequences with A < 0 and mean KL above this.")
    use_bias_correction_kl: bool = option(True, "Multiply the KL term by the ratio w.")
    log_completions_hub_repo: str | None = option(None, "Hub repo for completions (not implemented).")
    _vllm_only_fields = (*OnlineConfig._vllm_only_fields, *IMPORTANCE_SAMPLING_FIELDS)

    def __post_init__(self):
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        super().__post_init__()
        self.check_importance_sampling()
        for name, allowed in (
            ("loss_type", LOSS_TYPES),
            ("scale_rewards", ("group", "batch", "none")),
            ("importance_sampling_level", ("token", "sequence")),
            ("multi_objective_aggregation", ("sum_then_normalize", "normalize_then_sum")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}.")
        LOSSES[self.loss_type].check(self)
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1].")


class GRPOTrainer(ImportanceSamplingMixin, OnlineTrainer):
    """GRPO and its loss variants (see the module docstring). Same constructor as `trl.GRPOTrainer`."""

    _name = "GRPO"
    config_class = GRPOConfig
    loss_is_scaled_for_ga = True  # every loss type divides by the accumulation itself, as TRL does

    def setup(self) -> None:
        super().setup()
        a = self.args
        self._entropy_bonus_enabled = a.entropy_coef != 0.0 or a.use_adaptive_entropy
        self.entropy_coef, self._last_world_entropy, self._entropy_window = a.entropy_coef, math.inf, None

    def compute_advantages(self, rewards, rewards_per_func, batch: RolloutBatch, mode: str) -> torch.Tensor:
        g = self.group_size(mode)
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            grouped = rewards_per_func.view(-1, g, rewards_per_func.size(1))  # (P, G, F)
            std = nanstd(grouped, dim=1).unsqueeze(1) if g > 1 else torch.zeros_like(grouped[:, :1])
            normalised = ((grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (std + 1e-4)).flatten(0, 1)
            summed = (normalised * self.rewards.weights.to(rewards.device)).nansum(dim=1)
            rewards = summed.masked_fill(torch.isnan(rewards), math.nan)
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
            advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
        else:
            mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
            if self.args.scale_rewards == "batch":
                std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
            else:  # "none" keeps the group std for the zero-std metric only
                std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g) if g > 1 else torch.zeros_like(rewards)
            advantages = (rewards - mean) / (std + 1e-4) if self.args.scale_rewards != "none" else rewards - mean
        self.log_zero_std_fraction(std)
        return torch.nan_to_num(advantages, nan=0.0)

    @property
    def loss_entry(self) -> LossType:
        """The entry of `LOSSES` this trainer's loss is (`loss_type`; `GMPOTrainer`: "gmpo")."""
        return LOSSES[self.args.loss_type]

    def _loss_terms(self, logps: torch.Tensor, inputs: RolloutBatch, keep: torch.Tensor | None) -> LossTerms:
        """The ratio w = π_θ / π_old per token, or per sequence exp(mean_t log w_t) (GSPO), and the other terms every
        loss type reads."""
        a, mask = self.args, inputs.loss_mask
        old_logps = inputs.old_logps if inputs.old_logps is not None else logps.detach()
        log_ratio = logps - old_logps  # (B, C)
        log_weight = log_ratio  # log w per token
        if a.importance_sampling_level == "sequence":  # mean over the sequence's tokens, (B, 1)
            log_weight = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        low, high = a.clip_range()
        return LossTerms(
            logps=logps,
            old_logps=old_logps,
            log_ratio=log_ratio,
            ratio=torch.exp(log_weight),
            advantages=inputs.advantages.unsqueeze(1),  # (B, 1)
            mask=mask,
            low=low,
            high=high,
            args=a,
            inputs=inputs,
            keep=keep,
        )

    def compute_policy_loss(self, model, inputs: RolloutBatch, num_items_in_batch=None):
        a, mode, mask, loss_type = self.args, self.mode, inputs.loss_mask, self.loss_entry
        out = self.policy_logprobs(model, inputs)
        keep = None  # the tokens the entropy quantile keeps (Beyond the 80/20 Rule)
        if a.top_entropy_quantile < 1.0:
            keep = self.get_high_entropy_mask(out.entropy, mask, 1 - a.top_entropy_quantile)
        t = self._loss_terms(out.logps, inputs, keep)
        per_token_loss, stat = loss_type.token_loss(t)
        if a.off_policy_mask_threshold is not None:  # with vLLM, against its sampling log-probs (TRL)
            behaviour_logps = inputs.sampling_logps if inputs.sampling_logps is not None else t.old_logps
            threshold = a.off_policy_mask_threshold
            off_policy = self.get_off_policy_mask(t.advantages, out.logps, behaviour_logps, mask, threshold)
            per_token_loss = per_token_loss * off_policy
        entropy_mask = mask if keep is None else mask * keep  # the tokens the entropy bonus averages over
        if keep is not None and not loss_type.reads_kept_tokens:
            per_token_loss = per_token_loss * keep
        if inputs.importance_sampling_ratio is not None and not loss_type.folds_sampling_correction:
            per_token_loss = per_token_loss * inputs.importance_sampling_ratio  # vLLM's correction
        if a.beta != 0.0:
            diff = inputs.ref_logps - out.logps
            per_token_kl = torch.exp(diff) - diff - 1  # k3 estimator of KL(π_θ ‖ π_ref)
            per_token_kl = per_token_kl * t.ratio if a.use_bias_correction_kl else per_token_kl  # the uncapped w
            per_token_loss = per_token_loss + a.beta * per_token_kl
            self.log_metric("kl", self.masked_global_mean(per_token_kl, mask))
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss_type.normalise(self, per_token_loss * mask, t, accumulation, mode)
        if self._entropy_bonus_enabled:
            loss = self._entropy_bonus(loss, out.entropy, entropy_mask, accumulation, mode)
        loss = self.add_aux_loss(loss, out.aux_loss, scale=1.0 / accumulation)
        self.log_metric("entropy", self.masked_global_mean(out.entropy, mask))
        loss_type.log(self, stat, t)
        return loss

    def _entropy_bonus(self, loss, entropies, mask, accumulation, mode):
        """loss - coef * mean token entropy / GA; the adaptive coef moves by entropy_coef_delta per optimiser step."""
        a = self.args
        self.log_metric("policy_loss", gather(loss.detach()).nanmean().item())
        coef = 0.0 if a.use_adaptive_entropy and self._last_world_entropy > a.entropy_target else self.entropy_coef
        loss = loss - coef * (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        if a.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
            self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(self._entropy_window, reduction="sum")
                self._last_world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
                step = a.entropy_coef_delta if self._last_world_entropy <= a.entropy_target else -a.entropy_coef_delta
                self.entropy_coef = min(max(self.entropy_coef + step, a.entropy_coef_min), a.entropy_coef_max)
                self._entropy_window = None
        if mode == "train" and self.accelerator.sync_gradients:
            self.log_metric("entropy_coef", self.entropy_coef)
        return loss

    # ------------------------------------------------------------------ TRL's loss helpers (public on its trainer)
    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """Tokens whose entropy is at least the `threshold` quantile (`1 - top_entropy_quantile`) of all processes'
        unmasked token entropies (Beyond the 80/20 Rule, arXiv:2506.01939). `(B, C)` bool."""
        local = entropies[mask.bool()].float()
        values = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=-1e9))
        values = values[values != -1e9]  # entropies are >= 0
        if values.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        return ((entropies * mask.float()) >= torch.quantile(values, threshold)) & mask.bool()

    get_off_policy_mask = staticmethod(off_policy_mask)  # TRL's helper (see `online/metrics.py`)


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
