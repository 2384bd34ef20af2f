r"""Direct Preference Optimization (DPO), Rafailov et al., 2023 (arXiv:2305.18290): a drop-in for `trl.DPOTrainer`.

For a prompt x with a chosen completion y_w and a rejected one y_l, the sequence log-prob is the sum over the
completion tokens, log π(y|x) = Σ_t log π(y_t | x, y_<t) (with `ld_alpha`, LD-DPO, Liu et al., 2024,
arXiv:2409.06411: the tokens up to the shorter completion's length count fully, the rest with weight α). The
log-ratios against the frozen reference

    h_w = log π_θ(y_w|x) - log π_ref(y_w|x),      h_l = log π_θ(y_l|x) - log π_ref(y_l|x)

become scores s = f'(exp h) for the f-divergence in `f_divergence_type` (f-DPO, Wang et al., 2023,
arXiv:2309.16240; reverse KL, the default, gives s = h), and Δ = s_w - s_l. The sigmoid loss (DPO's Eq. 7) is
-log σ(β Δ); every loss type is listed with its formula and paper in `pair_losses`. The loss of a micro-batch is

    L = Σ_k w_k · (1/B) Σ_i ℓ_k(i) · ω_i          (k over `loss_type`, w_k = `loss_weights`, B pairs)

with ω_i = 1, or with `use_weighting` the WPO weight (Zhou et al., 2024, arXiv:2406.11827, Eq. 2)
ω_i = exp(mean_t [log p(y_w,t) - log Σ_v p_v²]) · exp(same for y_l), without gradient. The Trainer divides L by the
gradient-accumulation steps. Logged, as TRL: rewards/chosen = mean β h_w, rewards/rejected = mean β h_l,
rewards/accuracies = mean 1[h_w > h_l], rewards/margins, logps/chosen, logps/rejected, logits/*, entropy,
mean_token_accuracy (chosen tokens that are the argmax), num_tokens.
"""

import warnings
from dataclasses import dataclass, field

import torch

from ..core.config import TruncationConfig, document_fields, option
from ..preference.data import PairedBatch
from ..preference.losses import f_scores, nll, pair_losses
from ..preference.trainer import PreferenceTrainer, ReferencePreferenceConfig


LOSS_TYPES = (
    *("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired"),
    *("apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"),
)
F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@document_fields
@dataclass
class DPOConfig(TruncationConfig, ReferencePreferenceConfig):
    """Configuration of `DPOTrainer`: every field of `trl.DPOConfig` 1.16, same names and defaults."""

    loss_type: list[str] = option(default_factory=lambda: ["sigmoid"], help=f"One or more of {', '.join(LOSS_TYPES)}.")
    loss_weights: list[float] | None = option(None, "One weight per loss type (MPO: [0.8, 0.2, 1.0]). None: all 1.0.")
    ld_alpha: float | None = option(None, "LD-DPO α in [0, 1]: weight of tokens beyond the shorter completion.")
    f_divergence_type: str = field(default="reverse_kl", metadata={"help": f"One of {', '.join(F_DIVERGENCES)}."})
    f_alpha_divergence_coef: float = option(0.5, "α of the alpha_divergence.")
    label_smoothing: float = option(0.0, "Robust DPO: label-flip probability in [0, 0.5); EXO: ε (e.g. 1e-3).")
    use_weighting: bool = option(False, "WPO weights from length-normalised log-probs.")
    discopop_tau: float = option(0.05, "τ of the DiscoPOP loss.")
    pad_token: str | None = option(None, "Deprecated: set tokenizer.pad_token instead.")
    padding_free: bool | None = option(
        False, "False (TRL): padded rows; True: packed; None: packed where padding is large (docs/padding_free.md)."
    )

    def __post_init__(self):
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        unknown = [t for t in self.loss_type if t not in LOSS_TYPES]
        if unknown:
            raise ValueError(f"loss_type {unknown} unknown. Choose from {list(LOSS_TYPES)}.")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"loss_weights has {len(self.loss_weights)} weights for {len(self.loss_type)} loss types "
                f"({self.loss_type}); give one weight per loss type."
            )
        if self.f_divergence_type not in F_DIVERGENCES:
            raise ValueError(f"f_divergence_type={self.f_divergence_type!r} is not one of {list(F_DIVERGENCES)}.")
        if self.f_divergence_type != "reverse_kl" and not set(self.loss_type) <= F_DIVERGENCE_LOSSES:
            raise ValueError(
                f"f_divergence_type={self.f_divergence_type!r} only applies to {sorted(F_DIVERGENCE_LOSSES)}; "
                f"loss_type is {self.loss_type}. Use f_divergence_type='reverse_kl' with these losses."
            )
        if "exo_pair" in self.loss_type and self.label_smoothing == 0.0:
            raise ValueError("loss_type 'exo_pair' needs label_smoothing > 0 (the EXO paper recommends 1e-3).")
        if self.use_weighting and {"aot", "aot_unpaired"} & set(self.loss_type):
            raise NotImplementedError("use_weighting is not defined for 'aot'/'aot_unpaired': they sort the pairs.")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha={self.ld_alpha} must be in [0, 1] (or None).")
        self.check_truncation_mode()
        if "robust" in self.loss_type and not 0.0 <= self.label_smoothing < 0.5:
            warnings.warn(f"label_smoothing={self.label_smoothing} should be in [0, 0.5) for 'robust'.", stacklevel=2)
        for name, value, hint in (
            ("pad_token", self.pad_token is not None, "set tokenizer.pad_token instead"),
            ("truncation_mode='keep_end'", self.truncation_mode == "keep_end", "use 'keep_start'"),
        ):
            if value:
                warnings.warn(f"{name} is deprecated in TRL, removed in v2.0.0: {hint}.", FutureWarning, stacklevel=2)
        super().__post_init__()


