"""The offline preference core that DPO and KTO share: config fields, sequence log-probs of completions, and
reference log-probs (on the fly or precomputed once) through `ReferenceModel`; data preparation is in `data.py`."""

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from datasets import IterableDataset
from torch.utils.data import DataLoader

from ..core.config import PolicyConfig, option
from ..core.logprobs import TokenLogprobs, compute_shared_logprobs, compute_token_logprobs
from ..core.trainer import PolicyTrainerBase
from ..data.datasets import column_names, dataset_columns
from ..models.loading import get_tokenizer
from .data import (
    PairedBatch,
    PairedCollator,
    SequenceBatch,
    SharedPromptLayout,
    UnpairedBatch,
    UnpairedCollator,
    prepare_preference_dataset,
)


logger = logging.getLogger(__name__)


@dataclass
class PreferenceConfig(PolicyConfig):
    """The fields `trl.DPOConfig` and `trl.KTOConfig` (1.16) share, with TRL's names and defaults."""

    _unimplemented_fields: ClassVar[dict[str, str]] = {
        "activation_offloading": "Activation offloading to the CPU is not implemented; use gradient_checkpointing.",
        "use_liger_kernel": "Liger kernels are not implemented.",
    }

    learning_rate: float = option(1e-6, "Initial AdamW learning rate.")
    disable_dropout: bool = option(True, "Set every dropout probability of the policy and reference to 0.")
    dataset_num_proc: int | None = option(None, "Processes used to tokenise the dataset.")
    max_length: int | None = option(1024, "Maximum tokens of prompt + completion; longer rows are truncated.")
    precompute_ref_log_probs: bool = option(False, "Compute every row's reference log-probs once before training.")
    precompute_ref_batch_size: int | None = option(None, "Precomputation batch size (None: the per-device one).")
    beta: float = option(0.1, "β: the strength of the tie to the reference model.")
    activation_offloading: bool = option(False, "Offload activations to the CPU.")
    # Fixed where the TRL config lacks these fields (KTO: rows keep their start, no WPO weights); DPOConfig has both.
    truncation_mode: ClassVar[str] = "keep_start"
    use_weighting: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length={self.max_length}: a row needs at least one prompt and one completion token."
            )
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError(
                "sync_ref_model=True with precompute_ref_log_probs=True: the reference changes during training, so "
                "precomputed reference log-probs would be stale. Set one of them to False."
            )

    def uses_reference_model(self) -> bool:
        return True


def preference_token_stats(with_sum_sq_probs: bool = False):
    """The per-token statistics TRL's preference trainers log (as a `logits_stats` function for
    `compute_token_logprobs`): the mean logit over the vocabulary, whether the token is the argmax, and, for WPO's
    weights, log Σ_v p_v²."""

    def stats(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"mean_logits": logits.mean(-1).float(), "is_top1": logits.argmax(-1) == targets}
        if with_sum_sq_probs:
            out["log_sum_sq_probs"] = torch.logsumexp(2 * logits.float().log_softmax(-1), dim=-1)
        return out

    return stats


