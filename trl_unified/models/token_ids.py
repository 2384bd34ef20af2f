"""Token ids against a model's embedding table: a hidden id beyond it (a pad token added without resizing) is read
as 0 (TRL's fill), an id a model would read beyond it raises, naming the id (docs/ppo.md, "TRL's PPO recipe")."""

import contextlib

import torch
from torch import nn

from .loading import base_model


def embedding_rows(model) -> int | None:
    """Rows of `model`'s input embedding table (through DDP / DeepSpeed / PEFT wrappers; the full size under ZeRO-3),
    or None when the model has none that can be read."""
    while isinstance(getattr(model, "module", None), nn.Module):  # DDP, DeepSpeed engine
        model = model.module
    embeddings = None
    with contextlib.suppress(AttributeError, NotImplementedError):
        embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None and isinstance(getattr(embeddings, "weight", None), torch.Tensor):
        weight = embeddings.weight
        rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 keeps the full shape in ds_shape
    return rows


def in_table(token_id: int | None, rows: int | None) -> bool:
    """Whether `token_id` indexes a table of `rows` rows (True when the size is unknown)."""
    return token_id is not None and (rows is None or 0 <= token_id < rows)


def padding_fill_id(pad_token_id: int | None, rows: int | None) -> int:
    """The id that fills hidden positions for a model of `rows` embedding rows: the pad token where the table holds
    it, else 0 (TRL's fill; the attention mask hides the position, so any valid id gives the same numbers)."""
    return pad_token_id if in_table(pad_token_id, rows) else 0


def mask_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: int | None) -> torch.Tensor:
    """`input_ids` `(B, L)` with every hidden position (`attention_mask == 0`) whose id is beyond a table of `rows`
    rows set to 0; unchanged (the same tensor) when the size or the mask is unknown. No host sync."""
    if rows is None or attention_mask is None or attention_mask.shape != input_ids.shape:
        return input_ids
    return input_ids.masked_fill(((input_ids >= rows) | (input_ids < 0)) & (attention_mask == 0), 0)


def check_ids_in_table(
    input_ids: torch.Tensor, attention_mask, rows: int | None, what: str, whose: str = "the model's", tokenizer=None
) -> None:
    """Raise a ValueError naming the first id of `input_ids` that a model with `rows` embedding rows would read (an
    attended position) and cannot: `what` says whose ids they are ("Prompt 3"), `whose` which model reads them."""
    if rows is None or input_ids.numel() == 0:
        return
    bad = (input_ids >= rows) | (input_ids < 0)
    if attention_mask is not None:
        bad &= attention_mask.bool()
    if not bool(bad.any()):
        return
    token_id = int(input_ids[bad][0])
    token = tokenizer.convert_ids_to_tokens(token_id) if tokenizer is not None and token_id >= 0 else None
    name = f" ({token!r})" if token is not None else ""
    raise ValueError(
        f"{what} holds token id {token_id}{name}, but {whose} embedding table has {rows} rows (ids 0 to "
        f"{rows - 1}): the id cannot be embedded. A token added to the tokenizer needs a row: call "
        "model.resize_token_embeddings(len(tokenizer)) after tokenizer.add_special_tokens(...) (a pad token needs "
        "none: padding is masked), or remove the token from the data."
    )


def tokenizer_id_bound(tokenizer) -> int:
    """1 + the largest id `tokenizer` produces, its pad token left out when it is not also EOS (padding is masked
    before every forward, so it needs no embedding row)."""
    ids = set(tokenizer.get_vocab().values())
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        ids.discard(tokenizer.pad_token_id)
    if not ids:
        return 0
    return max(ids) + 1


def check_table_covers_tokenizer(model, tokenizer, what: str) -> None:
    """Raise unless `model`'s embedding table holds every id `tokenizer` produces (pad excepted, see
    `tokenizer_id_bound`). A larger table is fine (models often carry padding rows)."""
    rows = embedding_rows(model)
    bound = tokenizer_id_bound(tokenizer)
    if rows is not None and rows < bound:
        token = tokenizer.convert_ids_to_tokens(bound - 1)
        raise ValueError(
            f"The {what}'s embedding table has {rows} rows, too few for the policy's tokenizer, whose ids go up to "
            f"{bound - 1} ({token!r}): it reads the policy's token ids. Use a {what} built on the policy's "
            "tokenizer (e.g. AutoModelForSequenceClassification.from_pretrained(<policy or reward model path>, "
            "num_labels=1)); a table larger than the tokenizer is fine."
        )


@contextlib.contextmanager
def saved_without_unusable_pad(model):
    """While `model` is saved: a config pad id beyond its embedding table is written as None (and restored after).
    transformers' `Trainer.train` copies the tokenizer's pad id into the configs, and a saved `pad_token_id` beyond
    the table would stop the model from loading (`nn.Embedding` refuses such a `padding_idx`)."""
    base = base_model(model)
    rows, config = embedding_rows(base), getattr(base, "config", None)
    configs = [config, config and config.get_text_config(), getattr(base, "generation_config", None)]
    configs = {id(c): c for c in configs if c is not None and not in_table(getattr(c, "pad_token_id", None), rows)}
    # a composite config (Llava's) may have no pad_token_id at all
    unusable = [(c, c.pad_token_id) for c in configs.values() if getattr(c, "pad_token_id", None) is not None]
    for c, _ in unusable:
        c.pad_token_id = None
    try:
        yield model
    finally:
        for c, pad_token_id in unusable:
            c.pad_token_id = pad_token_id
