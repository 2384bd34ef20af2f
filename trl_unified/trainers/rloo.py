r"""REINFORCE Leave-One-Out (RLOO), Ahmadian et al., 2024 (arXiv:2402.14740): a drop-in for `trl.RLOOTrainer`.

For each prompt, G completions y_1..y_G are sampled from the policy. With r_i the (weighted, optionally clipped)
reward of y_i and, when beta > 0, the sequence-level KL estimate (k1 estimator, Schulman 2020) between the policy
at sampling time and the reference, KL_i = sum_t [log pi_old(y_i,t) - log pi_ref(y_i,t)], the shaped reward is

    r'_i = r_i - beta * KL_i

and the leave-one-out advantage over the group's scorable completions (those with a reward) is

    A_i = r'_i - 1/(n-1) * sum_{j != i, j scorable} r'_j  =  n/(n-1) * (r'_i - mean_j r'_j),   n = #scorable

(optionally normalised over the whole generation batch: A <- (A - mean A) / (std A + 1e-4)). The loss is a
sequence-level clipped policy gradient, averaged over the completions of the micro-batch:

    rho_i = exp(log pi_theta(y_i) - log pi_old(y_i)),     log pi(y) = sum_t log pi(y_t | x, y_<t)
    L = -1/B * sum_i min(rho_i * A_i, clip(rho_i, 1 - epsilon, 1 + epsilon_high) * A_i)

With num_iterations == 1 the ratio is 1 and its gradient is A_i * grad log pi_theta(y_i): plain REINFORCE with the
leave-one-out baseline. The Trainer divides L by the gradient-accumulation steps.
"""

from dataclasses import dataclass

import torch
from accelerate.utils import gather

from ..core.config import document_fields, option
from ..online.config import OnlineConfig
from ..online.rewards import nanstd
from ..online.rollout import RolloutBatch, RolloutPlan
from ..online.trainer import OnlineTrainer


__all__ = ["RLOOConfig", "RLOOTrainer", "rloo_advantages"]


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    r"""Leave-one-out advantage (Ahmadian et al., 2024, arXiv:2402.14740) over each prompt's G completions:

        A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean_j r_j)

    where the sums and n run over the group's scorable (non-NaN) rewards. `rewards`: `(num_prompts * G,)`, groups
    contiguous; returns that shape, NaN where r_i is NaN or fewer than 2 completions of the group are scorable.
    """
    grouped = rewards.view(-1, num_generations)  # (P, G)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)  # (P, 1)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)  # (P, G)
    return rewards - baselines.view(-1)


@document_fields
@dataclass
class RLOOConfig(OnlineConfig):
    """Configuration of `RLOOTrainer`: every field of `trl.RLOOConfig` 1.16, same names and defaults."""

    num_generations: int | None = option(2, "Completions sampled per prompt (G >= 2).")
    beta: float = option(0.05, "KL coefficient β. If 0.0, no reference model is loaded.")
    normalize_advantages: bool = option(False, "Normalise advantages over the generation batch to mean 0, std 1.")
    reward_clip_range: tuple[float, float] | None = option(None, "Clip rewards to (min, max) before the KL penalty.")

    def __post_init__(self):
        super().__post_init__()
        clip = self.reward_clip_range
        if clip is not None and (len(clip) != 2 or clip[0] > clip[1]):
            raise ValueError(f"reward_clip_range={clip} must be (min, max) with min <= max.")


