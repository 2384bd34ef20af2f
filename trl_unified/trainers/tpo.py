r"""Triple Preference Optimization (TPO), Saeidi et al., 2025 (arXiv:2405.16681): a drop-in for TRL 1.16's
`trl.experimental.tpo.TPOTrainer` on the preference core, with no reference model.

A row holds a prompt x and three completions: y_w (chosen), y_l (rejected) and y_ref (`reference`, the gold
response). Each of y_w and y_l is scored by its log-prob under the policy alone: the sum s = Σ_t log π(y_t|x, y_<t),
or its mean over the completion tokens for `loss_type` "ipo" and "tpo-l" (the SimPO-style reward of the paper). With
Δ = s_w - s_l, the loss of a row is `preference.losses.margin_losses`:

    sigmoid:  -(1 - ε) log σ(βΔ) - ε log σ(-βΔ)      hinge:  max(0, 1 - βΔ)      ipo:  (Δ - 1/(2β))²
    tpo-l:  the sigmoid loss of Δ - γ/β, γ = `tpo_l_gamma`

and the loss of a micro-batch of B rows adds the gold response's NLL, averaged over its completion tokens:

    L = 1/B Σ_i ℓ(Δ_i) + tpo_alpha · L_NLL(y_ref)

With `tpo_alpha` = 0 the reference rows are not collated at all (two completions per row, as DPO's batches). The
three completions of a row share its prompt, encoded once (docs/shared_prefix.md). The Trainer divides L by the
gradient-accumulation steps. Logged, as TRL: rewards/chosen = mean β s_w, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected, logits/chosen, logits/rejected, mean_token_accuracy, entropy,
num_tokens.
"""

from dataclasses import dataclass

from ..core.config import TruncationConfig, document_fields, option
from ..preference.data import PairedBatch
from ..preference.losses import margin_losses, nll, sequence_logps
from ..preference.trainer import PreferenceConfig, PreferenceTrainer


LOSS_TYPES = ("sigmoid", "hinge", "ipo", "tpo-l")


@document_fields
@dataclass
class TPOConfig(TruncationConfig, PreferenceConfig):
    """Configuration of `TPOTrainer`: every field of `trl.experimental.tpo.TPOConfig` 1.16, same names and
    defaults."""

    learning_rate: float = option(5e-7, "Initial AdamW learning rate.")
    pad_to_multiple_of: int | None = option(None, "Pad batches to a multiple of this length (None: no padding).")
    loss_type: str = option("sigmoid", f"One of {', '.join(LOSS_TYPES)} (see the module docstring).")
    beta: float = option(0.01, "β: the temperature of the pairwise loss (IPO's τ for 'ipo').")
    label_smoothing: float = option(0.0, "ε: the label-flip probability of the sigmoid and tpo-l losses.")
    tpo_alpha: float = option(1.0, "Weight of the gold (`reference`) response's NLL; 0 drops its rows.")
    tpo_l_gamma: float = option(0.5, "γ: the target reward margin of loss_type='tpo-l'.")

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not one of {list(LOSS_TYPES)}.")
        self.check_truncation_mode()
        super().__post_init__()


class TPOTrainer(PreferenceTrainer):
    """TPO (see the module docstring). Same constructor as TRL 1.16's `TPOTrainer`, then `quantization_config`."""

    _name = "TPO"
    config_class = TPOConfig
    completion_keys = ("chosen", "rejected", "reference")
    required_columns = [("chosen", "rejected", "reference")]

    def __init__(
        self,
        model,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        quantization_config=None,
    ):
        self._build(
            model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            quantization_config=quantization_config,
        )

    def collated_completions(self) -> tuple[str, ...]:
        return self.completion_keys if self.args.tpo_alpha != 0.0 else ("chosen", "rejected")

    def compute_policy_loss(self, model, inputs: PairedBatch, num_items_in_batch=None):
        a, sequences = self.args, inputs.sequences
        chosen, rejected, mask = inputs.block("chosen"), inputs.block("rejected"), sequences.token_mask()
        per_token, out = self.completion_logps(model, sequences, stats=True)
        logps = sequence_logps(per_token, mask, average=a.loss_type in ("ipo", "tpo-l"))
        logps_w, logps_l = logps[chosen], logps[rejected]
        loss_type = "simpo" if a.loss_type == "tpo-l" else a.loss_type
        loss = margin_losses(loss_type, logps_w - logps_l, self.beta, a.label_smoothing, a.tpo_l_gamma).mean()
        if "reference" in inputs.completions:
            gold = inputs.block("reference")
            loss = loss + a.tpo_alpha * nll(per_token[gold], mask[gold])
        loss = self.add_aux_loss(loss, out.aux_loss)

        self.log_sequence_metrics(sequences, out, {key: inputs.block_mask(key) for key in ("chosen", "rejected")})
        self.log_token_accuracy(out, mask[chosen])
        self.log_reward_metrics(self.beta * logps_w, self.beta * logps_l, logps_w, logps_l)
        return loss
