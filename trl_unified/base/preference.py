"""Offline preference training, shared by DPO and KTO: config fields, data preparation, the collator, sequence
log-probs of completions, and reference log-probs (on the fly or precomputed once) through `ReferenceModel`.

Data (TRL's formats): standard or conversational rows, with an explicit `prompt` or an implicit one (the common
start of `chosen` and `rejected`, split off with `trl.extract_prompt`). Paired rows have `chosen`/`rejected`;
unpaired rows have `completion`/`label` (KTO; paired data is unpaired with `trl.unpair_preference_dataset`).
Tokenisation follows TRL: the prompt alone (with the generation prompt for conversations) and prompt + completion are
tokenised, and the completion starts where the two diverge; a standard (text) completion gets the EOS token appended.
Rows whose prompt alone fills `max_length` are dropped (as TRL), with a warning naming how many; the collator
truncates each prompt + completion to `max_length`.
"""

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader
from trl import extract_prompt, is_conversational, unpair_preference_dataset

from .config import PolicyConfig
from .data import column_names, pad
from .generation import get_tokenizer
from .logprobs import compute_token_logprobs
from .trainer import PolicyTrainerBase


logger = logging.getLogger(__name__)


@dataclass
class PreferenceConfig(PolicyConfig):
    """The fields `trl.DPOConfig` and `trl.KTOConfig` (1.16) share, with TRL's names and defaults."""

    _unimplemented_fields: ClassVar[dict[str, str]] = {
        "activation_offloading": "Activation offloading to the CPU is not implemented; use gradient_checkpointing.",
        "use_liger_kernel": "Liger kernels are not implemented.",
    }

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    disable_dropout: bool = field(
        default=True, metadata={"help": "Set every dropout probability of the policy and reference to 0."}
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the MoE load-balancing loss. None uses the model config's value; 0.0 disables it."
        },
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used to tokenise the dataset."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum tokens of prompt + completion; longer rows are truncated."}
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto", metadata={"help": "Pad batches to a multiple of this. 'auto': 128 on Neuron, else none."}
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute the reference log-probs of every row once before training, then drop the forward."},
    )
    precompute_ref_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size of the precomputation. None: the per-device train / eval batch size."},
    )
    beta: float = field(default=0.1, metadata={"help": "β: the strength of the tie to the reference model."})
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to the CPU."})
    sync_ref_model: bool = field(
        default=False, metadata={"help": "Every ref_model_sync_steps, set π_ref = α π_θ + (1 - α) π_ref (TR-DPO)."}
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "α of the reference-model sync (TR-DPO)."})
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "τ, steps between reference-model syncs (TR-DPO)."}
    )

    def __post_init__(self):
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":  # from the command line
            lowered = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if lowered in ("none", "null") else int(self.pad_to_multiple_of)
        super().__post_init__()
        if self.pad_to_multiple_of == "auto":  # Neuron compiles once per shape
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length={self.max_length}: a row needs at least one prompt and one completion token."
            )
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError(
                "sync_ref_model=True with precompute_ref_log_probs=True: the reference changes during training, so "
                "precomputed reference log-probs would be stale. Set one of them to False."
            )


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        length += 1
    return length


def tokenize(processing_class, value, **template_kwargs) -> list[int]:
    """Token ids of a text (tokenizer call) or a conversation (chat template)."""
    if isinstance(value, list):
        return list(
            processing_class.apply_chat_template(value, tokenize=True, return_dict=True, **template_kwargs)[
                "input_ids"
            ]
        )
    return list(processing_class(text=value)["input_ids"])


def split_completions(row: dict, processing_class, keys: tuple[str, ...]) -> dict[str, list[int]]:
    """`prompt_ids` and one `<key>_ids` per completion key. The completion starts where the tokenised prompt and the
    tokenised prompt + completion diverge (a chat template may render a prompt alone differently)."""
    template_kwargs = dict(row.get("chat_template_kwargs") or {})
    if row.get("tools") is not None:
        template_kwargs["tools"] = row["tools"]
    conversational = isinstance(row["prompt"], list)
    prompt_ids = tokenize(
        processing_class,
        row["prompt"],
        **template_kwargs,
        **({"add_generation_prompt": True} if conversational else {}),
    )
    full = {key: tokenize(processing_class, row["prompt"] + row[key], **template_kwargs) for key in keys}
    prompt_len = min(common_prefix_length(prompt_ids, ids) for ids in full.values())
    if prompt_len < len(prompt_ids):
        logger.warning(
            "The tokenised prompt is not a prefix of the tokenised prompt + completion (chat template or a token "
            f"merging across the boundary); the completion starts where they diverge, dropping "
            f"{processing_class.decode(prompt_ids[prompt_len:])!r} from the prompt, as TRL does."
        )
    out = {"prompt_ids": prompt_ids[:prompt_len]}
    out.update({f"{key}_ids": ids[prompt_len:] for key, ids in full.items()})
    return out


