"""Offline preference data, shared by DPO and KTO: TRL's dataset formats, tokenisation, and the typed batches and
collators (paired chosen/rejected rows; unpaired completion/label rows with KTO's mismatched KL rows). The formats,
tokenisation and dropped rows are TRL's: docs/dpo.md and docs/kto.md ("Datasets")."""

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset
from trl import extract_prompt, is_conversational, unpair_preference_dataset

from ..data.batch import TensorBatch, scalar_field
from ..data.datasets import column_names, get_images, get_videos, pad
from ..data.vision import EncodedPrompts, encode_visual_prompts, render_conversation
from ..models.loading import get_tokenizer


logger = logging.getLogger(__name__)


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))


def tokenize(processing_class, value, **template_kwargs) -> list[int]:
    """Token ids of a text (tokenizer call) or a conversation (chat template)."""
    if isinstance(value, list):
        encoded = processing_class.apply_chat_template(value, tokenize=True, return_dict=True, **template_kwargs)
        return list(encoded["input_ids"])
    return list(processing_class(text=value)["input_ids"])


def split_completions(row: dict, processing_class, keys: tuple[str, ...]) -> dict[str, list[int]]:
    """`prompt_ids` and one `<key>_ids` per completion key. The completion starts where the tokenised prompt and the
    tokenised prompt + completion diverge (a chat template may render a prompt alone differently)."""
    template_kwargs = dict(row.get("chat_template_kwargs") or {})
    if row.get("tools") is not None:
        template_kwargs["tools"] = row["tools"]
    prompt_options = {"add_generation_prompt": True} if isinstance(row["prompt"], list) else {}
    prompt_ids = tokenize(processing_class, row["prompt"], **template_kwargs, **prompt_options)
    full = {key: tokenize(processing_class, row["prompt"] + row[key], **template_kwargs) for key in keys}
    prompt_len = _divergence(prompt_ids, full, get_tokenizer(processing_class))
    return {"prompt_ids": prompt_ids[:prompt_len], **{f"{key}_ids": ids[prompt_len:] for key, ids in full.items()}}


def _divergence(prompt_ids: list[int], full: dict[str, list[int]], tokenizer) -> int:
    """Where every tokenised prompt + completion leaves the tokenised prompt (its length when it is a prefix)."""
    prompt_len = min(common_prefix_length(prompt_ids, ids) for ids in full.values())
    if prompt_len < len(prompt_ids):
        logger.warning(
            "The tokenised prompt is not a prefix of the tokenised prompt + completion (chat template or a token "
            f"merging across the boundary); the completion starts where they diverge, dropping "
            f"{tokenizer.decode(prompt_ids[prompt_len:])!r} from the prompt, as TRL does."
        )
    return prompt_len


def split_completions_with_images(row: dict, processing_class, keys: tuple[str, ...]) -> dict[str, Any]:
    """For a conversational row with images: `prompt_text` (the chat-template text with one placeholder per image,
    expanded into image tokens when the batch is collated with its images) and one `<key>_ids` per completion key,
    split where the tokenised prompt and prompt + completion diverge (as `split_completions`)."""
    if not isinstance(row["prompt"], list):
        raise ValueError(
            "Rows with images need conversational prompts (lists of messages), so that the chat template places the "
            f"image tokens; got a {type(row['prompt']).__name__} prompt."
        )
    template_kwargs = dict(row.get("chat_template_kwargs") or {})
    images, videos, tokenizer = get_images(row) or [], get_videos(row) or [], get_tokenizer(processing_class)

    def render(messages, **options):
        return render_conversation(processing_class, messages, images, videos, **options, **template_kwargs)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt_text = render(row["prompt"], add_generation_prompt=True)
    prompt_ids = ids(prompt_text)
    full = {key: ids(render(row["prompt"] + row[key])) for key in keys}
    prompt_len = _divergence(prompt_ids, full, tokenizer)
    if prompt_len < len(prompt_ids):
        prompt_text = tokenizer.decode(prompt_ids[:prompt_len])
    return {"prompt_text": prompt_text, **{f"{key}_ids": value[prompt_len:] for key, value in full.items()}}


