"""Dataset formats and checks, padding, and the grouped samplers (map-style and streaming) of the online trainers."""

from collections.abc import Sequence
from typing import Any

import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

from ..models.loading import base_model, get_tokenizer


IMAGE_COLUMNS = ("image", "images")
VIDEO_COLUMNS = ("video", "videos")


def is_conversational_prompt(prompt: Any) -> bool:
    """True for a list of `{"role", "content"}` messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def pad(
    tensors: Sequence[torch.Tensor], padding_value: int, side: str = "right", pad_to_multiple_of: int | None = None
) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into `(N, L)`, padding on `side` ("left" or "right")."""
    if not tensors:
        return torch.empty(0, 0, dtype=torch.long)
    length = max(t.size(0) for t in tensors)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(tensors), length), padding_value, dtype=tensors[0].dtype, device=tensors[0].device)
    for i, t in enumerate(tensors):
        start = length - t.size(0) if side == "left" else 0
        out[i, start : start + t.size(0)] = t
    return out


def _media(row: dict[str, Any], plural: str, single: str) -> list | None:
    if row.get(plural) is not None:
        return list(row[plural]) or None
    return [row[single]] if row.get(single) is not None else None


def get_images(row: dict[str, Any]) -> list | None:
    """The images of a row (`images` list or single `image`), or None."""
    return _media(row, "images", "image")


def get_videos(row: dict[str, Any]) -> list | None:
    """The videos of a row (`videos` list or single `video`), or None. A video is a path, an array of frames
    `(T, H, W, C)`, or a list of frames (PIL images or `(H, W, C)` arrays)."""
    return _media(row, "videos", "video")


def column_names(dataset) -> list[str] | None:
    """Column names of a `Dataset`/`IterableDataset` (None when an iterable dataset does not know them)."""
    names = dataset.column_names if isinstance(dataset, (Dataset, IterableDataset)) else None
    return list(names) if names is not None else None


def require_columns(dataset, required: Sequence[Sequence[str]], dataset_name: str, trainer_name: str) -> None:
    """Raise unless, for each group of alternatives in `required`, one column is present; and the set is non-empty."""
    if isinstance(dataset, Dataset) and len(dataset) == 0:
        raise ValueError(f"{dataset_name} is empty: {trainer_name} needs at least one row.")
    names = column_names(dataset)
    if names is None:
        return
    for alternatives in required:
        if not any(col in names for col in alternatives):
            wanted = " or ".join(repr(c) for c in alternatives)
            raise ValueError(
                f"{dataset_name} has columns {names} but {trainer_name} needs a {wanted} column. "
                f"Rename your column (dataset.rename_column(old, {alternatives[0]!r})) "
                "or map your rows to that format."
            )


def split_prompt_completion(row: dict[str, Any], text_field: str = "text") -> tuple[Any, Any]:
    """The (prompt, completion) of a training row, whatever its format.

    - `prompt` + `completion` (standard strings, or conversational message lists);
    - `messages`: the last turn must be the assistant's (the completion), the turns before it are the prompt;
    - `text_field` only: no prompt, the whole text is the completion (plain language modelling).
    """
    if "prompt" in row and "completion" in row:
        return row["prompt"], row["completion"]
    if row.get("messages"):
        messages = row["messages"]
        if messages[-1].get("role") != "assistant":
            raise ValueError(
                f"The last message of a 'messages' row must be the assistant's (the judgment), got role "
                f"{messages[-1].get('role')!r}. Append the judgment as an assistant turn."
            )
        return messages[:-1], messages[-1:]
    if text_field in row:
        return "", row[text_field]
    raise ValueError(
        f"Row has columns {sorted(row)}: expected 'prompt' + 'completion', 'messages', or {text_field!r}."
    )


