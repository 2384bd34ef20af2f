r"""Contrastive Preference Optimization (CPO), Xu et al., 2024 (arXiv:2401.08417), with SimPO (Meng et al., 2024,
arXiv:2405.14734) and AlphaPO (Gupta et al., 2025, arXiv:2501.03884): a drop-in for TRL 1.16's
`trl.experimental.cpo.CPOTrainer` on the preference core, with no reference model.

For a prompt x with a chosen completion y_w and a rejected one y_l, each completion's score is its log-prob under
the policy alone: the sum s = Σ_t log π(y_t | x, y_<t), or the mean over its tokens for `loss_type` "ipo" and
"simpo" (SimPO's length-normalised reward, Eq. 4); with `alpha` ≠ 0 (AlphaPO) the score is reshaped,
r = (1 - exp(-α s)) / α. With Δ = r_w - r_l, the loss of a pair is `preference.losses.margin_losses`:

    sigmoid (CPO, Eq. 3):  -(1 - ε) log σ(βΔ) - ε log σ(-βΔ)        ε = `label_smoothing`
    hinge:  max(0, 1 - βΔ)                 ipo:  (Δ - 1/(2β))²
    simpo (Eq. 6):  the sigmoid loss of Δ - γ/β, γ = `simpo_gamma`

and the loss of a micro-batch of B pairs, with the behaviour-cloning NLL of the chosen completions weighted by
`cpo_alpha` (Eq. 5; averaged over the chosen completion tokens, skipped when `cpo_alpha` = 0):

    L = 1/B Σ_i ℓ(Δ_i) + cpo_alpha · L_NLL(y_w)

`loss_type="alphapo"` is TRL's shorthand for loss_type "simpo" with cpo_alpha 0 (set `alpha` too). The Trainer
divides L by the gradient-accumulation steps. Logged, as TRL: rewards/chosen = mean β r_w, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, nll_loss, logits/chosen and logits/rejected (the
mean logit per completion token: docs/departures.md), entropy, num_tokens.
"""

import logging
from dataclasses import dataclass

import torch

from ..core.config import document_fields, option
from ..preference.data import PairedBatch
from ..preference.losses import alphapo_rewards, margin_losses, nll, sequence_logps
from ..preference.trainer import PreferenceConfig, PreferenceTrainer, init_without_reference


logger = logging.getLogger(__name__)

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")


@document_fields
@dataclass
class CPOConfig(PreferenceConfig):
    """Configuration of `CPOTrainer`: every field of `trl.experimental.cpo.CPOConfig` 1.16, same names and
    defaults."""

    max_completion_length: int | None = option(
        None, "Completion tokens kept per row (None: all; an encoder-decoder model gets 128 with a warning, as TRL)."
    )
    beta: float = option(0.1, "β: the temperature of the pairwise loss.")
    label_smoothing: float = option(0.0, "ε: the label-flip probability of the sigmoid and simpo losses.")
    loss_type: str = option("sigmoid", f"One of {', '.join(LOSS_TYPES)} (see the module docstring).")
    cpo_alpha: float = option(1.0, "Weight of the behaviour-cloning NLL of the chosen completions.")
    simpo_gamma: float = option(0.5, "γ: SimPO's target reward margin (loss_type='simpo').")
    alpha: float = option(0.0, "α: AlphaPO's reward shape, r = (1 - p^(-α)) / α; 0 keeps the log-prob.")
    generate_during_eval: bool = option(False, "Log completions sampled on an eval batch to W&B / Comet.")
    is_encoder_decoder: bool | None = option(None, "Whether the model is an encoder-decoder (read from the model).")

    def __post_init__(self):
        if self.loss_type == "alphapo":  # TRL's shorthand for AlphaPO's recipe
            self.loss_type, self.cpo_alpha = "simpo", 0.0
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not one of {list(LOSS_TYPES)}.")
        if self.loss_type in ("hinge", "ipo") and self.label_smoothing > 0:
            logger.warning(
                f"You are using the {self.loss_type} loss type that does not support label smoothing. The "
                "`label_smoothing` parameter will be ignored. Set `label_smoothing` to `0.0` to remove this warning."
            )
        super().__post_init__()

    def completion_token_limit(self) -> int | None:
        return self.max_completion_length


class CPOTrainer(PreferenceTrainer):
    """CPO, SimPO and AlphaPO (see the module docstring). Same constructor as TRL 1.16's `CPOTrainer`, then
    `quantization_config`."""

    _name = "CPO"
    config_class = CPOConfig
    legacy_format = True
    required_columns = [("chosen", "rejected")]
    __init__ = init_without_reference

    def compute_policy_loss(self, model, inputs: PairedBatch, num_items_in_batch=None):
        a, sequences = self.args, inputs.sequences
        chosen, rejected, mask = inputs.block("chosen"), inputs.block("rejected"), sequences.token_mask()
        per_token, out = self.completion_logps(model, sequences, stats=True)
        logps = sequence_logps(per_token, mask, average=a.loss_type in ("ipo", "simpo"))  # (2B,)
        logps_w, logps_l = logps[chosen], logps[rejected]
        rewards_w, rewards_l = logps_w, logps_l
        if a.alpha != 0.0:
            rewards_w, rewards_l = alphapo_rewards(logps_w, a.alpha), alphapo_rewards(logps_l, a.alpha)
        losses = margin_losses(a.loss_type, rewards_w - rewards_l, self.beta, a.label_smoothing, a.simpo_gamma)
        nll_loss = nll(per_token[chosen], mask[chosen]) if a.cpo_alpha != 0 else torch.zeros((), device=logps.device)
        loss = self.add_aux_loss(losses.mean() + a.cpo_alpha * nll_loss, out.aux_loss)

        self.log_sequence_metrics(sequences, out, {key: inputs.block_mask(key) for key in ("chosen", "rejected")})
        self.log_reward_metrics(self.beta * rewards_w, self.beta * rewards_l, logps_w, logps_l)
        self.log_metric("nll_loss", self.accelerator.gather_for_metrics(nll_loss.detach()).mean().item())
        return loss