def prepare_preference_dataset(dataset, processing_class, args, name: str, paired: bool, eos_token: str):
    """TRL's preparation of a preference dataset (see the module docstring). Idempotent: tokenised data is returned
    as is. `paired=False` unpairs `chosen`/`rejected` rows into `completion`/`label` rows."""
    if dataset is None or {"prompt_ids", "prompt_text"} & set(column_names(dataset) or next(iter(dataset)).keys()):
        return dataset
    map_kwargs = {"num_proc": args.dataset_num_proc} if isinstance(dataset, Dataset) else {}
    first = next(iter(dataset))
    if "prompt" not in first:
        dataset = dataset.map(extract_prompt, **map_kwargs)
    if not paired and "chosen" in first:
        dataset = unpair_preference_dataset(dataset, **map_kwargs)
    keys = ("chosen", "rejected") if paired else ("completion",)
    fn_kwargs = {"processing_class": processing_class, "keys": keys}
    if {"images", "image", "videos", "video"} & first.keys():  # media stay in the rows; the collator processes them
        return dataset.map(split_completions_with_images, fn_kwargs=fn_kwargs, **map_kwargs)
    if not is_conversational(next(iter(dataset))):

        def add_eos(row):
            return {key: row[key] if row[key].endswith(eos_token) else row[key] + eos_token for key in keys}

        dataset = dataset.map(add_eos, **map_kwargs)
    dataset = dataset.map(split_completions, fn_kwargs=fn_kwargs, **map_kwargs)
    if args.max_length is not None and args.truncation_mode == "keep_start":
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


@dataclass
class SequenceBatch(TensorBatch):
    """Prompt + completion rows, right-padded to L positions.

    Fields:
        input_ids (`(B, L)`): prompt tokens then completion tokens, then padding.
        attention_mask (`(B, L)`): 1 on prompt and completion tokens.
        completion_mask (`(B, L)`): 1 on completion tokens only.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    visual_inputs: dict[str, torch.Tensor] = scalar_field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The model inputs besides ids and mask: `token_inputs` (`(B, L)`, e.g. `token_type_ids`) and
        `visual_inputs` (the processor's image tensors, laid out per image in row order); empty for text rows."""
        return {**self.token_inputs, **self.visual_inputs}

    @classmethod
    def concat(cls, batches: list["SequenceBatch"], pad_token_id: int) -> "SequenceBatch":
        """The rows of several batches in one, right-padded to the widest (e.g. KTO's completions and KL rows, for one
        reference forward where each prompt is shared by its two rows)."""
        width = max(b.input_ids.size(1) for b in batches)

        def cat(tensors, value):
            return torch.cat([F.pad(t, (0, width - t.size(1)), value=value) for t in tensors])

        return cls(
            cat([b.input_ids for b in batches], pad_token_id),
            cat([b.attention_mask for b in batches], 0),
            cat([b.completion_mask for b in batches], 0),
            {k: cat([b.token_inputs[k] for b in batches], 0) for k in batches[0].token_inputs},
            {k: torch.cat([b.visual_inputs[k] for b in batches]) for k in batches[0].visual_inputs},
        )


def pack(
    prompts, completions, pad_token_id, max_length, truncation_mode="keep_start", pad_to_multiple_of=None
) -> SequenceBatch:
    """Prompt + completion rows (token-id lists), truncated to `max_length` and right-padded."""
    ids = [p + c for p, c in zip(prompts, completions, strict=True)]
    masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions, strict=True)]
    if max_length is not None:
        keep = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
        ids, masks = [row[keep] for row in ids], [row[keep] for row in masks]

    def padded(rows, value):
        return pad([torch.tensor(r, dtype=torch.long) for r in rows], value, "right", pad_to_multiple_of)

    return SequenceBatch(padded(ids, pad_token_id), padded([[1] * len(r) for r in ids], 0), padded(masks, 0))


