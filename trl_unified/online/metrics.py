"""TRL's metrics of an online rollout and its loss, averaged over every process: completion lengths, tools,
rewards, token-weighted means and clip ratios."""

import logging
from collections import Counter

import torch
from accelerate.utils import gather

from .rewards import nanstd


logger = logging.getLogger(__name__)


class OnlineMetricsMixin:
    """Metric logging of `OnlineTrainer` (a mixin: it reads `self.accelerator`, `self.state`, `self.rewards`)."""

    def _log_generation_metrics(self, mode, samples):
        """TRL's completion metrics, over the tokens the model sampled (tool-result tokens do not count), and the
        tool metrics when there are tools: calls per rollout and failures per call, over all processes."""
        out = samples.generation
        lengths = gather(out.model_token_mask.sum(1).float())
        truncated = gather(out.is_truncated.float())
        if mode == "train":
            self.state.num_input_tokens_seen += gather(out.prompt_mask.sum() + out.model_token_mask.sum()).sum().item()
        if self.tools:
            calls, failures = gather(lengths.new_tensor([[samples.tool_calls, samples.tool_failures]])).sum(0)
            self.log_metric("tools/call_frequency", (calls / lengths.numel()).item())
            self.log_metric("tools/failure_frequency", (failures / calls).item() if calls > 0 else 0.0)
            # trl_unified's addition (TRL 1.16 logs no turn count): model turns per completion
            turns = [
                sum(m.get("role") == "assistant" for m in c) if isinstance(c, list) else 1 for c in samples.completions
            ]
            self.log_metric("tools/turns_per_completion", gather(lengths.new_tensor(turns)).mean().item())
        self.log_metric("num_tokens", self.state.num_input_tokens_seen)
        terminated = lengths[truncated == 0] if (truncated == 0).any() else torch.zeros(1, device=lengths.device)
        for name, values in (("", lengths), ("terminated_", terminated)):
            for stat, reduce in (("mean", torch.mean), ("min", torch.min), ("max", torch.max)):
                self.log_metric(f"completions/{stat}_{name}length", reduce(values).item())
        self.log_metric("completions/clipped_ratio", truncated.mean().item())

    def _log_reward_metrics(self, rewards_per_func, rewards):
        for i, name in enumerate(self.rewards.names):
            self.log_metric(f"rewards/{name}/mean", torch.nanmean(rewards_per_func[:, i]).item())
            self.log_metric(f"rewards/{name}/std", nanstd(rewards_per_func[:, i]).item())
        self.log_metric("reward", torch.nanmean(rewards).item())
        self.log_metric("reward_std", nanstd(rewards).item())

    def log_zero_std_fraction(self, std: torch.Tensor) -> None:
        """TRL's `frac_reward_zero_std`: the fraction of the reward standard deviations `std` that are 0 (groups
        whose completions all scored alike: no learning signal)."""
        self.log_metric("frac_reward_zero_std", torch.isclose(std, torch.zeros_like(std)).float().mean().item())

    def masked_global_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        """Mean over all processes: token-weighted under `mask` for `(B, C)`, per sequence for `(B, 1)`."""
        if x.size(1) == 1:
            total, count = x.sum(), x.new_tensor(float(x.size(0)))
        else:
            total, count = (x * mask).sum(), mask.sum().float()
        stats = self.accelerator.reduce(torch.stack([total, count]), reduction="sum")
        return (stats[0] / stats[1].clamp(min=1.0)).item()

    def log_clip_ratios(self, ratio, advantages, mask, low: float, high: float) -> None:
        """TRL's `clip_ratio/*`: how often the ratio (per token `(B, C)`, or per sequence `(B, 1)`) was clipped
        below (ratio < low with A < 0) and above (ratio > high with A > 0), as global means, and the extreme
        per-sequence fractions over all processes."""
        advantages = advantages.view(ratio.size(0), -1)
        low_clip = ((ratio < low) & (advantages < 0)).float()
        high_clip = ((ratio > high) & (advantages > 0)).float()
        self.log_metric("clip_ratio/low_mean", self.masked_global_mean(low_clip, mask))
        self.log_metric("clip_ratio/high_mean", self.masked_global_mean(high_clip, mask))
        self.log_metric("clip_ratio/region_mean", self.masked_global_mean(((low_clip + high_clip) > 0).float(), mask))

        def per_sequence(x):
            """`(B,)`: a sequence ratio's value, or a token ratio's mean over the sequence's masked tokens."""
            if ratio.size(1) == 1:
                return x.squeeze(1)
            return (x * mask).sum(-1) / mask.sum(-1)

        for name, values, reduce in (("low_min", low_clip, torch.min), ("high_max", high_clip, torch.max)):
            gathered = gather(per_sequence(values))
            gathered = gathered[~torch.isnan(gathered)]
            self.log_metric(f"clip_ratio/{name}", reduce(gathered).item() if gathered.numel() else float("nan"))


def off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    """DeepSeek-V3.2's off-policy sequence mask `(B, 1)`: drop (0) a sequence with A < 0 whose mean KL(π_old ‖ π_θ)
    = mean_t (log π_old - log π_θ) over its tokens exceeds the threshold; keep (1) the rest."""
    kl = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= off_policy_threshold)).to(mask.dtype)


class DegenerateRoundWarnings:
    """Warnings about rounds that cannot teach (flat rewards, nothing to learn from), throttled as TRL's SDPO does:
    per (mode, kind), at the 1st and every `interval`-th consecutive degenerate round (0: never); a sound round
    resets the count."""

    def __init__(self, interval: int):
        self.interval, self.consecutive = interval, Counter()

    def observe(self, mode: str, kind: str, degenerate: bool, message: str) -> None:
        key = (mode, kind)
        if not degenerate:
            self.consecutive[key] = 0
        elif self.interval:
            self.consecutive[key] += 1
            if self.consecutive[key] == 1 or self.consecutive[key] % self.interval == 0:
                logger.warning("%s Consecutive degenerate steps: %s.", message, self.consecutive[key])