def tokenize_prompt_completion(
    processing_class, prompt, completion, chat_template_kwargs: dict | None = None, eos_token: str | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of the prompt and of the completion, split where the prompt ends.

    Conversational rows go through the chat template twice (prompt with a generation prompt, then prompt +
    completion) and the boundary is where the two agree: this works for any chat template, and an error names the
    template problem when the prompt's tokens are not a prefix of the whole conversation's. Standard rows are
    tokenised separately and the EOS token is appended to the completion (as `trl.SFTTrainer` does).
    """
    tokenizer = get_tokenizer(processing_class)
    kwargs = chat_template_kwargs or {}
    if is_conversational_prompt(completion) or is_conversational_prompt(prompt):

        def render(messages, **options):
            encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options, **kwargs)
            return list(encoded["input_ids"])

        prompt_ids = render(prompt, add_generation_prompt=True) if prompt else []
        full_ids = render(list(prompt or []) + list(completion))
        if full_ids[: len(prompt_ids)] != prompt_ids:
            raise ValueError(
                "The chat template renders the prompt with add_generation_prompt=True differently from the start "
                "of the full conversation, so the judgment's tokens cannot be separated from the prompt's. Use a chat "
                "template whose generation prompt is a prefix of the assistant turn."
            )
        return prompt_ids, full_ids[len(prompt_ids) :]
    prompt_ids = list(tokenizer(prompt)["input_ids"]) if prompt else []
    completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    eos_id = tokenizer.convert_tokens_to_ids(eos_token) if eos_token else tokenizer.eos_token_id
    if eos_id is not None and (not completion_ids or completion_ids[-1] != eos_id):
        completion_ids.append(eos_id)
    return prompt_ids, completion_ids


def configure_iterable_loading(args, train_dataset, eval_dataset) -> None:
    """Iterable datasets are read as rows: each process reads its own shard of the stream (no dispatch from process
    0, which would need tensor batches to concatenate; typed batches are not). Must run before
    `transformers.Trainer.__init__` builds the accelerator from `args.accelerator_config`."""
    if not has_iterable(train_dataset, eval_dataset):
        return
    if args.accelerator_config.dispatch_batches:
        raise ValueError(
            "Iterable datasets require `dispatch_batches=False`, but it is set to `True` in `accelerator_config`. "
            "Please set it to `False`: rows are python dicts and each process reads its own shard."
        )
    args.accelerator_config.dispatch_batches = False


def has_iterable(*datasets) -> bool:
    """Whether any of `datasets` (or of the values of a dict of eval sets) is an `IterableDataset`."""
    return any(isinstance(d, IterableDataset) for x in datasets for d in (x.values() if isinstance(x, dict) else [x]))


def check_dataset_types(train_dataset, eval_dataset) -> None:
    """`train_dataset`: one `Dataset` / `IterableDataset` (a `DatasetDict` holds splits, not rows); `eval_dataset`:
    one, or a dict of them (several eval sets, each logged under its key)."""
    if isinstance(train_dataset, (DatasetDict, IterableDatasetDict)):
        splits = list(train_dataset)
        raise ValueError(
            f"train_dataset is a {type(train_dataset).__name__} with splits {splits}; the trainer needs one split. "
            f"Pass e.g. dataset[{(splits or ['train'])[0]!r}] (and another split as eval_dataset)."
        )
    evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval", eval_dataset)]
    for name, dataset in [("train", train_dataset), *evals]:
        if dataset is not None and not isinstance(dataset, (Dataset, IterableDataset)):
            raise TypeError(
                f"`{name}_dataset` must be a `Dataset` or `IterableDataset`, got `{type(dataset).__name__}`. Build "
                "one with datasets.Dataset.from_dict / Dataset.from_list, or load_dataset(...)."
            )


def dataset_columns(dataset) -> list[str]:
    """Column names, read from the first row when an iterable dataset does not declare them."""
    names = column_names(dataset)
    return names if names is not None else list(next(iter(dataset), {}))  # an iterable dataset: its first row


def check_images_fit(dataset, processing_class, model) -> None:
    """Rows with images or videos need a vision-language model and a processor with an image (video) processor
    (TRL's wording first); video rows must be readable (see `vision.check_videos`)."""
    names = dataset_columns(dataset) if dataset is not None else []
    videos, images = [c for c in names if c in VIDEO_COLUMNS], [c for c in names if c in IMAGE_COLUMNS]
    if (videos or images) and getattr(base_model(model).config, "vision_config", None) is None:
        if videos:
            raise ValueError(
                f"The dataset has a video column ({videos}), but {type(model).__name__} is not a vision-language "
                "model (no vision_config). Use a video-capable vision-language model (e.g. Qwen2-VL), or drop the "
                "column."
            )
        raise ValueError(
            "The dataset appears to be vision-related (contains 'image' or 'images' keys), but the provided model "
            "does not seem to be a vision-language model. Please check your model and dataset. "
            f"({type(model).__name__} has no vision_config: use a vision-language model, or drop the image column.)"
        )
    if videos:
        from .vision import check_videos

        if getattr(processing_class, "video_processor", None) is None:
            raise ValueError(
                f"The dataset has a video column ({videos}), but the processing class "
                f"({type(processing_class).__name__}) has no video processor. Pass the model's AutoProcessor with its "
                "video processor (transformers' video processors need torchvision: pip install trl_unified[vision])."
            )
        check_videos(dataset)
    if images and not hasattr(processing_class, "image_processor"):
        raise ValueError(
            f"The dataset has an image column ({images}) but the processing class is a "
            f"{type(processing_class).__name__}, not an image processor. Pass the vision-language model's "
            "AutoProcessor, or remove the image column."
        )