def pack_with_images(
    encoded: EncodedPrompts, completions, pad_token_id, max_length, truncation_mode, pad_to_multiple_of
) -> SequenceBatch:
    """`pack` for prompts encoded with their images: `completions` holds k completions per prompt (row i of the
    j-th block has prompt i, as a pair's chosen then rejected rows), so the prompts' tokens, per-token inputs and
    image tensors are repeated k times, never re-processed. A `max_length` that would cut a prompt (its image
    tokens) raises."""
    repeat = len(completions) // len(encoded.input_ids)
    prompts = encoded.input_ids * repeat
    if max_length is not None:
        for prompt, completion in zip(prompts, completions, strict=True):
            if len(prompt) >= max_length if truncation_mode == "keep_start" else len(prompt + completion) > max_length:
                raise ValueError(
                    f"max_length={max_length} cuts a prompt of {len(prompt)} tokens with its image tokens "
                    f"(completion: {len(completion)} tokens, truncation_mode={truncation_mode!r}): the image features "
                    "would no longer match the image tokens. Raise max_length or set it to None for image rows."
                )
    options = (max_length, truncation_mode, pad_to_multiple_of)
    sequences = pack(prompts, completions, pad_token_id, *options)
    zeros = [[0] * len(c) for c in completions]
    token_inputs = {k: pack(v * repeat, zeros, 0, *options).input_ids for k, v in encoded.token_inputs.items()}
    visual_inputs = {k: torch.cat([v] * repeat) for k, v in encoded.visual_inputs.items()}
    return dataclasses.replace(sequences, token_inputs=token_inputs, visual_inputs=visual_inputs)