def prepare_preference_dataset(dataset, processing_class, args, name: str, paired: bool, eos_token: str):
    """TRL's preparation of a preference dataset (see the module docstring). Idempotent: tokenised data is returned
    as is. `paired=False` unpairs `chosen`/`rejected` rows into `completion`/`label` rows."""
    if dataset is None or "prompt_ids" in (column_names(dataset) or next(iter(dataset)).keys()):
        return dataset
    map_kwargs = {"num_proc": args.dataset_num_proc} if isinstance(dataset, Dataset) else {}
    first = next(iter(dataset))
    if "prompt" not in first:
        dataset = dataset.map(extract_prompt, **map_kwargs)
    if not paired and "chosen" in first:
        dataset = unpair_preference_dataset(dataset, **map_kwargs)
    keys = ("chosen", "rejected") if paired else ("completion",)
    if not is_conversational(next(iter(dataset))):

        def add_eos(row):
            return {key: row[key] if row[key].endswith(eos_token) else row[key] + eos_token for key in keys}

        dataset = dataset.map(add_eos, **map_kwargs)
    dataset = dataset.map(
        split_completions, fn_kwargs={"processing_class": processing_class, "keys": keys}, **map_kwargs
    )
    if args.max_length is not None and getattr(args, "truncation_mode", "keep_start") == "keep_start":
        before = len(dataset) if isinstance(dataset, Dataset) else None
        dataset = dataset.filter(lambda row: len(row["prompt_ids"]) < args.max_length, **map_kwargs)
        if before is not None and len(dataset) < before:
            if len(dataset) == 0:
                raise ValueError(
                    f"Every row of the {name} dataset has a prompt of max_length={args.max_length} tokens or more, "
                    "so no completion token would remain. Raise max_length or shorten the prompts."
                )
            logger.warning(
                f"{before - len(dataset)} of {before} rows of the {name} dataset were dropped: their prompt alone "
                f"fills max_length={args.max_length}, leaving no completion token (as TRL does). Raise max_length "
                "to keep them."
            )
    return dataset


def pack(prompts, completions, pad_token_id, max_length, truncation_mode="keep_start", pad_to_multiple_of=None):
    """Prompt + completion rows, truncated to `max_length` and right-padded: `input_ids`, `attention_mask` and
    `completion_mask` (1 on completion tokens)."""
    ids = [p + c for p, c in zip(prompts, completions, strict=True)]
    masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions, strict=True)]
    if max_length is not None:
        keep = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
        ids, masks = [row[keep] for row in ids], [row[keep] for row in masks]

    def padded(rows, value):
        return pad([torch.tensor(r, dtype=torch.long) for r in rows], value, "right", pad_to_multiple_of)

    return {
        "input_ids": padded(ids, pad_token_id),
        "attention_mask": padded([[1] * len(r) for r in ids], 0),
        "completion_mask": padded(masks, 0),
    }


@dataclass
class PreferenceCollator:
    """Paired rows: chosen rows then rejected rows, stacked for one forward (`2B` rows). Unpaired rows: the
    completions, the `label` tensor, and the mismatched `KL_` sequences when the rows have `KL_completion_ids`.
    Precomputed reference columns (`ref_*`) are passed through as tensors."""

    pad_token_id: int
    paired: bool = True
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        args = (self.pad_token_id, self.max_length, self.truncation_mode, self.pad_to_multiple_of)
        prompts = [row["prompt_ids"] for row in rows]
        if self.paired:
            completions = [row["chosen_ids"] for row in rows] + [row["rejected_ids"] for row in rows]
            batch = pack(prompts + prompts, completions, *args)
        else:
            batch = pack(prompts, [row["completion_ids"] for row in rows], *args)
            batch["label"] = torch.tensor([bool(row["label"]) for row in rows])
            if "KL_completion_ids" in rows[0]:
                kl = pack(prompts, [row["KL_completion_ids"] for row in rows], *args)
                batch.update({f"KL_{key}": value for key, value in kl.items()})
        for key in rows[0]:
            if key.startswith("ref_"):
                batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
        return batch


