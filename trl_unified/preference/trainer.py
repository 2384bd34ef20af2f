"""The offline preference core that DPO, KTO, ORPO, CPO and TPO share: config fields, sequence log-probs of
completions (decoder-only or encoder-decoder policies), the shared metrics, and, for the losses that read one,
reference log-probs (on the fly or precomputed once) through `ReferenceModel`; data preparation is in `data.py`, the
loss formulas in `losses.py`."""

import functools
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from datasets import IterableDataset
from torch.utils.data import DataLoader
from transformers import is_comet_available, is_wandb_available

from ..core.config import PolicyConfig, option
from ..core.logprobs import (
    TokenLogprobs,
    compute_decoder_logprobs,
    compute_shared_logprobs,
    compute_token_logprobs,
    shift_right,
)
from ..core.trainer import PolicyTrainerBase
from ..data.datasets import column_names, dataset_columns
from ..models.loading import base_model, get_tokenizer
from .data import (
    EncoderDecoderSequences,
    PairedBatch,
    PairedCollator,
    SequenceBatch,
    SharedPromptLayout,
    UnpairedBatch,
    UnpairedCollator,
)
from .formats import TokenisationOptions, prepare_preference_dataset


logger = logging.getLogger(__name__)


@dataclass
class PreferenceConfig(PolicyConfig):
    """The fields TRL's preference configs share (`DPOConfig`, `KTOConfig`, and the experimental `ORPOConfig`,
    `CPOConfig`, `TPOConfig`, 1.16), with TRL's names and defaults. A loss that reads no reference model (ORPO, CPO,
    TPO) uses this config as it is: no reference is built; `ReferencePreferenceConfig` adds the reference fields."""

    _unimplemented_fields: ClassVar[dict[str, str]] = {
        "activation_offloading": "Activation offloading to the CPU is not implemented; use gradient_checkpointing.",
        "use_liger_kernel": "Liger kernels are not implemented.",
    }

    learning_rate: float = option(1e-6, "Initial AdamW learning rate.")
    disable_dropout: bool = option(True, "Set every dropout probability of the policy and reference to 0.")
    dataset_num_proc: int | None = option(None, "Processes used to tokenise the dataset.")
    max_length: int | None = option(1024, "Maximum tokens of prompt + completion; longer rows are truncated.")
    beta: float = option(0.1, "β: the strength of the tie to the reference model.")
    activation_offloading: bool = option(False, "Offload activations to the CPU.")
    # Fixed where the TRL config lacks these fields (KTO: rows keep their start, no WPO weights, the tokenizer's pad
    # token; reference-free losses: nothing to precompute); the configs that have them declare them as fields.
    truncation_mode: ClassVar[str] = "keep_start"
    use_weighting: ClassVar[bool] = False
    padding_value: ClassVar[int | None] = None
    precompute_ref_log_probs: ClassVar[bool] = False
    precompute_ref_batch_size: ClassVar[int | None] = None
    is_encoder_decoder: ClassVar[bool | None] = None
    generate_during_eval: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length={self.max_length}: a row needs at least one prompt and one completion token."
            )

    def completion_token_limit(self) -> int | None:
        """Completion tokens kept per row when tokenising (None: all; TRL's ORPO and CPO: `max_completion_length`)."""
        return None

    def _no_reference_reason(self) -> str:
        return "this preference loss reads no reference model"