class DPOTrainer(PreferenceTrainer):
    """DPO and its variants (see the module docstring). Same constructor as `trl.DPOTrainer`."""

    _name = "DPO"
    config_class = DPOConfig
    paired = True
    required_columns = [("chosen", "rejected")]
    signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps"]

    def sequence_logps(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Σ_t over completion tokens `(2B,)`; with ld_alpha the tokens beyond the pair's shorter completion
        count α times."""
        if self.args.ld_alpha is None:
            return per_token.sum(1)
        position = mask.cumsum(1)
        shared = torch.minimum(*mask.sum(1).chunk(2)).repeat(2)[:, None]
        in_shared = (position > 0) & (position <= shared)
        return (per_token * in_shared).sum(1) + self.args.ld_alpha * (per_token * (position > shared)).sum(1)

    def reference_columns(self, batch: PairedBatch):
        sequences = batch.sequences
        ref = self.sequence_logps(self.reference_completion_logps(sequences), sequences.completion_mask[:, 1:])
        chosen, rejected = ref.chunk(2)
        return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

    def compute_policy_loss(self, model, inputs: PairedBatch, num_items_in_batch=None):
        args, sequences = self.args, inputs.sequences
        mask = sequences.completion_mask[:, 1:]
        per_token, out = self.completion_logps(model, sequences, stats=True)
        logps_w, logps_l = self.sequence_logps(per_token, mask).chunk(2)
        columns = inputs if inputs.ref_chosen_logps is not None else self.reference_columns(inputs)
        ref_w, ref_l = columns["ref_chosen_logps"], columns["ref_rejected_logps"]
        h_w, h_l = logps_w - ref_w, logps_l - ref_l
        s_w, s_l = (f_scores(h, args.f_divergence_type, args.f_alpha_divergence_coef) for h in (h_w, h_l))
        len_w, len_l = sequences.completion_mask.sum(1).clamp(min=1).chunk(2)
        mask_w = mask[: len(inputs)].bool()
        terms = dict(h_w=h_w, h_l=h_l, s_w=s_w, s_l=s_l, delta=s_w - s_l, logps_w=logps_w, logps_l=logps_l)
        terms.update(ref_w=ref_w, ref_l=ref_l, len_w=len_w, len_l=len_l)
        if "sft" in args.loss_type:
            terms["sft"] = nll(per_token[: len(inputs)], mask_w)
        weights = 1.0
        if args.use_weighting:  # WPO, Eq. 2: exp of the length-normalised, sharpness-aligned log-probs, no grad
            with torch.no_grad():
                aligned = ((per_token - out.stats["log_sum_sq_probs"]) * mask).sum(1) / mask.sum(1).clamp(min=1)
                weights = torch.prod(torch.stack(torch.exp(aligned).chunk(2)), dim=0)
        loss = 0.0
        for loss_type, weight in zip(args.loss_type, args.loss_weights or [1.0] * len(args.loss_type), strict=True):
            per_pair = pair_losses(terms, loss_type, self.beta, args.label_smoothing, args.discopop_tau)
            loss = loss + (per_pair * weights).mean() * weight
        loss = self.add_aux_loss(loss, out.aux_loss)

        self.log_sequence_metrics(sequences, out, {key: inputs.block_mask(key) for key in ("chosen", "rejected")})
        self.log_token_accuracy(out, mask_w)
        self.log_reward_metrics(self.beta * h_w, self.beta * h_l, logps_w, logps_l)
        return loss
