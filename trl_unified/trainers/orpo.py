r"""Odds Ratio Preference Optimization (ORPO), Hong et al., 2024 (arXiv:2403.07691): a drop-in for TRL 1.16's
`trl.experimental.orpo.ORPOTrainer` on the preference core, with no reference model.

For a prompt x with a chosen completion y_w and a rejected one y_l, the length-normalised log-prob
log P(y|x) = 1/|y| Σ_t log π(y_t | x, y_<t) gives odds(y|x) = P / (1 - P), and the log odds ratio (Eq. 4-6)

    log OR = log(odds(y_w|x) / odds(y_l|x)) = (log P_w - log P_l) - (log(1 - P_w) - log(1 - P_l))

with log(1 - P) computed stably (`log1mexp`). The loss of a micro-batch of B pairs, λ = `beta` (Eq. 6):

    L = L_NLL - λ · 1/B Σ_i log σ(log OR_i)

where L_NLL is the chosen rows' negative log-likelihood averaged over their tokens, the prompt's included (TRL's
and the paper's code: every real token of the chosen row but the first; an encoder-decoder model: the completion).
The Trainer divides L by the gradient-accumulation steps. Logged, as TRL: rewards/chosen = mean λ log P_w,
rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected (length-normalised), nll_loss,
log_odds_ratio = mean log σ(log OR), log_odds_chosen = mean log OR, logits/chosen and logits/rejected (the mean logit
per completion token: docs/departures.md), entropy, num_tokens.
"""

from dataclasses import dataclass

import torch.nn.functional as F

from ..core.config import document_fields, option
from ..preference.data import PairedBatch
from ..preference.losses import log_odds_ratio, nll, sequence_logps
from ..preference.trainer import PreferenceConfig, PreferenceTrainer, init_without_reference


@document_fields
@dataclass
class ORPOConfig(PreferenceConfig):
    """Configuration of `ORPOTrainer`: every field of `trl.experimental.orpo.ORPOConfig` 1.16, same names and
    defaults."""

    max_completion_length: int | None = option(
        None, "Completion tokens kept per row (None: all; an encoder-decoder model gets 128 with a warning, as TRL)."
    )
    beta: float = option(0.1, "λ: the weight of the odds-ratio term against the NLL (the paper's λ).")
    padding_value: int | None = option(None, "Padding id of the batches. None: the tokenizer's pad token.")
    generate_during_eval: bool = option(False, "Log completions sampled on an eval batch to W&B / Comet.")
    is_encoder_decoder: bool | None = option(None, "Whether the model is an encoder-decoder (read from the model).")

    def completion_token_limit(self) -> int | None:
        return self.max_completion_length


class ORPOTrainer(PreferenceTrainer):
    """ORPO (see the module docstring). Same constructor as TRL 1.16's `ORPOTrainer`, then `quantization_config`."""

    _name = "ORPO"
    config_class = ORPOConfig
    legacy_format = True
    required_columns = [("chosen", "rejected")]
    __init__ = init_without_reference

    def compute_policy_loss(self, model, inputs: PairedBatch, num_items_in_batch=None):
        sequences, chosen, rejected = inputs.sequences, inputs.block("chosen"), inputs.block("rejected")
        per_token, out = self.completion_logps(model, sequences, stats=True, include_prompt=True)
        logps = sequence_logps(per_token, sequences.token_mask(), average=True)  # (2B,) over completion tokens
        logps_w, logps_l = logps[chosen], logps[rejected]
        nll_loss = nll(per_token[chosen], sequences.token_mask(include_prompt=True)[chosen])
        log_odds = log_odds_ratio(logps_w, logps_l)  # (B,)
        ratio = F.logsigmoid(log_odds)
        loss = self.add_aux_loss(nll_loss - self.beta * ratio.mean(), out.aux_loss)

        self.log_sequence_metrics(sequences, out, {key: inputs.block_mask(key) for key in ("chosen", "rejected")})
        self.log_reward_metrics(self.beta * logps_w, self.beta * logps_l, logps_w, logps_l)
        gather = self.accelerator.gather_for_metrics
        self.log_metric("nll_loss", gather(nll_loss.detach()).mean().item())
        self.log_metric("log_odds_ratio", gather(ratio.detach().mean()).mean().item())
        self.log_metric("log_odds_chosen", gather(log_odds.detach().mean()).mean().item())
        return loss
