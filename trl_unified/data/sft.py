"""Supervised next-token data with the loss on the completion only (TRL's SFT conventions): tokenising rows of any
format (prompt/completion, messages, text; standard or conversational), truncation, and the typed `SFTBatch` with
its collator (text rows padded; vision-language rows through the processor)."""

from dataclasses import dataclass
from typing import Any

import torch
from trl import prepare_multimodal_messages

from ..models.loading import get_tokenizer
from .batch import TensorBatch, scalar_field
from .datasets import (
    get_images,
    get_videos,
    is_conversational_prompt,
    pad,
    split_prompt_completion,
    tokenize_prompt_completion,
)
from .vision import prepare_visual_messages, processor_visual_kwargs


def tokenize_sft_row(row: dict[str, Any], index: int, processing_class, args) -> dict[str, list[int]]:
    """`input_ids` and `completion_mask` (1 on tokens that carry the loss) of one text row, truncated."""
    prompt, completion = split_prompt_completion(row, args.dataset_text_field)
    if args.assistant_only_loss and row.get("messages"):
        template_kwargs = args.chat_template_kwargs or {}
        out = get_tokenizer(processing_class).apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **template_kwargs
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        if not any(mask):
            raise ValueError(
                "assistant_only_loss=True but the chat template marks no assistant tokens: it needs "
                "{% generation %} ... {% endgeneration %} around assistant turns."
            )
    else:
        prompt_ids, completion_ids = tokenize_prompt_completion(
            processing_class, prompt, completion, args.chat_template_kwargs, args.eos_token
        )
        ids = prompt_ids + completion_ids
        mask = [0 if args.completion_only_loss is not False else 1] * len(prompt_ids) + [1] * len(completion_ids)
    if args.max_length is not None and len(ids) > args.max_length:
        keep = slice(None, args.max_length) if args.truncation_mode == "keep_start" else slice(-args.max_length, None)
        ids, mask = ids[keep], mask[keep]
    if sum(mask[1:]) == 0:
        raise ValueError(
            f"Row {index} has no judgment tokens left to learn from (all labels masked) after truncation to "
            f"max_length={args.max_length} with truncation_mode={args.truncation_mode!r}. Increase max_length, "
            "shorten the prompt, or remove the row."
        )
    return {"input_ids": ids, "completion_mask": mask}


