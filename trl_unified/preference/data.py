"""The typed batches and collators of offline preference data: rows with k completions each (chosen/rejected, or
TPO's chosen/rejected/reference) stacked in blocks (`PairedBatch`), unpaired completion/label rows with KTO's
mismatched KL rows (`UnpairedBatch`), decoder-only (`SequenceBatch`) or encoder-decoder (`EncoderDecoderSequences`)
rows, and the layout that encodes each prompt once (`SharedPromptLayout`). Tokenisation: `formats.py`."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..data.batch import TensorBatch, scalar_field
from ..data.datasets import get_images, get_videos, pad
from ..data.vision import EncodedPrompts, encode_visual_prompts
from .formats import IGNORE_INDEX


@dataclass
class SequenceBatch(TensorBatch):
    """Prompt + completion rows of a decoder-only model, right-padded to L positions.

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

    def token_mask(self, include_prompt: bool = False) -> torch.Tensor:
        """`(B, L - 1)`: the predicted tokens (`input_ids[:, 1:]`) that count: the completion's, or with
        `include_prompt` every real token but the first (ORPO's NLL)."""
        return (self.attention_mask if include_prompt else self.completion_mask)[:, 1:]

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
            input_ids=cat([b.input_ids for b in batches], pad_token_id),
            attention_mask=cat([b.attention_mask for b in batches], 0),
            completion_mask=cat([b.completion_mask for b in batches], 0),
            token_inputs={k: cat([b.token_inputs[k] for b in batches], 0) for k in batches[0].token_inputs},
            visual_inputs={k: torch.cat([b.visual_inputs[k] for b in batches]) for k in batches[0].visual_inputs},
        )


