"""TRL's preference dataset formats and their tokenisation, for every preference trainer: explicit or implicit
prompts (`extract_shared_prompt`), standard or conversational rows, rows with images (`split_completions_with_images`),
encoder-decoder policies (`split_encoder_decoder`), and TRL's legacy tokenisation and columns of its ORPO and CPO
trainers (`split_legacy`). `prepare_preference_dataset` chooses among them from `TokenisationOptions`; the formats,
the tokenisation and the dropped rows are TRL's: docs/dpo.md and docs/kto.md ("Datasets"), docs/orpo.md."""

import logging
from dataclasses import dataclass
from typing import Any

from datasets import Dataset
from trl import extract_prompt, is_conversational, maybe_apply_chat_template, unpair_preference_dataset

from ..data.datasets import column_names, get_images, get_videos
from ..data.vision import render_conversation
from ..models.loading import get_tokenizer


logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # TRL's label of a token outside the loss (its legacy `<key>_labels` columns)


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
    prompt_options = {}
    if isinstance(row["prompt"], list):
        prompt_options["add_generation_prompt"] = True
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


def split_encoder_decoder(row: dict, processing_class, keys: tuple[str, ...], max_completion_length: int | None):
    """For an encoder-decoder policy, as TRL's ORPO and CPO: `prompt_ids` (the encoder's input) and one `<key>_ids`
    per completion key (the decoder's targets), each tokenised on its own with the tokenizer's special tokens (T5's
    closing `</s>`), completions cut to `max_completion_length`. A conversation is rendered by the chat template."""
    row = {**row, **maybe_apply_chat_template(row, processing_class)}  # text stays text
    tokenizer = get_tokenizer(processing_class)
    prompt_ids = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
    truncation = dict(truncation=True, max_length=max_completion_length) if max_completion_length else {}
    completions = {key: tokenizer(row[key], add_special_tokens=True, **truncation)["input_ids"] for key in keys}
    return {"prompt_ids": prompt_ids, **{f"{key}_ids": ids for key, ids in completions.items()}}


def extract_shared_prompt(row: dict, keys: tuple[str, ...]) -> dict:
    """TRL's `extract_prompt` for rows whose completions repeat an implicit prompt: the prompt is the common prefix of
    `chosen` and `rejected` (trl.extract_prompt), stripped from every other completion key too (TPO's `reference`);
    a completion that does not start with it raises."""
    extracted = extract_prompt(row)
    prompt = extracted["prompt"]
    for key in keys:
        if key in extracted:
            continue
        if row[key][: len(prompt)] != prompt:
            raise ValueError(
                f"The `{key}` completion does not start with the implicit prompt extracted from `chosen`/`rejected`. "
                f"Either provide an explicit `prompt` column, or make sure the `{key}` completion shares the same "
                "prompt prefix as the `chosen` and `rejected` completions."
            )
        extracted[key] = row[key][len(prompt) :]
    return extracted


def split_legacy(
    row: dict, processing_class, keys: tuple[str, ...], max_length: int | None, max_completion_length: int | None
) -> dict[str, list[int]]:
    """TRL's legacy tokenisation of a decoder-only row (its ORPO and CPO trainers' `tokenize_row`), in TRL's columns:
    a conversation is rendered to text by the chat template (`maybe_apply_chat_template`); prompt and prompt +
    completion are tokenised without special tokens, the completion starting where they differ (one merged token at
    most); the tokenizer's BOS is put first and its EOS last where missing; completions are cut to
    `max_completion_length` (trl_unified: TRL reads it for encoder-decoder models only), then to fit `max_length`
    after the prompt. Columns: `prompt_input_ids`, and per key `<key>_input_ids` (prompt + completion) and
    `<key>_labels` (-100 over the prompt)."""
    row = {**row, **maybe_apply_chat_template(row, processing_class)}
    tokenizer = get_tokenizer(processing_class)
    prompt_ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    prompts, completions = {}, {}
    for key in keys:
        full = tokenizer(row["prompt"] + row[key], add_special_tokens=False)["input_ids"]
        start = len(prompt_ids) if full[: len(prompt_ids)] == prompt_ids else len(prompt_ids) - 1  # a merged token
        prompts[key], completions[key] = full[:start], full[start:]
    lengths = [len(p) for p in prompts.values()]
    differing = sum(a != b for p in prompts.values() for a, b in zip(p, next(iter(prompts.values()))))
    if max(lengths) - min(lengths) > 1 or differing > 1:
        raise ValueError(
            "Chosen and rejected prompt_input_ids might only differ on the last token due to tokenizer merge ops."
        )
    prompt_ids = prompt_ids[: min(lengths)]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out = {"prompt_input_ids": _with_bos(prompt_ids, bos)}
    for key in keys:
        prompt, completion = _with_bos(prompts[key], bos), completions[key]
        if not completion or completion[-1] != eos:
            completion = [*completion, eos]
        if max_completion_length is not None:
            completion = completion[:max_completion_length]
        if max_length is not None:
            completion = completion[: max(0, max_length - len(prompt))]
        out[f"{key}_input_ids"] = prompt + completion
        out[f"{key}_labels"] = [IGNORE_INDEX] * len(prompt) + completion
    return out


def _with_bos(ids: list[int], bos: int | None) -> list[int]:
    return [bos, *ids] if bos is not None and (not ids or ids[0] != bos) else ids