@dataclass
class SharedPromptLayout:
    """`SequenceBatch` rows re-laid out for prompt sharing: each prompt left-padded to `P` positions, each completion
    right-padded to `C`, so that rows with the same prompt are equal on `[:, :P]` (the chosen and rejected rows of a
    pair, a completion and its KL row). The original positions are kept, so the model computes the same function.
    Encoding the shared prompt once is prefix sharing for preference tuning (Wang et al., 2024, arXiv:2410.20305).

    Fields:
        input_ids, attention_mask, position_ids (`(B, P + C)`).
        targets (`(B, C)`): for completion position j of row i, the index of that token in the original rows'
            per-token layout `(B, L - 1)` (predicting `input_ids[:, 1:]`), or -1 past the row's completion.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def build(cls, sequences: SequenceBatch, pad_token_id: int) -> "SharedPromptLayout | None":
        """None when a row has no prompt token left (`truncation_mode="keep_end"` cut it all): its first completion
        token is not scored in the original layout, and there is no prompt to share."""
        completion = sequences.completion_mask.bool()
        prompt_lengths = (completion.long().cumsum(1) == 0).sum(1)  # (B,) tokens before the first completion token
        lengths = sequences.attention_mask.sum(1)  # (B,) prompt + completion
        if bool((prompt_lengths < 1).any()):
            return None
        width_p, width_c = int(prompt_lengths.max()), int((lengths - prompt_lengths).max())
        columns = torch.arange(width_p + width_c, device=completion.device)[None, :]
        original = columns - width_p + prompt_lengths[:, None]  # (B, P + C): new column k holds original column k'
        valid = (original >= 0) & (original < lengths[:, None])
        index = original.clamp(0, sequences.input_ids.size(1) - 1)
        input_ids = torch.where(valid, sequences.input_ids.gather(1, index), pad_token_id)
        targets = torch.where(valid[:, width_p:], original[:, width_p:] - 1, -1)  # (B, C)
        return cls(input_ids, valid.long(), original.clamp(min=0), targets)

    def scatter(self, values: torch.Tensor, width: int, rows: slice = slice(None)) -> torch.Tensor:
        """`(b, C)` per-completion-token values of the layout's rows `rows` (all by default) → the original
        `(b, width)` per-token layout (zero, False, elsewhere)."""
        targets = self.targets[rows]
        keep = targets >= 0
        index = torch.arange(values.size(0), device=values.device)[:, None].expand_as(targets)
        return values.new_zeros(values.size(0), width).index_put((index[keep], targets[keep]), values[keep])


class _ReadsSequences:
    """TRL's preference collators return `input_ids`, `attention_mask` and `completion_mask` (chosen then rejected
    rows for DPO); `batch["input_ids"]` etc. read those of `batch.sequences` here."""

    SEQUENCE_KEYS = ("input_ids", "attention_mask", "completion_mask")

    def __contains__(self, name: str) -> bool:
        return name in self.SEQUENCE_KEYS or super().__contains__(name)

    def __getitem__(self, name: str):
        return getattr(self.sequences, name) if name in self.SEQUENCE_KEYS else super().__getitem__(name)


@dataclass
class PairedBatch(_ReadsSequences, TensorBatch):
    """B preference pairs, chosen and rejected stacked for one forward.

    Fields:
        sequences (`SequenceBatch` of 2B rows): the B chosen rows, then the B rejected rows (same prompts).
        ref_chosen_logps, ref_rejected_logps (`(B,)` or None): precomputed reference sequence log-probs.
    """

    sequences: SequenceBatch
    ref_chosen_logps: torch.Tensor | None = None
    ref_rejected_logps: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sequences) // 2

    def select(self, index: torch.Tensor) -> "PairedBatch":
        rows = torch.cat([index, index + len(self)])  # a pair's chosen and rejected rows stay together
        return PairedBatch(
            self.sequences.select(rows),
            *(None if t is None else t[index] for t in (self.ref_chosen_logps, self.ref_rejected_logps)),
        )


@dataclass
class UnpairedBatch(_ReadsSequences, TensorBatch):
    """B labelled completions (KTO).

    Fields:
        sequences (`SequenceBatch` of B rows): prompt + completion.
        label (`(B,)` bool): True for a desirable completion.
        kl_sequences (`SequenceBatch` of B rows, or None): each prompt with a mismatched completion (KTO's KL
            estimate of the reference point).
        ref_logps, ref_KL_logps (`(B,)` or None): precomputed reference sequence log-probs of `sequences` and
            `kl_sequences`.
    """

    sequences: SequenceBatch
    label: torch.Tensor
    kl_sequences: SequenceBatch | None = None
    ref_logps: torch.Tensor | None = None
    ref_KL_logps: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sequences)


def _ref_column(rows: list[dict[str, Any]], name: str) -> torch.Tensor | None:
    return torch.tensor([row[name] for row in rows], dtype=torch.float32) if name in rows[0] else None


@dataclass
class _PreferenceCollator:
    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None
    processing_class: Any = None  # for rows with images (`prompt_text` + `images`)

    def packer(self, rows: list[dict[str, Any]]):
        """`completions -> SequenceBatch` for these rows' prompts (row i's prompt for completions i, i + B, ...); the
        images of rows with images are processed once, for every use."""
        options = (self.pad_token_id, self.max_length, self.truncation_mode, self.pad_to_multiple_of)
        if "prompt_text" in rows[0]:
            images, videos = [get_images(r) or [] for r in rows], [get_videos(r) or [] for r in rows]
            encoded = encode_visual_prompts(self.processing_class, [r["prompt_text"] for r in rows], images, videos)
            return lambda completions: pack_with_images(encoded, completions, *options)
        prompts = [row["prompt_ids"] for row in rows]
        return lambda completions: pack(prompts * (len(completions) // len(prompts)), completions, *options)


@dataclass
class PairedCollator(_PreferenceCollator):
    """Tokenised paired rows (`prompt_ids`, `chosen_ids`, `rejected_ids`, optional `ref_*_logps`) → `PairedBatch`."""

    def __call__(self, rows: list[dict[str, Any]]) -> PairedBatch:
        completions = [row["chosen_ids"] for row in rows] + [row["rejected_ids"] for row in rows]
        sequences = self.packer(rows)(completions)
        return PairedBatch(sequences, _ref_column(rows, "ref_chosen_logps"), _ref_column(rows, "ref_rejected_logps"))


@dataclass
class UnpairedCollator(_PreferenceCollator):
    """Tokenised unpaired rows (`prompt_ids`, `completion_ids`, `label`, optional `KL_completion_ids` and `ref_*`)
    → `UnpairedBatch`."""

    def __call__(self, rows: list[dict[str, Any]]) -> UnpairedBatch:
        build = self.packer(rows)
        kl = build([row["KL_completion_ids"] for row in rows]) if "KL_completion_ids" in rows[0] else None
        label = torch.tensor([bool(row["label"]) for row in rows])
        refs = (_ref_column(rows, name) for name in ("ref_logps", "ref_KL_logps"))
        return UnpairedBatch(build([row["completion_ids"] for row in rows]), label, kl, *refs)
