r"""Kahneman-Tversky Optimization (KTO), Ethayarajh et al., 2024 (arXiv:2402.01306): a drop-in for
`trl.KTOTrainer`.

KTO learns from unpaired rows: a prompt x, a completion y and a label (desirable or not). With the sequence
log-ratio against the frozen reference, h = log π_θ(y|x) - log π_ref(y|x) (summed over completion tokens), and the
reference point z_0 = KL(π_θ || π_ref) estimated from mismatched pairs, the loss of a row is (Eq. 7 and 8)

    desirable:    λ_D · (1 - σ(β (h - z_0)))
    undesirable:  λ_U · (1 - σ(β (z_0 - h)))

and the loss of a micro-batch is the mean over its rows (the Trainer divides it by the gradient-accumulation
steps). z_0 is computed as TRL computes it: each row's completion is paired with the previous row's prompt (the
completions rotated by one within each block of `per_device_train_batch_size` rows, so the sampler must be
sequential), z_0 = mean_i [log π_θ(y_{i-1}|x_i) - log π_ref(y_{i-1}|x_i)] over the device batch, without gradient,
averaged over processes and clamped at 0.

`loss_type="apo_zero_unpaired"` (APO, D'Oosterlinck et al., 2024, arXiv:2408.06266, unpaired Eq. 7) uses no KL:
desirable 1 - σ(β h), undesirable σ(β h). Logged, as TRL: kl, rewards/chosen and rewards/rejected (mean β h of the
desirable / undesirable rows over all processes), rewards/margins, logps/chosen, logps/rejected, logits/*, entropy,
num_tokens.
"""

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from datasets import Dataset

from ..core.config import document_fields, option
from ..preference.data import UnpairedBatch
from ..preference.trainer import PreferenceTrainer, ReferencePreferenceConfig


logger = logging.getLogger(__name__)

LOSS_TYPES = ("kto", "apo_zero_unpaired")


@document_fields
@dataclass
class KTOConfig(ReferencePreferenceConfig):
    """Configuration of `KTOTrainer`: every field of `trl.KTOConfig` 1.16, same names and defaults."""

    loss_type: str = field(default="kto", metadata={"help": f"One of {', '.join(LOSS_TYPES)}."})
    desirable_weight: float = option(1.0, "λ_D, weight of the desirable rows' losses.")
    undesirable_weight: float = option(1.0, "λ_U, weight of the undesirable rows' losses.")
    train_sampling_strategy: str = option("sequential", "Row order; 'sequential' keeps the KL pairs of neighbours.")

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not one of {list(LOSS_TYPES)}.")
        super().__post_init__()
        if self.loss_type == "kto" and self.train_sampling_strategy != "sequential":
            raise ValueError(
                "loss_type='kto' estimates the KL term from each row's neighbours in a fixed-order batch, so it "
                f"needs train_sampling_strategy='sequential'; got {self.train_sampling_strategy!r}."
            )
        if self.loss_type == "kto" and self.per_device_train_batch_size <= 1:
            raise ValueError(
                "per_device_train_batch_size must be > 1 for loss_type='kto': with one row the mismatched-pair KL "
                "estimate is the row's own reward."
            )