class PreferenceTrainer(PolicyTrainerBase):
    """Base of the offline preference trainers (DPO, KTO). A subclass sets `paired`, `required_columns` and
    `signature_columns`, and implements `compute_policy_loss` and `reference_columns` (the reference log-probs it
    stores per row when `precompute_ref_log_probs=True`)."""

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
        if compute_metrics is not None:
            raise NotImplementedError(
                "compute_metrics is not supported by the preference trainers: it needs the eval logits, which TRL "
                "1.16 deprecates for DPO/KTO. The preference metrics (eval_rewards/*, eval_logps/*) and generative "
                "accuracy (eval_accuracy, for eval rows with an answer column) are logged without it."
            )
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
        self.beta = self.args.beta
        self.precompute_ref_logps = self.args.precompute_ref_log_probs
        self._setup_aux_loss()
        self.sync_reference_every_steps()
        if self.precompute_ref_logps:
            self.train_dataset = self._precompute(self.train_dataset, "train", self.args.per_device_train_batch_size)
            self.eval_dataset = self._precompute_eval(self.eval_dataset)

    # ------------------------------------------------------------------ data
    def needs_reference(self, args) -> bool:
        return True

    def reference_is_policy(self, args) -> bool:
        """With precomputed reference log-probs and no ref_model, the untrained policy is the reference (no copy)."""
        return args.precompute_ref_log_probs

    def prepare_dataset(self, dataset, processing_class, args, name: str):
        if dataset is None:
            return None
        if isinstance(dataset, dict):
            return {k: self.prepare_dataset(v, processing_class, args, k) for k, v in dataset.items()}
        self.check_columns(dataset, name)
        eos = get_tokenizer(processing_class).eos_token
        return prepare_preference_dataset(dataset, processing_class, args, name, self.paired, eos)

    def check_columns(self, dataset, name: str) -> None:
        """Raise, before training, when the rows lack the columns this trainer needs."""
        if not isinstance(dataset, (Dataset, IterableDataset)):
            raise TypeError(
                f"`{name}_dataset` must be a `Dataset` or `IterableDataset`, got `{type(dataset).__name__}`."
            )
        names = set(column_names(dataset) or next(iter(dataset)).keys())
        if "prompt_ids" in names:
            return
        if names & {"image", "images"}:
            raise NotImplementedError(
                f"The {name} dataset has an image column: vision-language preference rows are not implemented in "
                f"trl_unified's {type(self).__name__} yet. Use trl's trainer for them, or drop the images."
            )
        if not any(set(option) <= names for option in self.required_columns):
            wanted = " or ".join("/".join(option) for option in self.required_columns)
            raise ValueError(
                f"The {name} dataset has columns {sorted(names)}, but {type(self).__name__} needs {wanted} "
                "(and optionally prompt). See the dataset formats in the docs."
            )

    def make_data_collator(self, processing_class, args):
        return PreferenceCollator(
            pad_token_id=get_tokenizer(processing_class).pad_token_id,
            paired=self.paired,
            max_length=args.max_length,
            truncation_mode=getattr(args, "truncation_mode", "keep_start"),
            pad_to_multiple_of=args.pad_to_multiple_of,
        )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(self.signature_columns)

    # ------------------------------------------------------------------ log-probs
    def completion_logps(self, model, batch, prefix: str = "", stats: bool = False):
        """Per-token log-probs `(B, L - 1)` of `batch[prefix + "input_ids"][:, 1:]` under `model` (temperature 1),
        zeroed outside the completion; with `stats`, the `TokenLogprobs` (entropy, mean logits, top-1 flags) too."""
        input_ids = batch[f"{prefix}input_ids"]
        mask = batch[f"{prefix}completion_mask"][:, 1:]
        with self.accelerator.autocast():
            out = compute_token_logprobs(
                model,
                input_ids,
                batch[f"{prefix}attention_mask"],
                input_ids.size(1) - 1,
                compute_entropy=stats,
                token_stats=stats,
                sum_sq_probs=stats and getattr(self.args, "use_weighting", False),
                output_router_logits=stats and self._aux_loss_coef != 0.0,
                use_cache=False,
            )
        logps = out.logps * mask
        return (logps, out) if stats else logps

    def reference_completion_logps(self, batch, prefix: str = "") -> torch.Tensor:
        with torch.no_grad(), self.reference.use(self.accelerator, self.model) as ref_model:
            return self.completion_logps(ref_model, batch, prefix)

    def reference_columns(self, batch) -> dict[str, torch.Tensor]:
        """The reference log-probs stored per row by `precompute_ref_log_probs`: `{column: (B,) tensor}`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ precomputed reference log-probs
    def _precompute(self, dataset, name: str, batch_size: int):
        if dataset is None or any(name.startswith("ref_") for name in column_names(dataset) or []):
            return dataset
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                "precompute_ref_log_probs=True needs a map-style Dataset; the rows of an IterableDataset cannot be "
                "annotated once before training. Pass a Dataset or set precompute_ref_log_probs=False."
            )
        loader = DataLoader(
            dataset.select_columns([c for c in self.signature_columns if c in dataset.column_names]),
            batch_size=self.args.precompute_ref_batch_size or batch_size,
            collate_fn=self.data_collator,
            shuffle=False,
        )
        columns: dict[str, list[torch.Tensor]] = {}
        for batch in self.accelerator.prepare(loader):  # each process scores its share; gathered in order
            for key, values in self.reference_columns(batch).items():
                columns.setdefault(key, []).append(self.accelerator.gather_for_metrics(values).float().cpu())
        for key, values in columns.items():
            dataset = dataset.add_column(key, torch.cat(values).tolist())
        return dataset

    def _precompute_eval(self, eval_dataset):
        size = self.args.per_device_eval_batch_size
        if isinstance(eval_dataset, dict):
            return {k: self._precompute(v, k, size) for k, v in eval_dataset.items()}
        return self._precompute(eval_dataset, "eval", size)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """As TRL: a dataset passed here is prepared like the init-time ones (and gets its reference log-probs)."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            if self.precompute_ref_logps and self.reference.kind == "policy" and self.state.global_step > 0:
                raise ValueError(
                    "Cannot compute reference log-probs for a dataset passed to evaluate() after training started: "
                    "precompute_ref_log_probs=True and no ref_model was given, so the reference was the untrained "
                    "policy. Pass this dataset as eval_dataset at init, pass a ref_model, or set "
                    "precompute_ref_log_probs=False."
                )
            eval_dataset = self.prepare_dataset(eval_dataset, self.processing_class, self.args, "eval")
            if self.precompute_ref_logps:
                eval_dataset = self._precompute_eval(eval_dataset)
        if isinstance(eval_dataset, dict):  # one evaluate per split, each already prepared
            metrics = {}
            for key, dataset in eval_dataset.items():
                metrics.update(super().evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{key}"))
            return metrics
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------ shared metrics
    def log_sequence_metrics(self, batch, out, rows: dict[str, torch.Tensor]) -> None:
        """TRL's shared preference metrics: entropy, num_tokens, logits/<group> (mean logit over the vocabulary, per
        completion token) for each group of `rows` (`{"chosen": row_mask, "rejected": row_mask}`)."""
        gather = self.accelerator.gather_for_metrics
        mask = batch["completion_mask"][:, 1:].float()
        tokens = gather(mask.sum()).sum()
        entropy = gather((out.entropy * mask).sum()).sum()
        self.log_metric("entropy", (entropy / tokens).item() if tokens > 0 else 0.0)
        if self.model.training:
            self.state.num_input_tokens_seen += int(gather(batch["attention_mask"].sum()).sum().item())
        self.log_metric("num_tokens", self.state.num_input_tokens_seen)
        for group, row_mask in rows.items():
            group_mask = mask * row_mask.float()[:, None]
            count = gather(group_mask.sum()).sum()
            if count > 0:
                total = gather((out.mean_logits.detach() * group_mask).sum()).sum()
                self.log_metric(f"logits/{group}", (total / count).item())
        if out.aux_loss is not None:
            self.log_metric("aux_loss", gather(out.aux_loss.detach()).mean().item())

    def add_aux_loss(self, loss, out):
        return loss + self._aux_loss_coef * out.aux_loss if out.aux_loss is not None else loss

    def _setup_aux_loss(self) -> None:
        """MoE load-balancing loss weight: `router_aux_loss_coef`, or the model config's value when None."""
        model = self.accelerator.unwrap_model(self.model)
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config.get_text_config()
        coef = self.args.router_aux_loss_coef
        if coef and not hasattr(config, "output_router_logits"):
            raise ValueError(
                f"router_aux_loss_coef={coef}, but {type(model).__name__} is not a Mixture-of-Experts model that "
                "returns router logits: there is no auxiliary loss to weight. Leave it at None."
            )
        moe = hasattr(config, "output_router_logits")
        self._aux_loss_coef = (getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef) if moe else 0.0