class PreferenceTrainer(PolicyTrainerBase):
    """Base of the offline preference trainers (DPO, KTO). A subclass declares `paired` (chosen/rejected rows, or
    unpaired completion/label rows), `required_columns` and `signature_columns`, and implements
    `compute_policy_loss(model, inputs)` on a `PairedBatch` / `UnpairedBatch` and `reference_columns(batch)` (the
    reference log-probs stored per row when `precompute_ref_log_probs=True`)."""

    paired = True
    required_columns: ClassVar[list[tuple[str, ...]]] = []
    signature_columns: ClassVar[list[str]] = []
    loss_is_scaled_for_ga = False  # a per-micro-batch mean, as TRL's: the Trainer divides it by the GA steps

    def __init__(
        self,
        model,
        ref_model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
    ):
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        if ref_model is not None and ref_model is model:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object. Omit `ref_model` and a frozen copy is made."
            )
        super().__init__(
            model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            ref_model=ref_model,
            callbacks=callbacks,
            optimizers=optimizers,
            compute_metrics=compute_metrics,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

    def setup(self) -> None:
        self.beta = self.args.beta
        self.precompute_ref_logps = self.args.precompute_ref_log_probs
        if self.precompute_ref_logps:
            self.train_dataset = self._precompute(self.train_dataset, self.args.per_device_train_batch_size)
            self.eval_dataset = self._precompute_eval(self.eval_dataset)

    # ------------------------------------------------------------------ data
    def reference_is_policy(self) -> bool:
        """With precomputed reference log-probs and no ref_model, the untrained policy is the reference (no copy)."""
        return self.args.precompute_ref_log_probs

    def prepare_dataset(self, dataset, name: str):
        dataset = super().prepare_dataset(dataset, name)
        if dataset is None:
            return None
        self.check_columns(dataset, name)
        if self.args.precompute_ref_log_probs and isinstance(dataset, IterableDataset):
            raise ValueError(
                "`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a map-style "
                f"Dataset or set `precompute_ref_log_probs=False`. (The {name} dataset is streamed: its rows cannot "
                "be annotated once before training.)"
            )
        eos = get_tokenizer(self.processing_class).eos_token
        return prepare_preference_dataset(dataset, self.processing_class, self.args, name, self.paired, eos)

    def check_columns(self, dataset, name: str) -> None:
        """Raise, before training, when the rows lack the columns this trainer needs."""
        names = set(dataset_columns(dataset))
        if "prompt_ids" not in names and not any(set(option) <= names for option in self.required_columns):
            wanted = " or ".join("/".join(option) for option in self.required_columns)
            raise ValueError(
                f"The {name} dataset has columns {sorted(names)}, but {type(self).__name__} needs {wanted} "
                "(and optionally prompt). See the dataset formats in the docs."
            )

    def make_data_collator(self):
        collator = PairedCollator if self.paired else UnpairedCollator
        return collator(
            pad_token_id=get_tokenizer(self.processing_class).pad_token_id,
            max_length=self.args.max_length,
            truncation_mode=self.args.truncation_mode,
            pad_to_multiple_of=self.args.pad_to_multiple_of,
            processing_class=self.processing_class,
        )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = self._batch_columns()

    def _batch_columns(self) -> list[str]:
        """The columns the collator reads: the subclass's, and those of rows with images (`data/vision.py`)."""
        return [*self.signature_columns, "prompt_text", "images", "image", "videos", "video"]

    # ------------------------------------------------------------------ log-probs
    def completion_logps(self, model, sequences: SequenceBatch, stats: bool = False):
        """Per-token log-probs `(B, L - 1)` of `sequences.input_ids[:, 1:]` under `model` (temperature 1), zeroed
        outside the completion; with `stats`, the `TokenLogprobs` too (entropy, TRL's token statistics, aux loss)."""
        width = sequences.input_ids.size(1) - 1
        options = dict(self._logp_options(stats), padding_free=self.args.padding_free)  # docs/padding_free.md
        extra = sequences.model_inputs()  # image tensors and per-token inputs of vision-language rows
        router_logits = options["output_router_logits"]
        share = not self.args.padding_free and self.uses_shared_prefix(model, "log-prob forward", extra, router_logits)
        layout = SharedPromptLayout.build(sequences, self._pad_token_id()) if share else None
        tensors = (sequences.input_ids, sequences.attention_mask, width)
        if layout is None:
            options.update(use_cache=False, **extra)
        else:  # each distinct prompt encoded once (a pair's chosen and rejected rows share it)
            tensors = (layout.input_ids, layout.attention_mask, layout.targets.size(1))
            options.update(shared_prefix=True, position_ids=layout.position_ids)
        with self.accelerator.autocast():
            out = compute_token_logprobs(model, *tensors, **options)
        if layout is not None:
            out = out.map(lambda values: layout.scatter(values, width))
        logps = out.logps * sequences.completion_mask[:, 1:]
        return (logps, out) if stats else logps

    def _logp_options(self, stats: bool) -> dict:
        return dict(
            compute_entropy=stats,
            logits_stats=preference_token_stats(self.args.use_weighting) if stats else None,
            output_router_logits=stats and self.aux_loss_enabled,
            from_hidden_states=self.args.chunked_lm_head,
        )

    def completion_logps_and_detached(self, model, sequences: SequenceBatch, detached: SequenceBatch):
        """`completion_logps(model, sequences, stats=True)` and, without grad, `completion_logps(model, detached)`,
        where the rows of `detached` repeat the prompts of `sequences` (KTO's KL rows): each prompt is then encoded
        once for both (`compute_shared_logprobs`), else two passes. Returns `(logps, TokenLogprobs,
        detached_logps)`."""
        shared = self._shared_completion_logps(model, sequences, detached)
        if shared is not None:
            return shared
        logps, out = self.completion_logps(model, sequences, stats=True)
        with torch.no_grad():
            return logps, out, self.completion_logps(model, detached)

    def _shared_completion_logps(self, model, sequences: SequenceBatch, detached: SequenceBatch):
        joined = SequenceBatch.concat([sequences, detached], self._pad_token_id())
        options = self._logp_options(stats=True)
        router_logits = options.pop("output_router_logits")
        if self.args.padding_free or not self.uses_shared_prefix(
            model, "log-prob forward", joined.model_inputs(), router_logits=router_logits
        ):
            return None
        layout = SharedPromptLayout.build(joined, self._pad_token_id())
        if layout is None:
            return None
        with self.accelerator.autocast():
            result = compute_shared_logprobs(
                model, layout.input_ids, layout.attention_mask, layout.targets.size(1), len(detached),
                position_ids=layout.position_ids, **options,
            )  # fmt: skip
        if result is None:
            return None
        out, detached_logps = result
        width, first, second = joined.input_ids.size(1) - 1, slice(0, len(sequences)), slice(len(sequences), None)
        out = out.map(lambda values: layout.scatter(values, width, first)[:, : sequences.input_ids.size(1) - 1])
        detached_logps = layout.scatter(detached_logps, width, second)[:, : detached.input_ids.size(1) - 1]
        return out.logps * sequences.completion_mask[:, 1:], out, detached_logps * detached.completion_mask[:, 1:]

    def reference_completion_logps(self, *sequences: SequenceBatch) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Per-token reference log-probs of one batch, or of several in one forward (rows of different batches that
        share a prompt then encode it once: KTO's completion and KL rows), returned per batch."""
        joined = sequences[0] if len(sequences) == 1 else SequenceBatch.concat(sequences, self._pad_token_id())
        with torch.no_grad(), self.reference_model.use(self.accelerator, self.model) as ref_model:
            logps = self.completion_logps(ref_model, joined)
        if len(sequences) == 1:
            return logps
        parts = logps.split([len(b) for b in sequences])
        return tuple(part[:, : b.input_ids.size(1) - 1] for part, b in zip(parts, sequences, strict=True))

    def _pad_token_id(self) -> int:
        return get_tokenizer(self.processing_class).pad_token_id or 0

    def reference_columns(self, batch: PairedBatch | UnpairedBatch) -> dict[str, torch.Tensor]:
        """The reference log-probs stored per row by `precompute_ref_log_probs`: `{column: (B,) tensor}`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ precomputed reference log-probs
    def _precompute(self, dataset, batch_size: int):
        if dataset is None or any(name.startswith("ref_") for name in column_names(dataset) or []):
            return dataset
        loader = DataLoader(
            dataset.select_columns([c for c in self._batch_columns() if c in dataset.column_names]),
            batch_size=self.args.precompute_ref_batch_size or batch_size,
            collate_fn=self.data_collator,
            shuffle=False,
        )
        columns: dict[str, list[torch.Tensor]] = {}
        for batch in self.accelerator.prepare(loader):  # each process scores its share; gathered in order
            for key, values in self.reference_columns(batch.to(self.args.device)).items():
                columns.setdefault(key, []).append(self.accelerator.gather_for_metrics(values).float().cpu())
        for key, values in columns.items():
            dataset = dataset.add_column(key, torch.cat(values).tolist())
        return dataset

    def _precompute_eval(self, eval_dataset):
        size = self.args.per_device_eval_batch_size
        if isinstance(eval_dataset, dict):
            return {k: self._precompute(v, size) for k, v in eval_dataset.items()}
        return self._precompute(eval_dataset, size)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """As TRL: a dataset passed here is prepared like the init-time ones (and gets its reference log-probs)."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            if self.precompute_ref_logps and self.reference_model.kind == "policy" and self.state.global_step > 0:
                raise ValueError(
                    "Cannot compute reference log-probs for a dataset passed to evaluate() after training started: "
                    "precompute_ref_log_probs=True and no ref_model was given, so the reference was the untrained "
                    "policy. Pass this dataset as eval_dataset at init, pass a ref_model, or set "
                    "precompute_ref_log_probs=False."
                )
            eval_dataset = self._prepare_eval_datasets(eval_dataset)
            if self.precompute_ref_logps:
                eval_dataset = self._precompute_eval(eval_dataset)
        if isinstance(eval_dataset, dict):  # one evaluate per split, each already prepared
            metrics = {}
            for key, dataset in eval_dataset.items():
                metrics.update(super().evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{key}"))
            return metrics
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def prediction_outputs(self, model, inputs, outputs):
        """For `compute_metrics`, as TRL: the logits of an extra forward over the batch's sequences, and their ids."""
        sequences = inputs.sequences
        with torch.no_grad(), self.accelerator.autocast():
            logits = model(
                input_ids=sequences.input_ids, attention_mask=sequences.attention_mask, **sequences.model_inputs()
            ).logits
        return logits, sequences.input_ids

    # ------------------------------------------------------------------ shared metrics
    def log_sequence_metrics(self, sequences: SequenceBatch, out: TokenLogprobs, rows: dict[str, torch.Tensor]):
        """TRL's shared preference metrics: entropy, num_tokens, logits/<group> (mean logit over the vocabulary, per
        completion token) for each group of `rows` (`{"chosen": row_mask, "rejected": row_mask}`)."""
        gather = self.accelerator.gather_for_metrics
        mask = sequences.completion_mask[:, 1:].float()
        tokens = gather(mask.sum()).sum()
        entropy = gather((out.entropy * mask).sum()).sum()
        self.log_metric("entropy", (entropy / tokens).item() if tokens > 0 else 0.0)
        if self.model.training:
            self.state.num_input_tokens_seen += int(gather(sequences.attention_mask.sum()).sum().item())
        self.log_metric("num_tokens", self.state.num_input_tokens_seen)
        for group, row_mask in rows.items():
            group_mask = mask * row_mask.float()[:, None]
            count = gather(group_mask.sum()).sum()
            if count > 0:
                total = gather((out.stats["mean_logits"] * group_mask).sum()).sum()
                self.log_metric(f"logits/{group}", (total / count).item())
