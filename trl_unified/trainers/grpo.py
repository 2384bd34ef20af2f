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

The loss of a micro-batch: `loss_type`'s entry of the online core's loss table (`online/policy_losses.py`, whose
docstring states each per-token loss l and its normaliser: grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo, gmpo),
with the importance ratio w = pi_theta / pi_old per token, or per sequence with importance_sampling_level="sequence"
(GSPO, arXiv:2507.18071). GRPO adds to l, per token:

    beta > 0:  l += beta * KL,  KL = exp(ref - logp) - (ref - logp) - 1   (k3 estimator, Schulman 2020),
        multiplied by w when use_bias_correction_kl (DeepSeek-V3.2, arXiv:2512.02556)

Tokens outside the top `top_entropy_quantile` of entropies (Beyond the 80/20 Rule, arXiv:2506.01939) and sequences
with A < 0 whose mean KL(pi_old || pi_theta) exceeds `off_policy_mask_threshold` (DeepSeek-V3.2) drop out of l;
`entropy_coef` times the mean token entropy / GA is subtracted from the loss (adaptive as in Skywork-OR1,
arXiv:2505.22312).
"""

import math
from dataclasses import dataclass

import torch
from accelerate.utils import gather

from ..core.config import document_fields, option
from ..online.config import OnlineConfig
from ..online.importance_sampling import IMPORTANCE_SAMPLING_FIELDS, ImportanceSamplingConfig, ImportanceSamplingMixin
from ..online.metrics import off_policy_mask
from ..online.policy_losses import LOSSES, LossTerms, LossType, PolicyLossConfig, policy_loss_terms
from ..online.rewards import group_relative_advantages, nanstd
from ..online.rollout import RolloutBatch
from ..online.trainer import OnlineTrainer


@document_fields
@dataclass
class GRPOConfig(PolicyLossConfig, ImportanceSamplingConfig, OnlineConfig):
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
    multi_objective_aggregation: str = option("sum_then_normalize", "'sum_then_normalize' or 'normalize_then_sum'.")
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
        self.check_policy_loss()
        super().__post_init__()
        self.check_importance_sampling()
        aggregations = ("sum_then_normalize", "normalize_then_sum")
        if self.multi_objective_aggregation not in aggregations:
            raise ValueError(
                f"multi_objective_aggregation={self.multi_objective_aggregation!r} is not one of {list(aggregations)}."
            )
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
            advantages, std = group_relative_advantages(rewards, g, self.args.scale_rewards)
        self.log_zero_std_fraction(std)
        return torch.nan_to_num(advantages, nan=0.0)

    @property
    def loss_entry(self) -> LossType:
        """The entry of `LOSSES` this trainer's loss is (`loss_type`; `GMPOTrainer`: "gmpo")."""
        return LOSSES[self.args.loss_type]

    def _loss_terms(self, logps: torch.Tensor, inputs: RolloutBatch, keep: torch.Tensor | None) -> LossTerms:
        a = self.args
        level, (low, high) = a.importance_sampling_level, a.clip_range()
        return policy_loss_terms(logps, inputs.old_logps, inputs.loss_mask, inputs.advantages, level, low, high, a,
                                 inputs, keep, a.delta)  # fmt: skip

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
