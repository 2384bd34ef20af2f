"""Vision-language rows (TRL's conventions, extended to videos: docs/grm.md, "Images and videos"): a conversation
rendered with its image and video placeholders, and a batch of prompts encoded with its images and videos by one
processor call when the batch is collated, as in TRL (processing them in `Dataset.map` would store every pixel)."""

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from trl import prepare_multimodal_messages

from .datasets import get_images, get_videos


def prepare_visual_messages(messages, images=None, videos=None) -> list[dict[str, Any]]:
    """`trl.prepare_multimodal_messages` (one image part per image before the first user text), then one video part
    per video after them, unless the messages already hold video parts."""
    messages = prepare_multimodal_messages(messages, images=images or [])
    has_video_parts = any(
        isinstance(part, dict) and part.get("type") == "video"
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )
    if not videos or has_video_parts:
        return messages
    first_user = next(i for i, message in enumerate(messages) if message["role"] == "user")
    content = messages[first_user]["content"]
    n = sum(1 for part in content if part.get("type") == "image")  # the video parts go after the image parts
    parts = [{"type": "video"} for _ in videos]
    messages[first_user] = {**messages[first_user], "content": [*content[:n], *parts, *content[n:]]}
    return messages


def with_row_visuals(prompt, row: dict[str, Any]):
    """`prompt` with the placeholders of `row`'s images and videos (unchanged for a text row): the prompt a
    vision-language model is given for generation."""
    images, videos = get_images(row), get_videos(row)
    return prepare_visual_messages(prompt, images, videos) if images or videos else prompt


def render_conversation(processing_class, messages, images=None, videos=None, **template_kwargs) -> str:
    """The chat-template text of `messages`, with one placeholder per image and per video."""
    messages = prepare_visual_messages(messages, images, videos)
    return processing_class.apply_chat_template(messages, tokenize=False, **template_kwargs)


def _frame(value):
    """A frame as stored: a PIL image, an array, or the `{"bytes", "path"}` dict `datasets` keeps for PIL images
    nested in lists (decoded here)."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        import io

        from PIL import Image

        return Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"])
    return value


def as_video(value):
    """A video as the processor takes it: a path as is, a list of PIL frames as PIL frames, else an array."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and (isinstance(value[0], dict) or hasattr(value[0], "convert")):
        return [_frame(frame) for frame in value]
    array = np.asarray(value)
    return array.astype(np.uint8) if array.dtype.kind in "iu" else array


def processor_visual_kwargs(images: list[list], videos: list[list] | None = None) -> dict[str, Any]:
    """`images=` / `videos=` for a batch's processor call (None if no row has any: a processor needs at least one)."""
    kwargs = {"images": images if any(images) else None}
    if videos is not None and any(videos):
        kwargs["videos"] = [as_video(video) for row in videos for video in row]
    return kwargs


def check_videos(dataset) -> None:
    """Before training: every video path exists, and the frames of a video given as a list have one size (a
    processor cannot stack frames of different sizes). An iterable dataset is checked on its first row."""
    from datasets import IterableDataset

    if isinstance(dataset, IterableDataset):
        rows = [next(iter(dataset))]
    else:  # only the video columns are read
        rows = dataset.select_columns([c for c in ("video", "videos") if c in dataset.column_names])
    for index, row in enumerate(rows):
        for video in get_videos(row) or []:
            if isinstance(video, str):
                if not os.path.exists(video) and "://" not in video:
                    raise ValueError(f"Row {index}: video path {video!r} does not exist.")
            elif isinstance(video, list) and video:
                frames = [_frame(frame) for frame in video]
                sizes = {f.size[::-1] if hasattr(f, "convert") else tuple(np.shape(f)[:2]) for f in frames}
                if len(sizes) > 1:
                    raise ValueError(
                        f"Row {index}: the frames of a video have different sizes {sorted(sizes)}; give every frame "
                        "of a video the same size (resize them when building the dataset)."
                    )
            elif np.ndim(video) != 4:
                raise ValueError(
                    f"Row {index}: a video must be a path, a list of frames or an array (T, H, W, C); got an array of "
                    f"shape {np.shape(video)}."
                )


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


def encode_visual_prompts(processing_class, texts: list[str], images: list[list], videos=None) -> EncodedPrompts:
    """One processor call for the batch (`images[i]` / `videos[i]` are those of `texts[i]`, possibly none)."""
    out = processing_class(
        text=texts,
        **processor_visual_kwargs(images, videos),
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