@dataclass
class EncoderDecoderSequences(TensorBatch):
    """Rows of an encoder-decoder model: the prompt goes to the encoder, the completion is the decoder's target.

    Fields:
        input_ids, attention_mask (`(B, P)`): the encoder's prompt tokens (right-padded) and their mask.
        labels (`(B, C)`): the completion tokens, right-padded with the pad token.
        completion_mask (`(B, C)`): 1 on completion tokens.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    completion_mask: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def token_mask(self, include_prompt: bool = False) -> torch.Tensor:
        """`(B, C)`: the decoder's real targets (the prompt is the encoder's input: never predicted)."""
        return self.completion_mask

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return {}


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

    return SequenceBatch(
        input_ids=padded(ids, pad_token_id),
        attention_mask=padded([[1] * len(r) for r in ids], 0),
        completion_mask=padded(masks, 0),
    )


def pack_encoder_decoder(prompts, completions, pad_token_id, pad_to_multiple_of=None) -> EncoderDecoderSequences:
    """Encoder prompts and decoder completions (token-id lists, one prompt per completion), right-padded."""

    def padded(rows, value):
        return pad([torch.tensor(r, dtype=torch.long) for r in rows], value, "right", pad_to_multiple_of)

    return EncoderDecoderSequences(
        input_ids=padded(prompts, pad_token_id),
        attention_mask=padded([[1] * len(p) for p in prompts], 0),
        labels=padded(completions, pad_token_id),
        completion_mask=padded([[1] * len(c) for c in completions], 0),
    )


def _cuts_prompt(prompt: list[int], completion: list[int], max_length: int, truncation_mode: str) -> bool:
    """Whether truncating prompt + completion to `max_length` from `truncation_mode`'s side removes prompt tokens."""
    if truncation_mode == "keep_start":
        return len(prompt) >= max_length
    return len(prompt) + len(completion) > max_length


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
            if _cuts_prompt(prompt, completion, max_length, truncation_mode):
                raise ValueError(
                    f"max_length={max_length} cuts a prompt of {len(prompt)} tokens with its image tokens "
                    f"(completion: {len(completion)} tokens, truncation_mode={truncation_mode!r}): the image features "
                    "would no longer match the image tokens. Raise max_length or set it to None for image rows."
                )
    sequences = pack(prompts, completions, pad_token_id, max_length, truncation_mode, pad_to_multiple_of)
    zeros = [[0] * len(c) for c in completions]
    token_inputs = {
        k: pack(v * repeat, zeros, 0, max_length, truncation_mode, pad_to_multiple_of).input_ids
        for k, v in encoded.token_inputs.items()
    }
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

    def scatter_prompt(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """`(B, P - 1)` per-prompt-token values of the layout (`compute_token_logprobs(score_prompt=True)`: column j
        predicts layout column j + 1) → the original `(B, width)` per-token layout (zero elsewhere); a token whose
        predicting position is padding stays 0."""
        columns = self.position_ids.size(1) - self.targets.size(1)  # P
        valid = self.attention_mask[:, 1:columns].bool() & self.attention_mask[:, : columns - 1].bool()
        index = self.position_ids[:, 1:columns] - 1  # the predicted token's index in the original per-token layout
        rows = torch.arange(values.size(0), device=values.device)[:, None].expand_as(index)
        return values.new_zeros(values.size(0), width).index_put((rows[valid], index[valid]), values[valid])

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
    """B rows with k completions each (chosen and rejected; TPO adds its gold `reference`), stacked for one forward.

    Fields:
        sequences (`SequenceBatch` or `EncoderDecoderSequences` of k·B rows): one block of B rows per completion key,
            in `completions` order (the B chosen rows, then the B rejected rows, ...), row i of each block with
            prompt i.
        ref_chosen_logps, ref_rejected_logps (`(B,)` or None): precomputed reference sequence log-probs.
        completions (`tuple[str, ...]`): the completion keys of the blocks.
    """

    sequences: SequenceBatch | EncoderDecoderSequences
    ref_chosen_logps: torch.Tensor | None = None
    ref_rejected_logps: torch.Tensor | None = None
    completions: tuple[str, ...] = scalar_field(default=("chosen", "rejected"))

    def __len__(self) -> int:
        return len(self.sequences) // len(self.completions)

    def block(self, key: str) -> slice:
        """The rows of `sequences` that hold completion `key` (e.g. `block("chosen")`: the first B rows)."""
        start = self.completions.index(key) * len(self)
        return slice(start, start + len(self))

    def block_mask(self, key: str) -> torch.Tensor:
        """`(k·B,)` bool: True on the rows of `block(key)`."""
        mask = torch.zeros(len(self.sequences), dtype=torch.bool, device=self.sequences.input_ids.device)
        mask[self.block(key)] = True
        return mask

    def select(self, index: torch.Tensor) -> "PairedBatch":
        rows = torch.cat([index + i * len(self) for i in range(len(self.completions))])  # a row's blocks stay together
        refs = {
            name: None if value is None else value[index]
            for name, value in (
                ("ref_chosen_logps", self.ref_chosen_logps),
                ("ref_rejected_logps", self.ref_rejected_logps),
            )
        }
        return dataclasses.replace(self, sequences=self.sequences.select(rows), **refs)


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


def prompt_and_completion(row: dict[str, Any], key: str, encoder_decoder: bool) -> tuple[list[int], list[int]]:
    """The prompt and completion `key` of a tokenised row: `prompt_ids` and `<key>_ids`; in TRL's legacy layout, for
    an encoder-decoder row `prompt_input_ids` and the `<key>_labels`, else the row's `<key>_input_ids` split where its
    labels stop being -100 (each completion keeps the prompt tokens it was tokenised with)."""
    if "prompt_ids" in row:
        return row["prompt_ids"], row[f"{key}_ids"]
    if encoder_decoder:
        return row["prompt_input_ids"], row[f"{key}_labels"]
    ids, labels = row[f"{key}_input_ids"], row[f"{key}_labels"]
    prompt_length = labels.count(IGNORE_INDEX)  # the -100s cover the prompt, at the start
    return ids[:prompt_length], ids[prompt_length:]


@dataclass
class _PreferenceCollator:
    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None
    processing_class: Any = None  # for rows with images (`prompt_text` + `images`)
    encoder_decoder: bool = False  # prompts to the encoder, completions as the decoder's targets

    def pack_rows(self, rows: list[dict[str, Any]], keys: list[str]):
        """`SequenceBatch` (or `EncoderDecoderSequences`) of one block of rows per completion key (`keys`; row i of
        each block holds row i's prompt); the images of rows with images are processed once, for every block."""
        truncation = (self.max_length, self.truncation_mode, self.pad_to_multiple_of)
        if "prompt_text" in rows[0]:
            images, videos = [get_images(r) or [] for r in rows], [get_videos(r) or [] for r in rows]
            encoded = encode_visual_prompts(self.processing_class, [r["prompt_text"] for r in rows], images, videos)
            completions = [row[f"{key}_ids"] for key in keys for row in rows]
            return pack_with_images(encoded, completions, self.pad_token_id, *truncation)
        pairs = [prompt_and_completion(row, key, self.encoder_decoder) for key in keys for row in rows]
        prompts, completions = [p for p, _ in pairs], [c for _, c in pairs]
        if self.encoder_decoder:
            return pack_encoder_decoder(prompts, completions, self.pad_token_id, self.pad_to_multiple_of)
        return pack(prompts, completions, self.pad_token_id, *truncation)


@dataclass
class PairedCollator(_PreferenceCollator):
    """Tokenised rows (`prompt_ids` and `<key>_ids` per completion key, or TRL's legacy columns; optional
    `ref_*_logps`) → `PairedBatch` with one block of rows per key of `completions`."""

    completions: tuple[str, ...] = ("chosen", "rejected")

    @property
    def include_reference(self) -> bool:
        """TRL's attribute of its TPO collator: whether the gold `reference` completions are collated."""
        return "reference" in self.completions

    def __call__(self, rows: list[dict[str, Any]]) -> PairedBatch:
        return PairedBatch(
            sequences=self.pack_rows(rows, list(self.completions)),
            ref_chosen_logps=_ref_column(rows, "ref_chosen_logps"),
            ref_rejected_logps=_ref_column(rows, "ref_rejected_logps"),
            completions=tuple(self.completions),
        )


@dataclass
class UnpairedCollator(_PreferenceCollator):
    """Tokenised unpaired rows (`prompt_ids`, `completion_ids`, `label`, optional `KL_completion_ids` and `ref_*`)
    → `UnpairedBatch`."""

    def __call__(self, rows: list[dict[str, Any]]) -> UnpairedBatch:
        kl_sequences = None
        if "KL_completion_ids" in rows[0]:
            kl_sequences = self.pack_rows(rows, ["KL_completion"])
        return UnpairedBatch(
            sequences=self.pack_rows(rows, ["completion"]),
            label=torch.tensor([bool(row["label"]) for row in rows]),
            kl_sequences=kl_sequences,
            ref_logps=_ref_column(rows, "ref_logps"),
            ref_KL_logps=_ref_column(rows, "ref_KL_logps"),
        )