class RLOOTrainer(OnlineTrainer):
    """REINFORCE Leave-One-Out (see the module docstring for the maths). Same constructor as `trl.RLOOTrainer`."""

    _name = "RLOO"
    config_class = RLOOConfig
    loss_is_scaled_for_ga = False  # per-micro-batch mean: the Trainer divides by gradient accumulation

    def rollout_plan(self) -> RolloutPlan:
        """π_old is the loss forward's log-probs, detached, where the policy cannot change between generation and
        every use of the batch: TRL's no-grad forward skipped, the KL shaping deferred (docs/rloo.md)."""
        a = self.args
        aligned = a.num_iterations == 1 and a.steps_per_generation == a.gradient_accumulation_steps
        unchanged = aligned and (a.beta == 0.0 or a.steps_per_generation == 1)
        return RolloutPlan(
            old_logps_train=not unchanged,
            old_logps_eval=True,
            defer_advantages=unchanged and self.reference_model.available,
        )

    def compute_advantages(self, rewards, rewards_per_func, batch: RolloutBatch, mode: str) -> torch.Tensor:
        ref = batch.ref_logps
        kl = gather(self._sequence_kl(batch.old_logps, ref, batch.loss_mask)) if ref is not None else None
        return self._advantages(rewards, kl, mode)

    def _sequence_kl(self, policy_tok, ref_tok, mask):
        """Per-sequence k1 KL estimate `sum_t (log pi - log pi_ref)` `(B,)`; logs the per-token mean as `kl`."""
        per_token = (policy_tok - ref_tok) * mask
        stats = self.accelerator.reduce(torch.stack([per_token.sum(), mask.sum().float()]), reduction="sum")
        self.log_metric("kl", (stats[0] / stats[1].clamp(min=1.0)).item())
        return per_token.sum(1)

    def _advantages(self, rewards, kl, mode):
        """Advantages of the global generation batch: clip, KL-shape, leave-one-out, optional normalisation.
        `rewards` and `kl` are `(N_global,)`, groups of G contiguous; NaN (unscorable) rows get advantage 0."""
        args = self.args
        if args.reward_clip_range:
            rewards = rewards.clamp(*args.reward_clip_range)
        if kl is not None:
            rewards = rewards - args.beta * kl
        g = self.group_size(mode)
        self.log_zero_std_fraction(nanstd(rewards.view(-1, g), dim=1))
        advantages = rloo_advantages(rewards, g) if g > 1 else torch.zeros_like(rewards)
        if args.normalize_advantages:
            advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
        return torch.nan_to_num(advantages, nan=0.0)

    def _deferred_advantages(self, inputs: RolloutBatch, policy_logps: torch.Tensor) -> torch.Tensor:
        """Advantages for a batch whose KL shaping waited for the loss's forward (see `rollout_plan`): this process's
        rows `(B,)`. The rows may have been shuffled: `gather_global` puts every process's rewards and KL back in
        generation order (one gather for both), as the group baseline needs."""
        local_kl = self._sequence_kl(policy_logps, inputs.ref_logps, inputs.loss_mask)
        local = torch.stack([inputs.rewards.float(), local_kl.float()], dim=1)  # (B, 2)
        rewards, kl = inputs.gather_global(local).T.contiguous()  # (N_global,) each
        advantages = self._advantages(rewards, kl, "train")
        self.completion_log.add_advantages(advantages)
        return advantages[inputs.row_index]

    def compute_policy_loss(self, model, inputs: RolloutBatch, num_items_in_batch=None):
        mask, mode = inputs.loss_mask, self.mode
        out = self.policy_logprobs(model, inputs)
        logps = (out.logps * mask).sum(1)  # (B,); padding and post-EOS tokens masked
        old_logps = (inputs.old_logps * mask).sum(1) if inputs.old_logps is not None else logps.detach()
        advantages = inputs.advantages
        if self.plan.defers_advantages(mode):  # the KL shaping waited for this forward (see `rollout_plan`)
            advantages = self._deferred_advantages(inputs, out.logps.detach())
        ratio = torch.exp(logps - old_logps)  # (B,)
        low, high = self.args.clip_range()
        loss = -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages).mean()
        loss = self.add_aux_loss(loss, out.aux_loss)
        self.log_metric("entropy", self.masked_global_mean(out.entropy, mask))
        self.log_clip_ratios(ratio.unsqueeze(1), advantages, mask, low, high)
        return loss
