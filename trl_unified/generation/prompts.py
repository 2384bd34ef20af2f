"""Prompts for `generate_batched`: the accepted forms, their encoding (chat template, processor), padded chunks and
the model's position limit."""

from collections.abc import Mapping
from typing import Any

import torch
from transformers import GenerationConfig

from ..data.datasets import is_conversational_prompt, pad
from ..data.vision import processor_visual_kwargs
from ..models.loading import get_tokenizer
from ..models.token_ids import check_ids_in_table, embedding_rows
from .options import GenerationOptions


def encode_for_generation(
    processing_class, prompts, options: GenerationOptions, model, generation_config: GenerationConfig | None
) -> list[dict[str, Any]]:
    """Each prompt encoded as `generate_batched` decodes it (see `normalize_prompts` and `encode_prompts`); raises
    on a prompt that encodes to no tokens or that leaves no room for `max_new_tokens` within the model's positions."""
    tokenizer = get_tokenizer(processing_class)
    prompts = normalize_prompts(prompts, tokenizer.pad_token_id)
    encoded = encode_prompts(
        processing_class, prompts, options.images, options.chat_template_kwargs or {}, options.videos
    )
    empty = [i for i, e in enumerate(encoded) if torch.as_tensor(e["input_ids"]).numel() == 0]
    if empty:
        raise ValueError(
            f"prompts{empty[:5]} encode to no tokens (empty prompt {prompts[empty[0]]!r}); a decoder-only model needs "
            "at least one prompt token to generate from. Remove empty prompts or give the tokenizer a BOS token."
        )
    if options.max_prompt_length is not None:
        encoded = [keep_last_tokens(e, options.max_prompt_length) for e in encoded]
    check_fits_positions(model, encoded, generation_config)
    check_prompt_ids(model, encoded, tokenizer)
    return encoded


def keep_last_tokens(encoded: dict[str, Any], length: int) -> dict[str, Any]:
    """An encoded text prompt cut to its last `length` tokens (every per-token field alike); a prompt with images or
    videos raises (its image tokens must stay whole)."""
    ids = encoded["input_ids"]
    if len(ids) <= length:
        return encoded
    if set(encoded) - {"input_ids", "attention_mask"}:
        raise ValueError(
            f"max_prompt_length={length} would cut a prompt of {len(ids)} tokens that carries images or other "
            "inputs; raise max_prompt_length or set it to None."
        )
    return {key: value[-length:] for key, value in encoded.items()}


def padding_token_id(tokenizer) -> int | None:
    """The token that pads prompts and completions: the pad token, else EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def normalize_prompts(prompts, pad_token_id: int | None = None) -> list:
    """The prompt forms `generate_batched` accepts, as a list of texts, token-id lists or conversations.

    Accepted: a list (or tuple) of strings, of token-id lists, or of conversations (lists of message dicts); a 2-D
    `(batch, length)` tensor of token ids (every position is a prompt token: a row that starts or ends with
    `pad_token_id` raises, since its padding would be read as prompt); a `BatchEncoding` or dict with `input_ids` (a
    tensor or lists, ragged allowed) and optionally `attention_mask` (positions with mask 0 are padding, on either
    side, and are dropped). A bare string, a 1-D tensor, or a list mixing forms raises a `TypeError` saying what to
    pass instead.
    """
    if isinstance(prompts, str):
        raise TypeError(
            f"prompts is a single string ({prompts[:40]!r}); generate_batched takes a list of prompts. "
            "Pass [prompt] to generate for one prompt."
        )
    if isinstance(prompts, Mapping):
        return _normalize_encoding(prompts)
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.is_floating_point():
            raise TypeError(
                f"prompts is a {prompts.dim()}-D {prompts.dtype} tensor; pass token ids as a 2-D (batch, length) "
                "integer tensor, or a BatchEncoding with an attention_mask when rows are padded."
            )
        if pad_token_id is not None and prompts.numel():
            padded = (prompts[:, 0] == pad_token_id) | (prompts[:, -1] == pad_token_id)
            if padded.any():
                row = int(padded.nonzero()[0, 0])
                raise ValueError(
                    f"prompts is a padded tensor: row {row} starts or ends with the pad token id {pad_token_id}, "
                    "which would be read as a prompt token. Pass the tokenizer's BatchEncoding (input_ids and "
                    "attention_mask) or a list of unpadded token-id lists."
                )
        return [row.tolist() for row in prompts]
    if not isinstance(prompts, (list, tuple)) and hasattr(prompts, "__getitem__") and hasattr(prompts, "__len__"):
        prompts = list(prompts)  # sequence-like, e.g. a datasets Column
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts is a {type(prompts).__name__}; pass a list of strings, token-id lists or conversations, a 2-D "
            "tensor of token ids, or a BatchEncoding."
        )
    kinds = [_prompt_kind(p) for p in prompts]
    for i, (prompt, kind) in enumerate(zip(prompts, kinds)):
        if kind is None or kind != kinds[0]:
            raise TypeError(
                f"prompts[{i}] is {str(prompt)[:60]!r} ({type(prompt).__name__}); every prompt must be of the same "
                "form: a non-empty string, list of token ids, or conversation (list of {'role', 'content'} dicts)."
            )
    return [p.tolist() if isinstance(p, torch.Tensor) else p for p in prompts]


def _normalize_encoding(prompts: Mapping) -> list[list[int]]:
    """A tokenised batch (`input_ids`, optional `attention_mask`; tensors or lists, ragged allowed) → id lists."""
    if "input_ids" not in prompts:
        raise TypeError(
            f"prompts is a mapping with keys {sorted(prompts)}, but a tokenised batch needs 'input_ids' "
            "(and optionally 'attention_mask')."
        )
    ids, mask = prompts["input_ids"], prompts.get("attention_mask")
    rows = [torch.as_tensor(r).view(-1) for r in ids] if not isinstance(ids, torch.Tensor) else list(ids)
    if isinstance(ids, torch.Tensor) and ids.dim() != 2:
        raise TypeError(f"prompts['input_ids'] has shape {tuple(ids.shape)}; expected (batch, length).")
    if mask is None:
        return [r.tolist() for r in rows]
    masks = [torch.as_tensor(m).view(-1).bool() for m in mask]
    if len(masks) != len(rows) or any(m.numel() != r.numel() for r, m in zip(rows, masks)):
        raise ValueError("prompts['attention_mask'] must have one mask of the same length per row of input_ids.")
    return [r[m].tolist() for r, m in zip(rows, masks, strict=True)]


def _prompt_kind(prompt) -> str | None:
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, torch.Tensor):
        return "ids" if prompt.dim() == 1 and not prompt.is_floating_point() else None
    if isinstance(prompt, (list, tuple)) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return "ids"
        if all(isinstance(m, Mapping) and "role" in m for m in prompt):
            return "conversation"
    return None


def max_positions(model) -> int | None:
    """The longest sequence a decoder-only model's config allows (`max_position_embeddings` / `n_positions`)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return None
    config = model.config.get_text_config()
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def prompt_lengths(processing_class, prompts, chat_template_kwargs=None) -> list[int]:
    """Token count of each prompt as `generate_batched` encodes it (chat template with a generation prompt)."""
    encoded = encode_prompts(processing_class, normalize_prompts(prompts), None, chat_template_kwargs or {})
    return [len(e["input_ids"]) for e in encoded]