class KTOTrainer(PreferenceTrainer):
    """KTO (see the module docstring). Same constructor as `trl.KTOTrainer`."""

    _name = "KTO"
    config_class = KTOConfig
    paired = False
    required_columns = [("completion", "label"), ("chosen", "rejected")]
    signature_columns = ["prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps"]

    def _uses_kl(self) -> bool:
        return self.args.loss_type == "kto"

    def check_columns(self, dataset, name: str) -> None:
        super().check_columns(dataset, name)
        features = getattr(dataset, "features", None) or {}
        if "label" in features and "prompt_ids" not in features:
            dtype = getattr(features["label"], "dtype", None)
            integer = str(dtype).startswith(("int", "uint"))
            if dtype != "bool" and not (integer and set(dataset.unique("label")) <= {0, 1}):
                raise ValueError(
                    f"The {name} dataset's label column has type {dtype}, but KTO needs booleans (True = desirable) "
                    "or 0/1 integers. Convert it, e.g. dataset.cast_column('label', datasets.Value('bool'))."
                )

    def prepare_dataset(self, dataset, name: str):
        tokenized = bool({"prompt_ids", "prompt_text"} & set(getattr(dataset, "column_names", None) or []))
        dataset = super().prepare_dataset(dataset, name)
        if dataset is None or tokenized:
            return dataset
        if self._uses_kl():  # row i's KL completion is row i-1's, within blocks of the device batch size

            def rotate(rows):
                return {"KL_completion_ids": [rows["completion_ids"][-1]] + rows["completion_ids"][:-1]}

            dataset = dataset.map(rotate, batched=True, batch_size=self.args.per_device_train_batch_size)
        if name == "train" and isinstance(dataset, Dataset):
            self._warn_on_imbalance([bool(label) for label in dataset["label"]])
        return dataset

    def _warn_on_imbalance(self, labels: list[bool]) -> None:
        """TRL's advice (paper, Eq. 8): λ_D n_D / (λ_U n_U) should lie in [1, 4/3]."""
        args = self.args
        n_d, n_u = sum(labels), len(labels) - sum(labels)
        if n_d == 0 or n_u == 0:
            kind = "undesirable" if n_d == 0 else "desirable"
            logger.warning(
                f"The train dataset has {n_d} desirable and {n_u} undesirable rows: every row is {kind}, so KTO "
                "learns from one side only. Add rows with the other label."
            )
            return
        d_range = (round(n_u * args.undesirable_weight / n_d, 2), round(n_u * args.undesirable_weight / n_d * 1.33, 2))
        u_range = (round(n_d * args.desirable_weight / n_u / 1.33, 2), round(n_d * args.desirable_weight / n_u, 2))
        if n_d != n_u and not (
            d_range[0] <= args.desirable_weight <= d_range[1] or u_range[0] <= args.undesirable_weight <= u_range[1]
        ):
            logger.warning(
                f"{n_d} desirable and {n_u} undesirable rows: set EITHER desirable_weight in {list(d_range)} or "
                f"undesirable_weight in {list(u_range)} (not both), per the KTO paper's Eq. 8."
            )

    def reference_columns(self, batch: UnpairedBatch):
        if not self._uses_kl():
            return {"ref_logps": self.reference_completion_logps(batch.sequences).sum(1)}
        ref, ref_kl = self.reference_completion_logps(batch.sequences, batch.kl_sequences)  # one forward
        return {"ref_logps": ref.sum(1), "ref_KL_logps": ref_kl.sum(1)}

    def compute_policy_loss(self, model, inputs: UnpairedBatch, num_items_in_batch=None):
        args, beta = self.args, self.beta
        desirable = inputs.label.bool()
        if self._uses_kl():  # the KL rows share the completion rows' prompts: one prompt pass for both
            per_token, out, kl_logps = self.completion_logps_and_detached(model, inputs.sequences, inputs.kl_sequences)
        else:
            per_token, out = self.completion_logps(model, inputs.sequences, stats=True)
        columns = self.reference_columns(inputs) if inputs.ref_logps is None else inputs  # one forward, KL rows too
        logratios, gather = per_token.sum(1) - columns["ref_logps"], self.accelerator.gather_for_metrics
        kl = torch.zeros((), device=logratios.device)
        if self._uses_kl():
            kl = gather((kl_logps.sum(1) - columns["ref_KL_logps"]).mean().detach()).mean().clamp(min=0)
        h_d, h_u = logratios[desirable], logratios[~desirable]
        if args.loss_type == "kto":  # Eq. 7-8
            losses_d, losses_u = 1 - F.sigmoid(beta * (h_d - kl)), 1 - F.sigmoid(beta * (kl - h_u))
        else:  # apo_zero_unpaired
            losses_d, losses_u = 1 - F.sigmoid(beta * h_d), F.sigmoid(beta * h_u)
        loss = torch.cat([args.desirable_weight * losses_d, args.undesirable_weight * losses_u]).nanmean()
        loss = self.add_aux_loss(loss, out.aux_loss)

        self.log_metric("kl", kl.item())
        self.log_sequence_metrics(inputs.sequences, out, {"chosen": desirable, "rejected": ~desirable})
        means = {}
        for group, rows in (("chosen", desirable), ("rejected", ~desirable)):
            count = gather(rows.sum()).sum().item()
            if count > 0:
                means[group] = gather((beta * logratios.detach()[rows]).nansum()).nansum().item() / count
                self.log_metric(f"rewards/{group}", means[group])
                logps = (per_token.detach().sum(1))[rows]
                self.log_metric(f"logps/{group}", gather(logps.nansum()).nansum().item() / count)
        if len(means) == 2:
            self.log_metric("rewards/margins", means["chosen"] - means["rejected"])
        return loss