@dataclass
class ReferencePreferenceConfig(PreferenceConfig):
    """`PreferenceConfig` of a loss that reads a frozen reference model (DPO, KTO): its log-probs on the fly, or
    precomputed once before training."""

    precompute_ref_log_probs: bool = option(False, "Compute every row's reference log-probs once before training.")
    precompute_ref_batch_size: int | None = option(None, "Precomputation batch size (None: the per-device one).")

    def __post_init__(self):
        super().__post_init__()
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
    """Base of the offline preference trainers (DPO, KTO, ORPO, CPO, TPO). A subclass declares `paired` (rows with
    `completion_keys` completions each, or unpaired completion/label rows), `required_columns` and
    `signature_columns` (and `legacy_format` for the conventions of TRL's ORPO and CPO trainers), and implements
    `compute_policy_loss(model, inputs)` on a `PairedBatch` / `UnpairedBatch`; a loss that reads a reference model
    also implements `reference_columns(batch)` (the reference log-probs stored per row when
    `precompute_ref_log_probs=True`). Whether a reference model is built is the config's answer
    (`uses_reference_model()`): a reference-free config builds, loads and prepares none."""

    paired = True
    completion_keys: ClassVar[tuple[str, ...]] = ("chosen", "rejected")
    # TRL's ORPO and CPO conventions: their tokenisation and columns (`preference.formats.split_legacy`), and the two
    # numbers (eval logits/chosen, logits/rejected) their `compute_metrics` receives per batch
    legacy_format = False
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
        self._build(
            model,
            ref_model=ref_model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

    def _build(self, model, ref_model=None, **kwargs):
        """The constructor every preference trainer's signature (TRL's, per trainer) ends in."""
        if kwargs.get("train_dataset") is None:
            raise ValueError("`train_dataset` is required")
        if ref_model is not None and ref_model is model:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object. Omit `ref_model` and a frozen copy is made."
            )
        super().__init__(model, ref_model=ref_model, **kwargs)

    @functools.cached_property
    def is_encoder_decoder(self) -> bool:
        """TRL's attribute: the policy is an encoder-decoder model (prompts to the encoder, completions as the
        decoder's targets), learned once from its config."""
        return bool(getattr(base_model(self.model).config, "is_encoder_decoder", False))

    def setup(self) -> None:
        stated = self.args.is_encoder_decoder
        if stated is not None and stated != self.is_encoder_decoder:
            raise ValueError(
                f"is_encoder_decoder={stated}, but the model is {'an' if self.is_encoder_decoder else 'not an'} "
                "encoder-decoder model. Leave is_encoder_decoder unset: it is read from the model's config."
            )
        if self.args.generate_during_eval and not (is_wandb_available() or is_comet_available()):
            raise ValueError(
                "`generate_during_eval=True` requires Weights and Biases or Comet to be installed. Please install "
                "`wandb` or `comet-ml` to resolve."
            )
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
        return prepare_preference_dataset(dataset, self.processing_class, self.args, name, self.tokenisation_options())

    def tokenisation_options(self) -> TokenisationOptions:
        """How rows are tokenised: the completion keys, paired or not, the policy's kind, the completion limit."""
        limit = self.args.completion_token_limit()
        if self.is_encoder_decoder and limit is None:
            logger.warning(
                "When using an encoder decoder architecture, you should set `max_completion_length` in the config's "
                "init; it will default to `128` (as TRL)."
            )
            limit = 128
        return TokenisationOptions(
            keys=self.completion_keys,
            paired=self.paired,
            encoder_decoder=self.is_encoder_decoder,
            max_completion_length=limit,
            legacy=self.legacy_format,
        )

    def check_columns(self, dataset, name: str) -> None:
        """Raise, before training, when the rows lack the columns this trainer needs."""
        names = set(dataset_columns(dataset))
        tokenised = {"prompt_ids", "prompt_input_ids"} & names
        if not tokenised and not any(set(option) <= names for option in self.required_columns):
            wanted = " or ".join("/".join(option) for option in self.required_columns)
            raise ValueError(
                f"The {name} dataset has columns {sorted(names)}, but {type(self).__name__} needs {wanted} "
                "(and optionally prompt). See the dataset formats in the docs."
            )

    def collated_completions(self) -> tuple[str, ...]:
        """The completion keys a batch carries, one block of rows each (TPO leaves out an unused `reference`)."""
        return self.completion_keys

    def make_data_collator(self):
        options = dict(
            pad_token_id=self._pad_token_id(),
            max_length=self.args.max_length,
            truncation_mode=self.args.truncation_mode,
            pad_to_multiple_of=self.args.pad_to_multiple_of,
            processing_class=self.processing_class,
            encoder_decoder=self.is_encoder_decoder,
        )
        if self.paired:
            return PairedCollator(**options, completions=self.collated_completions())
        return UnpairedCollator(**options)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = self._batch_columns()

    def _batch_columns(self) -> list[str]:
        """The columns the collator reads: the subclass's, the tokenised prompt and completions (either layout), and
        those of rows with images (`data/vision.py`)."""
        keys = self.completion_keys if self.paired else ("completion",)
        completions = [f"{key}_{part}" for key in keys for part in ("ids", "input_ids", "labels")]
        tokenised = ["prompt_ids", "prompt_input_ids", *completions]
        return [*self.signature_columns, *tokenised, "prompt_text", "images", "image", "videos", "video"]

    # ------------------------------------------------------------------ log-probs
    def completion_logps(self, model, sequences, stats: bool = False, include_prompt: bool = False):
        """Per-token log-probs of the predicted tokens under `model` (temperature 1), zeroed outside
        `sequences.token_mask(include_prompt)`: `(B, L - 1)` for decoder-only rows (predicting `input_ids[:, 1:]`),
        `(B, C)` for encoder-decoder rows. With `stats`, the `TokenLogprobs` too (entropy, TRL's token statistics,
        aux loss; over the completion tokens). `include_prompt` scores the prompt tokens too (ORPO's NLL): from the
        shared prompt pass, once per prompt, where prompts are shared."""
        if isinstance(sequences, EncoderDecoderSequences):
            out = self._decoder_logps(model, sequences, stats)
            return (out.logps * sequences.token_mask(), out) if stats else out.logps * sequences.token_mask()
        width = sequences.input_ids.size(1) - 1
        options = dict(self._logp_options(stats), padding_free=self.args.padding_free)  # docs/padding_free.md
        extra = sequences.model_inputs()  # image tensors and per-token inputs of vision-language rows
        router_logits = options["output_router_logits"]
        share = not self.args.padding_free and self.uses_shared_prefix(model, "log-prob forward", extra, router_logits)
        layout = SharedPromptLayout.build(sequences, self._pad_token_id()) if share else None
        if layout is None:  # every position of each row scored: the prompt's too
            with self.accelerator.autocast():
                out = compute_token_logprobs(
                    model, sequences.input_ids, sequences.attention_mask, width, use_cache=False, **options, **extra
                )
            logps = out.logps
        else:  # each distinct prompt encoded once (the rows of one preference row share it)
            with self.accelerator.autocast():
                out = compute_token_logprobs(
                    model,
                    layout.input_ids,
                    layout.attention_mask,
                    layout.targets.size(1),
                    shared_prefix=True,
                    position_ids=layout.position_ids,
                    score_prompt=include_prompt,
                    **options,
                )
            out = out.map(lambda values: layout.scatter(values, width))
            logps = out.logps
            if include_prompt:
                logps = logps + layout.scatter_prompt(out.prompt_logps, width)
        logps = logps * sequences.token_mask(include_prompt)
        return (logps, out) if stats else logps

    def _decoder_logps(self, model, sequences: EncoderDecoderSequences, stats: bool) -> TokenLogprobs:
        options = self._logp_options(stats)
        with self.accelerator.autocast():
            return compute_decoder_logprobs(
                model,
                sequences.input_ids,
                sequences.attention_mask,
                sequences.labels,
                base_model(self.accelerator.unwrap_model(model)).config.decoder_start_token_id,
                compute_entropy=options["compute_entropy"],
                output_router_logits=options["output_router_logits"],
                logits_stats=options["logits_stats"],
            )

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
                model,
                layout.input_ids,
                layout.attention_mask,
                layout.targets.size(1),
                len(detached),
                position_ids=layout.position_ids,
                **options,
            )
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
        """The id rows are padded with: `args.padding_value` where the config has it (ORPO), else the tokenizer's."""
        if self.args.padding_value is not None:
            return self.args.padding_value
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
        if self.args.generate_during_eval:
            named = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
            target = named if named is not None else self.eval_dataset
            for dataset in target.values() if isinstance(target, dict) else [target]:
                self.log_eval_generations(dataset)
        if isinstance(eval_dataset, dict):  # one evaluate per split, each already prepared
            metrics = {}
            for key, dataset in eval_dataset.items():
                metrics.update(super().evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{key}"))
            return metrics
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def prediction_outputs(self, model, inputs, outputs):
        """For `compute_metrics`, as TRL's DPO: the logits of an extra forward over the batch's sequences, and their
        token ids (encoder-decoder rows: the decoder's logits and targets). `legacy_format` (TRL's ORPO and CPO): the
        batch's logits/chosen and logits/rejected metrics, and zeros as labels."""
        if self.legacy_format:
            logged = self._metrics["eval"]
            logits = torch.tensor(
                [logged["logits/chosen"][-1], logged["logits/rejected"][-1]], device=self.args.device
            )
            return logits, torch.zeros(2, device=self.args.device)
        sequences = inputs.sequences
        extra, labels = sequences.model_inputs(), sequences.input_ids
        if isinstance(sequences, EncoderDecoderSequences):
            start = base_model(self.accelerator.unwrap_model(model)).config.decoder_start_token_id
            extra, labels = {"decoder_input_ids": shift_right(sequences.labels, start)}, sequences.labels
        with torch.no_grad(), self.accelerator.autocast():
            logits = model(input_ids=sequences.input_ids, attention_mask=sequences.attention_mask, **extra).logits
        return logits, labels

    def log_eval_generations(self, dataset) -> None:
        """TRL's `generate_during_eval`: sample the policy on a random eval batch of prompts and log the table
        (Prompt, Policy) to W&B (`game_log`) and Comet (`game_log.csv`)."""
        rows = dataset.shuffle(seed=self.state.global_step).select(range(min(len(dataset), self.args.eval_batch_size)))
        prompts = list(rows["prompt"])
        texts = self.generate(prompts, do_sample=True).texts
        data = [[prompt if isinstance(prompt, str) else str(prompt), text] for prompt, text in zip(prompts, texts)]
        if "wandb" in self.args.report_to and self.accelerator.is_main_process:
            import wandb

            if wandb.run is not None:
                wandb.log({"game_log": wandb.Table(columns=["Prompt", "Policy"], data=data)})
        if "comet_ml" in self.args.report_to and self.accelerator.is_main_process:
            import comet_ml
            import pandas as pd

            experiment = comet_ml.get_running_experiment()
            if experiment is not None:
                experiment.log_table("game_log.csv", tabular_data=pd.DataFrame(data, columns=["Prompt", "Policy"]))

    # ------------------------------------------------------------------ shared metrics
    def log_sequence_metrics(self, sequences, out: TokenLogprobs, rows: dict[str, torch.Tensor]):
        """TRL's shared preference metrics: entropy, num_tokens, logits/<group> (mean logit over the vocabulary, per
        completion token) for each group of `rows` (`{"chosen": row_mask, "rejected": row_mask}`)."""
        gather = self.accelerator.gather_for_metrics
        mask = sequences.token_mask().float()
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

    def log_reward_metrics(self, rewards_w, rewards_l, logps_w, logps_l) -> None:
        """TRL's pair metrics, over all processes: rewards/chosen, rewards/rejected (the implicit rewards of each
        pair's two completions, `(B,)`), rewards/accuracies (how often the chosen one's is higher), rewards/margins,
        logps/chosen, logps/rejected (the sequence log-probs the loss read, `(B,)`)."""
        gather = self.accelerator.gather_for_metrics
        r_w, r_l = gather(rewards_w.detach()), gather(rewards_l.detach())
        for name, value in (("chosen", r_w), ("rejected", r_l), ("accuracies", r_w > r_l), ("margins", r_w - r_l)):
            self.log_metric(f"rewards/{name}", value.float().mean().item())
        self.log_metric("logps/chosen", gather(logps_w.detach()).float().mean().item())
        self.log_metric("logps/rejected", gather(logps_l.detach()).float().mean().item())

    def log_token_accuracy(self, out: TokenLogprobs, mask: torch.Tensor) -> None:
        """TRL's mean_token_accuracy: the share of the tokens under `mask` (the chosen completions') that are the
        model's argmax, over all processes."""
        gather = self.accelerator.gather_for_metrics
        mask = mask.bool()
        correct = gather((out.stats["is_top1"][: mask.size(0)] & mask).sum()).sum()
        total = gather(mask.sum()).sum()
        self.log_metric("mean_token_accuracy", (correct / total).item() if total > 0 else 0.0)


def init_without_reference(
    self,
    model=None,
    args=None,
    data_collator=None,
    train_dataset=None,
    eval_dataset=None,
    processing_class=None,
    model_init=None,
    callbacks=None,
    optimizers=(None, None),
    preprocess_logits_for_metrics=None,
    peft_config=None,
    compute_metrics=None,
    quantization_config=None,
):
    """The constructor of TRL's `ORPOTrainer` and `CPOTrainer` 1.16, argument for argument (then, by keyword, the
    policy's `quantization_config`, as DPO's): a trainer sets `__init__ = init_without_reference`. TRL's
    `model_init` (a model built per hyper-parameter trial) is not implemented: pass `model`."""
    if model_init is not None:
        raise NotImplementedError(
            "model_init (a model re-built for each hyper-parameter search trial) is not implemented in trl_unified. "
            "Pass the model itself: model=model_init()."
        )
    if model is None:
        raise ValueError("`model` is required: a model id, a path or a PreTrainedModel.")
    PreferenceTrainer._build(
        self,
        model,
        args=args,
        data_collator=data_collator,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processing_class,
        compute_metrics=compute_metrics,
        callbacks=callbacks,
        optimizers=optimizers,
        quantization_config=quantization_config,
        peft_config=peft_config,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )
