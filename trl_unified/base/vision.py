"""Vision-language rows for the offline data layers: rendering a conversation with its image placeholders, and
encoding a batch of prompts with their images through the model's processor.

TRL's conventions: a row carries its images in an `images` list (or one `image`), its prompt is a conversation, and
`trl.prepare_multimodal_messages` puts one `{"type": "image"}` part per image before the first user text. The
processor expands each placeholder into the model's image tokens and returns the image tensors (`pixel_values`,
and e.g. `image_grid_thw`, `image_sizes`), laid out per image in row order, and per-token inputs aligned with
`input_ids` (e.g. Gemma 3's `token_type_ids`). Images are processed when a batch is collated, as in TRL (processing
them once in `Dataset.map` would store every pixel on disk).
"""

from dataclasses import dataclass
from typing import Any

import torch
from trl import prepare_multimodal_messages

from .data import get_images


def has_images(row: dict[str, Any]) -> bool:
    return "images" in row or "image" in row


def render_conversation(processing_class, messages, images=None, **template_kwargs) -> str:
    """The chat-template text of `messages`, with one image placeholder per image of `images` (TRL's layout)."""
    messages = prepare_multimodal_messages(messages, images=images or [])
    return processing_class.apply_chat_template(messages, tokenize=False, **template_kwargs)


@dataclass
class EncodedPrompts:
    """A batch of prompts encoded with their images.

    Fields:
        input_ids (`list[list[int]]`): each prompt's tokens, image placeholders expanded, unpadded.
        token_inputs (`dict[str, list[list[int]]]`): per-token inputs aligned with `input_ids` (e.g.
            `token_type_ids`, `mm_token_type_ids`), unpadded.
        visual_inputs (`dict[str, Tensor]`): the image tensors of the whole batch, per image in row order.
    """

    input_ids: list[list[int]]
    token_inputs: dict[str, list[list[int]]]
    visual_inputs: dict[str, torch.Tensor]


def encode_prompts(processing_class, texts: list[str], images: list[list]) -> EncodedPrompts:
    """One processor call for the batch (`images[i]` are the images of `texts[i]`, possibly none)."""
    out = processing_class(
        text=texts,
        images=images if any(images) else None,
        padding=True,
        padding_side="left",
        return_tensors="pt",
        add_special_tokens=False,  # the chat template already wrote the special tokens
    )
    ids, keep = out["input_ids"], out["attention_mask"].bool()
    token_inputs, visual_inputs = {}, {}
    for key, value in out.items():
        if key in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
            continue
        if not key.startswith("pixel_values") and value.shape[:2] == ids.shape:
            token_inputs[key] = [row[m].tolist() for row, m in zip(value, keep, strict=True)]
        else:
            visual_inputs[key] = value
    return EncodedPrompts([row[m].tolist() for row, m in zip(ids, keep, strict=True)], token_inputs, visual_inputs)


def row_images(row: dict[str, Any]) -> list:
    return list(get_images(row) or [])
