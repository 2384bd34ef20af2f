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
    then, when beta > 0:  l += beta * KL,  KL = exp(ref - logp) - (ref - logp) - 1   (k3 estimator, Schulman 2020),
        multiplied by w when use_bias_correction_kl (DeepSeek-V3.2, arXiv:2512.02556)

Tokens outside the top `top_entropy_quantile` of entropies (Beyond the 80/20 Rule, arXiv:2506.01939) and sequences
with A < 0 whose mean KL(pi_old || pi_theta) exceeds `off_policy_mask_threshold` (DeepSeek-V3.2) drop out of l.
With M_i completion tokens, B rows in the micro-batch, GA accumulation steps and N loss tokens in the whole
generation batch (all processes), the loss of one micro-batch is

    grpo, sapo:  1/B sum_i (1/M_i sum_t l_it) / GA          bnpo (arXiv:2506.02864):  sum_it l / sum_i M_i / GA
    dr_grpo:     sum_it l / (B * max_completion_length) / GA     luspo (arXiv:2602.05261):  1/B sum_it l / GA
    dapo (arXiv:2503.14476), cispo, vespo:  sum_it l / (N / processes * GA / steps_per_generation)

minus `entropy_coef` times the mean token entropy / GA (adaptive as in Skywork-OR1, arXiv:2505.22312).
"""

import logging
import math
from dataclasses import dataclass

import torch
from accelerate.utils import gather

from ..core.config import document_fields, option
from ..online.config import OnlineConfig
from ..online.importance_sampling import IMPORTANCE_SAMPLING_FIELDS, ImportanceSamplingConfig
from ..online.metrics import high_entropy_mask, off_policy_mask
from ..online.rewards import nanstd
from ..online.rollout import RolloutBatch
from ..online.trainer import OnlineTrainer


logger = logging.getLogger(__name__)
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


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
        if (
            self.loss_type == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
        ):  # fmt: skip
            raise ValueError(
                "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. "
                f"Got: {self.vllm_importance_sampling_mode}."
            )
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1].")


class GRPOTrainer(OnlineTrainer):
    """GRPO and its loss variants (see the module docstring). Same constructor as `trl.GRPOTrainer`."""

    _name = "GRPO"
    config_class = GRPOConfig
    loss_is_scaled_for_ga = True  # every loss type divides by the accumulation itself, as TRL does

    def setup(self) -> None:
        super().setup()
        a = self.args
        if a.loss_type == "luspo" and a.importance_sampling_level != "sequence":
            logger.warning("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'`.")
        if a.importance_sampling_level == "sequence" and a.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            logger.warning(
                f"When using `importance_sampling_level='sequence'`, the `'{a.loss_type}'` loss sums per-token "
                "contributions, which effectively weights each sequence by its completion length instead of "
                "optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'`."
            )
        # Whether the entropy bonus is on (TRL's attribute): entropies then keep their gradient.
        self._entropy_bonus_enabled = a.entropy_coef != 0.0 or a.use_adaptive_entropy
        self.entropy_coef, self._last_world_entropy, self._entropy_window = a.entropy_coef, math.inf, None

    def compute_advantages(self, rewards, rewards_per_func, batch: RolloutBatch, mode: str) -> torch.Tensor:
        g = self.num_generations if mode == "train" else self.num_generations_eval
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            grouped = rewards_per_func.view(-1, g, rewards_per_func.size(1))  # (P, G, F)
            std = nanstd(grouped, dim=1).unsqueeze(1) if g > 1 else torch.zeros_like(grouped[:, :1])
            normalised = ((grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (std + 1e-4)).view_as(
                rewards_per_func
            )
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
            advantages = rewards - mean
            if self.args.scale_rewards != "none":
                advantages = advantages / (std + 1e-4)
        self.log_metric("frac_reward_zero_std", torch.isclose(std, torch.zeros_like(std)).float().mean().item())
        return torch.nan_to_num(advantages, nan=0.0)

    def compute_policy_loss(self, model, inputs: RolloutBatch, num_items_in_batch=None):
        a, mode, mask = self.args, "train" if self.model.training else "eval", inputs.loss_mask
        out = self.policy_logprobs(model, inputs)
        logps, entropies = out.logps, out.entropy
        entropy_mask = None
        if a.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - a.top_entropy_quantile)
        advantages = inputs.advantages.unsqueeze(1)  # (B, 1)
        old = inputs.old_logps if inputs.old_logps is not None else logps.detach()
        log_ratio = logps - old
        if a.importance_sampling_level == "sequence":
            log_ratio_used = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
        else:
            log_ratio_used = log_ratio  # (B, C)
        ratio = torch.exp(log_ratio_used)
        low, high = a.clip_range()
        if a.loss_type == "cispo":
            per_token_loss = -torch.clamp(ratio, max=high - 1).detach() * advantages * logps
        elif a.loss_type == "sapo":
            tau = torch.where(advantages > 0, a.sapo_temperature_pos, a.sapo_temperature_neg)
            per_token_loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
        elif a.loss_type == "vespo":
            phi = _vespo_weights(advantages, log_ratio, mask, a, inputs.importance_sampling_ratio)
            per_token_loss = -phi * advantages * logps
        else:
            clipped = torch.clamp(ratio, low, high)
            ratio = torch.clamp(ratio, max=a.delta) if a.delta is not None else ratio  # two-sided: cap w itself
            per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
        if a.off_policy_mask_threshold is not None:  # with vLLM, against its sampling log-probs (TRL)
            behaviour = inputs.sampling_logps if inputs.sampling_logps is not None else old
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages, logps, behaviour, mask, a.off_policy_mask_threshold
            )
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if inputs.importance_sampling_ratio is not None and a.loss_type != "vespo":  # vLLM's correction
            per_token_loss = per_token_loss * inputs.importance_sampling_ratio
        if a.beta != 0.0:
            diff = inputs.ref_logps - logps
            per_token_kl = torch.exp(diff) - diff - 1  # k3 estimator of KL(π_θ ‖ π_ref)
            if a.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(log_ratio_used)  # the uncapped ratio
            per_token_loss = per_token_loss + a.beta * per_token_kl
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = self._normalise(per_token_loss * mask, mask, inputs, accumulation, mode)
        if a.entropy_coef != 0.0 or a.use_adaptive_entropy:
            loss = self._entropy_bonus(
                loss, entropies, mask if entropy_mask is None else mask * entropy_mask, accumulation, mode
            )
        loss = self.add_aux_loss(loss, out.aux_loss, scale=1.0 / accumulation)
        kl = per_token_kl if a.beta != 0.0 else None
        self._log_loss_metrics(
            ratio, advantages, entropies, mask, kl, low, high, phi if a.loss_type == "vespo" else None
        )
        return loss

    def _normalise(self, masked_loss, mask, inputs, accumulation, mode):
        """The loss-type normalisation of the module docstring, scaled for gradient accumulation."""
        loss_type = self.args.loss_type
        if loss_type in ("grpo", "sapo"):
            return (masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        if loss_type == "bnpo":
            return masked_loss.sum() / mask.sum().clamp(min=1.0) / accumulation
        if loss_type == "dr_grpo":
            return masked_loss.sum() / (masked_loss.size(0) * self.args.max_completion_length) / accumulation
        if loss_type == "luspo":
            return masked_loss.sum(-1).mean() / accumulation
        normaliser = max(inputs.num_loss_tokens, 1.0) / self.accelerator.num_processes  # dapo, cispo, vespo
        if mode == "train":  # N spans the generation batch: rescale it to one accumulation window
            normaliser = normaliser * accumulation / self.args.steps_per_generation
        return masked_loss.sum() / normaliser

    def _entropy_bonus(self, loss, entropies, mask, accumulation, mode):
        """loss - coef * mean token entropy / GA; the adaptive coef moves by entropy_coef_delta per optimiser step."""
        a = self.args
        self.log_metric("policy_loss", gather(loss.detach()).nanmean().item())
        coef = self.entropy_coef
        if a.use_adaptive_entropy and self._last_world_entropy > a.entropy_target:
            coef = 0.0
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

    def _log_loss_metrics(self, ratio, advantages, entropies, mask, per_token_kl, low, high, phi):
        if per_token_kl is not None:
            self.log_metric("kl", self.masked_global_mean(per_token_kl, mask))
        self.log_metric("entropy", self.masked_global_mean(entropies, mask))
        if self.args.loss_type == "cispo":
            clipped = ((ratio > high - 1) & (advantages > 0)).float()
            self.log_metric("cispo_clip_ratio", self.masked_global_mean(clipped, mask))
        elif self.args.loss_type == "vespo":
            self.log_metric("vespo/phi_seq_mean", self.masked_global_mean(phi, mask))
        elif self.args.loss_type != "sapo":
            self.log_clip_ratios(ratio, advantages, mask, low, high)

    # ------------------------------------------------------------------ TRL's loss helpers (public on its trainer)
    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's helper (see `online/metrics.py`, `high_entropy_mask`)."""
        return high_entropy_mask(self.accelerator, entropies, mask, threshold)

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