@dataclass
class SFTBatch(TensorBatch):
    """Rows for next-token training with the loss on the completion only, right-padded to L positions.

    Fields:
        input_ids (`(B, L)`), attention_mask (`(B, L)`): the tokens and their mask.
        labels (`(B, L)`): the token ids where the loss applies, -100 elsewhere (prompt, padding).
        visual_inputs (`dict[str, Tensor]`): the processor's image tensors for the batch (e.g. `pixel_values` laid out
            per image patch, `image_grid_thw` per image); empty for text rows. Passed to the model as they are.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    visual_inputs: dict[str, torch.Tensor] = scalar_field(default_factory=dict)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward (everything but the labels)."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, **self.visual_inputs}


class SFTCollator:
    """Right-pads tokenised rows (labels -100 off the completion); vision-language rows go through the processor."""

    def __init__(self, processing_class, args):
        self.processing_class, self.args = processing_class, args
        self.tokenizer = get_tokenizer(processing_class)

    def __call__(self, rows: list[dict[str, Any]]) -> SFTBatch:
        if "input_ids" in rows[0]:
            ids, multiple = [torch.tensor(r["input_ids"]) for r in rows], self.args.pad_to_multiple_of
            input_ids = pad(ids, self.tokenizer.pad_token_id, "right", multiple)
            attention_mask = pad([torch.ones_like(t) for t in ids], 0, "right", multiple)
            loss_mask = pad([torch.tensor(r["completion_mask"]) for r in rows], 0, "right", multiple)
            return SFTBatch(input_ids, attention_mask, input_ids.masked_fill(loss_mask == 0, -100))
        kwargs = self.args.chat_template_kwargs or {}
        full_texts, prompt_texts, images, videos = [], [], [], []
        for row in rows:
            prompt, completion = split_prompt_completion(row, self.args.dataset_text_field)
            if not is_conversational_prompt(prompt):
                raise ValueError("Rows with images or videos need conversational prompts (lists of messages).")
            row_images, row_videos = get_images(row) or [], get_videos(row) or []
            prompt = prepare_visual_messages(prompt, row_images, row_videos)
            completion = prepare_multimodal_messages(completion, images=[])
            prompt_texts.append(
                self.processing_class.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **kwargs)
            )
            full_texts.append(self.processing_class.apply_chat_template(prompt + completion, tokenize=False, **kwargs))
            if not full_texts[-1].startswith(prompt_texts[-1]):
                raise ValueError("The chat template's generation prompt is not a prefix of the assistant turn.")
            images.append(row_images)
            videos.append(row_videos)
        batch = self.processing_class(
            text=full_texts,
            **processor_visual_kwargs(images, videos),
            padding=True,
            padding_side="right",
            return_tensors="pt",
        )
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        # The expanded prompt length: the row's length minus its completion tokens (which hold no image or video
        # placeholder), counted by the tokenizer alone, so the images and videos are processed once.
        count = lambda text: len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        for i, (full_text, prompt_text) in enumerate(zip(full_texts, prompt_texts, strict=True)):
            labels[i, : int(batch["attention_mask"][i].sum()) - (count(full_text) - count(prompt_text))] = -100
        if self.args.max_length is not None and batch["input_ids"].size(1) > self.args.max_length:
            raise ValueError(
                f"A vision-language row has {batch['input_ids'].size(1)} tokens, more than max_length="
                f"{self.args.max_length}; image tokens cannot be truncated. Increase max_length."
            )
        visual = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
        return SFTBatch(batch["input_ids"], batch["attention_mask"], labels, visual)


class ChatMLCollator:
    """TRL's `DataCollatorForChatML` contract (GKD's default collator): each row's prompt and completion tokens,
    everything left-padded, as TRL's keys: `input_ids`, `attention_mask`, `labels` (-100 on the prompt and padding),
    `prompts` and `prompt_attention_mask` (the prompt tokens alone, what on-policy generation continues).

    Rows: `messages` (the last turn is the completion, the turns before it the prompt; TRL's format), `prompt` +
    `completion` (standard or conversational), or pre-tokenised `input_ids` with a `completion_mask`. A row longer
    than `max_length` (None: the tokenizer's `model_max_length`, at most 1024, as TRL) keeps its last `max_length`
    tokens, so its prompt loses its start; a row left with no prompt token is an error. With `max_prompt_length`
    (IW-OPD's collator) the budgets are separate instead: the prompt is cut to `max_prompt_length` tokens (on the
    tokenizer's `truncation_side`), the completion to what remains of `max_length`, and `messages` rows that end
    with a user turn are prompts alone (on-policy rounds only).
    """

    def __init__(self, tokenizer, max_length=None, chat_template_kwargs=None, max_prompt_length: int | None = None):
        self.tokenizer = get_tokenizer(tokenizer)
        if self.tokenizer.pad_token_id is None:
            raise ValueError("The tokenizer does not have a pad token. Please set `pad_token_id` in the tokenizer.")
        self.max_length = max_length if max_length is not None else min(self.tokenizer.model_max_length, 1024)
        self.chat_template_kwargs, self.max_prompt_length = chat_template_kwargs, max_prompt_length

    def split(self, row: dict[str, Any]) -> tuple[list[int], list[int]]:
        """The prompt and completion token ids of one row, truncated to `max_length` from the start."""
        if "input_ids" in row:
            ids, mask = list(row["input_ids"]), row.get("completion_mask")
            if mask is None:
                raise ValueError("A pre-tokenised row needs a `completion_mask` (1 on the completion's tokens).")
            start = list(mask).index(1) if 1 in mask else len(ids)
            prompt_ids, completion_ids = ids[:start], ids[start:]
        elif self.max_prompt_length is not None and row.get("messages", [{}])[-1].get("role") != "assistant":
            rendered = self.tokenizer.apply_chat_template(
                row["messages"],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **(self.chat_template_kwargs or {}),
            )
            prompt_ids, completion_ids = list(rendered["input_ids"]), []
        else:
            prompt, completion = split_prompt_completion(row)
            prompt_ids, completion_ids = tokenize_prompt_completion(
                self.tokenizer, prompt, completion, self.chat_template_kwargs
            )
        if self.max_prompt_length is not None:  # separate budgets (IW-OPD's)
            if len(prompt_ids) > self.max_prompt_length:
                keep_end = self.tokenizer.truncation_side == "left"
                prompt_ids = (
                    prompt_ids[-self.max_prompt_length :] if keep_end else prompt_ids[: self.max_prompt_length]
                )
            return prompt_ids, completion_ids[: max(self.max_length - len(prompt_ids), 0)]
        excess = len(prompt_ids) + len(completion_ids) - self.max_length
        if excess > 0:  # keep the end: the prompt's start goes first, then the completion's
            dropped_from_completion = max(excess - len(prompt_ids), 0)
            prompt_ids, completion_ids = prompt_ids[excess:], completion_ids[dropped_from_completion:]
        if not prompt_ids:
            raise ValueError(
                f"An example has no prompt tokens left after truncation to max_length={self.max_length}. This "
                "happens when the completion alone fills the whole window, so the prompt is entirely dropped, "
                "leaving nothing to generate from. Increase `max_length`."
            )
        return prompt_ids, completion_ids

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        prompts, sequences, labels = [], [], []
        for row in rows:
            prompt_ids, completion_ids = self.split(row)
            prompts.append(torch.tensor(prompt_ids))
            sequences.append(torch.tensor(prompt_ids + completion_ids))
            labels.append(torch.tensor([-100] * len(prompt_ids) + completion_ids))
        pad_id = self.tokenizer.pad_token_id
        return {
            "input_ids": pad(sequences, pad_id, "left"),
            "attention_mask": pad([torch.ones_like(s) for s in sequences], 0, "left"),
            "labels": pad(labels, -100, "left"),
            "prompts": pad(prompts, pad_id, "left"),
            "prompt_attention_mask": pad([torch.ones_like(p) for p in prompts], 0, "left"),
        }