def legacy_encoder_decoder_columns(row: dict, keys: tuple[str, ...]) -> dict[str, list[int]]:
    """TRL's legacy columns of an encoder-decoder row (`split_encoder_decoder`'s split): `prompt_input_ids` and per
    key `<key>_labels` (the decoder's targets)."""
    return {"prompt_input_ids": row["prompt_ids"], **{f"{key}_labels": row[f"{key}_ids"] for key in keys}}


@dataclass(frozen=True)
class TokenisationOptions:
    """How a trainer's rows are tokenised (`prepare_preference_dataset`).

    keys: the completion columns of a row (("chosen", "rejected"), TPO's ("chosen", "rejected", "reference"), or
        ("completion",) for unpaired rows). paired: False unpairs chosen/rejected rows into completion/label rows.
    encoder_decoder: split for an encoder-decoder policy (`split_encoder_decoder`).
    max_completion_length: completion tokens kept (None: all). legacy: TRL's ORPO/CPO column layout.
    """

    keys: tuple[str, ...] = ("chosen", "rejected")
    paired: bool = True
    encoder_decoder: bool = False
    max_completion_length: int | None = None
    legacy: bool = False


def prepare_preference_dataset(dataset, processing_class, args, name: str, options: TokenisationOptions):
    """TRL's preparation of a preference dataset (see the module docstring). Idempotent: tokenised data is returned
    as is. `options.paired=False` unpairs `chosen`/`rejected` rows into `completion`/`label` rows."""
    tokenised = {"prompt_ids", "prompt_text", "prompt_input_ids"}
    if dataset is None or tokenised & set(column_names(dataset) or next(iter(dataset)).keys()):
        return dataset
    map_kwargs = {"num_proc": args.dataset_num_proc} if isinstance(dataset, Dataset) else {}
    first = next(iter(dataset))
    if "prompt" not in first:
        dataset = dataset.map(extract_shared_prompt, fn_kwargs={"keys": options.keys}, **map_kwargs)
    if not options.paired and "chosen" in first:
        dataset = unpair_preference_dataset(dataset, **map_kwargs)
    keys = options.keys if options.paired else ("completion",)
    fn_kwargs = {"processing_class": processing_class, "keys": keys}
    if {"images", "image", "videos", "video"} & first.keys():  # media stay in the rows; the collator processes them
        return dataset.map(split_completions_with_images, fn_kwargs=fn_kwargs, **map_kwargs)
    if options.encoder_decoder:
        limit = options.max_completion_length
        dataset = dataset.map(split_encoder_decoder, fn_kwargs={**fn_kwargs, "max_completion_length": limit})
        if options.legacy:
            split = ["prompt_ids", *(f"{key}_ids" for key in keys)]
            dataset = dataset.map(legacy_encoder_decoder_columns, fn_kwargs={"keys": keys}, remove_columns=split)
        return dataset
    if options.legacy:
        limits = {"max_length": args.max_length, "max_completion_length": options.max_completion_length}
        dataset = dataset.map(split_legacy, fn_kwargs={**fn_kwargs, **limits}, **map_kwargs)
        return _drop_rows_without_completion(dataset, name, args.max_length, map_kwargs, "chosen_labels")
    dataset = _split_decoder_only(dataset, processing_class, args, name, keys, map_kwargs, fn_kwargs)
    if options.max_completion_length is not None:
        dataset = dataset.map(_cut_completions, fn_kwargs={"keys": keys, "limit": options.max_completion_length})
    return dataset


def _cut_completions(row: dict, keys: tuple[str, ...], limit: int) -> dict:
    return {f"{key}_ids": row[f"{key}_ids"][:limit] for key in keys}


def _split_decoder_only(dataset, processing_class, args, name, keys, map_kwargs, fn_kwargs):
    """Text rows get the EOS token appended, then every row is split (`split_completions`); with
    `truncation_mode="keep_start"`, rows whose prompt alone fills `max_length` are dropped, as TRL does."""
    if not is_conversational(next(iter(dataset))):
        eos = get_tokenizer(processing_class).eos_token

        def add_eos(row):
            return {key: row[key] if row[key].endswith(eos) else row[key] + eos for key in keys}

        dataset = dataset.map(add_eos, **map_kwargs)
    dataset = dataset.map(split_completions, fn_kwargs=fn_kwargs, **map_kwargs)
    if args.truncation_mode != "keep_start":
        return dataset
    return _drop_rows_without_completion(dataset, name, args.max_length, map_kwargs, "prompt_ids")


def _drop_rows_without_completion(dataset, name: str, max_length: int | None, map_kwargs: dict, column: str):
    """Drop the rows whose prompt alone fills `max_length` (`column`'s first completion token would be cut), as TRL's
    DPO does; raise when no row is left."""
    if max_length is None:
        return dataset

    def has_completion(row) -> bool:
        labels = row[column]
        prompt_length = len(labels) if column == "prompt_ids" else labels.count(IGNORE_INDEX)
        return prompt_length < max_length

    before = len(dataset) if isinstance(dataset, Dataset) else None
    dataset = dataset.filter(has_completion, **map_kwargs)
    if before is not None and len(dataset) < before:
        if len(dataset) == 0:
            raise ValueError(
                f"Every row of the {name} dataset has a prompt of max_length={max_length} tokens or more, "
                "so no completion token would remain. Raise max_length or shorten the prompts."
            )
        logger.warning(
            f"{before - len(dataset)} of {before} rows of the {name} dataset were dropped: their prompt alone fills "
            f"max_length={max_length}, leaving no completion token (as TRL does). Raise max_length to keep them."
        )
    return dataset