def encode_prompts(processing_class, prompts, images, chat_template_kwargs, videos=None) -> list[dict[str, Any]]:
    """Tokenise each prompt to a dict (`input_ids` list, plus image / video tensors for processors)."""
    if images is not None or videos is not None:
        texts = [
            processing_class.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **chat_template_kwargs)
            if is_conversational_prompt(p)
            else p
            for p in prompts
        ]
        images = images if images is not None else [None] * len(texts)
        videos = videos if videos is not None else [None] * len(texts)
        return [
            dict(
                processing_class(text=[t], **processor_visual_kwargs([imgs or []], [vids or []]), return_tensors="pt")
            )
            for t, imgs, vids in zip(texts, images, videos, strict=True)
        ]
    if prompts and is_conversational_prompt(prompts[0]):
        encoded = processing_class.apply_chat_template(
            list(prompts), add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs
        )
        return [{"input_ids": list(ids)} for ids in encoded["input_ids"]]
    if prompts and isinstance(prompts[0], str):
        tokenizer = get_tokenizer(processing_class)
        return [{"input_ids": ids} for ids in tokenizer(list(prompts))["input_ids"]]
    return [{"input_ids": list(p)} for p in prompts]  # already token ids


def collate_chunk(encoded: list[dict[str, Any]], pad_token_id: int, pad_to_multiple_of, device) -> dict[str, Any]:
    """One chunk of encoded prompts as model inputs: ids and mask left-padded to the chunk's longest prompt."""
    ids = [torch.as_tensor(e["input_ids"]).view(-1) for e in encoded]
    batch = {
        "input_ids": pad(ids, pad_token_id, "left", pad_to_multiple_of).to(device),
        "attention_mask": pad([torch.ones_like(t) for t in ids], 0, "left", pad_to_multiple_of).to(device),
    }
    for key in [k for k in encoded[0] if k not in ("input_ids", "attention_mask")]:
        values = [e[key] for e in encoded]
        if is_sequence_aligned(values[0], encoded[0]["input_ids"]):  # e.g. token_type_ids: padded like the ids
            batch[key] = pad([v.view(-1) for v in values], 0, "left", pad_to_multiple_of).to(device)
        else:
            batch[key] = torch.cat(values).to(device) if isinstance(values[0], torch.Tensor) else values
    return batch


def is_sequence_aligned(value, input_ids) -> bool:
    """Whether a processor output is per prompt token (`(1, len(input_ids))`, e.g. `token_type_ids`)."""
    return isinstance(value, torch.Tensor) and value.shape == (1, torch.as_tensor(input_ids).numel())


def check_fits_positions(model, encoded, generation_config) -> None:
    """Raise when the longest prompt plus `max_new_tokens` exceeds the model's positions (`max_positions`)."""
    limit = max_positions(model)
    new_tokens = getattr(generation_config, "max_new_tokens", None)
    if limit is None or new_tokens is None or not encoded:
        return
    lengths = [torch.as_tensor(e["input_ids"]).numel() for e in encoded]
    length = max(lengths)
    if length + new_tokens > limit:
        raise ValueError(
            f"Prompt {lengths.index(length)} has {length} tokens; with max_new_tokens={new_tokens} that is "
            f"{length + new_tokens} positions, beyond the model's maximum of {limit} "
            "(config.max_position_embeddings). Shorten the prompt or generate fewer tokens."
        )


def check_prompt_ids(model, encoded, tokenizer=None) -> None:
    """Raise when a prompt holds a token id beyond the model's embedding table (e.g. a token added to the tokenizer
    without `resize_token_embeddings`), naming the prompt, the id and the table size."""
    rows = embedding_rows(model)
    for i, e in enumerate(encoded):
        check_ids_in_table(torch.as_tensor(e["input_ids"]).view(-1), None, rows, f"Prompt {i}", tokenizer=tokenizer)
