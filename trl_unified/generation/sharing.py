"""Shared-prefix encoding: rows that repeat a prompt (the G completions of an online group) encode it once; and the
decisions whether a forward or a generation may share prompts, with the reason when not.

Prefix Grouper (Liu et al., 2025, arXiv:2506.05433): reusing the shared prompt's key/value cache for every completion
gives the same outputs and gradients as running each row on its own. Fallbacks are reported once per reason
(`report_fallback`). See docs/shared_prefix.md.
"""

import copy
import inspect

import torch
from transformers import Cache

from ..models.loading import base_model
from .fallbacks import report_fallback


_unsupported: dict[type, str] = {}  # model classes whose cache turned out not to expand by row, and why


class PrefixSharingUnsupported(Exception):
    """The model's cache cannot be expanded from one row per prompt to one row per completion (e.g. the recurrent
    state of a hybrid Mamba / linear-attention model); callers fall back to the plain path."""


def group_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows that share a prompt, as `(first, inverse)`: `first` `(U,)` is the first row of each distinct prompt and
    `inverse` `(B,)` the distinct prompt of each row, so that `x[first][inverse]` equals `x` on the prompt positions.

    Prompts are equal when their ids and their padding are. Returns None when every prompt is distinct (nothing to
    share) or the prompts are a single token (nothing before the last token to cache).

    Example:
    ```python
    >>> ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]]); mask = (ids != 0).long()
    >>> group_prompts(ids, mask)
    (tensor([0, 2]), tensor([0, 0, 1]))
    ```
    """
    if prompt_ids.size(1) < 2:
        return None
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)  # (B,)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    if num_groups == prompt_ids.size(0):
        return None
    rows = torch.arange(prompt_ids.size(0), device=prompt_ids.device)
    first = torch.full((num_groups,), prompt_ids.size(0), device=prompt_ids.device, dtype=torch.long)
    return first.scatter_reduce(0, inverse, rows, reduce="amin"), inverse  # first: (U,)


def common_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int):
    """The tokens every row's prompt begins with (a chat template's system prompt, a dataset's shared instruction),
    and a layout that encodes them once for all rows: `(k, order)` with `order` `(B, T)` the column each position
    reads, so that `x.gather(1, order)` puts each row's first `k` real tokens first, then its left padding, then the
    rest unmoved (the last `T - k - padding` columns keep their place). With positions counted over the real tokens
    (`position_ids_from_mask` of the reordered mask) each row computes what it computes unpadded, and
    `encode_prefix(..., k, ((0,), (0,) * B))` serves all rows from one pass over the `k` tokens.

    None when fewer than 2 rows, a common run shorter than 2 tokens (every prompt keeps its last token out of it:
    that position predicts the first completion token), or a row whose prompt is not one left-padded span.

    Example:
    ```python
    >>> ids = torch.tensor([[0, 7, 8, 5, 1], [7, 8, 6, 2, 1]]); mask = (ids != 0).long()
    >>> k, order = common_prefix(ids, mask, 4)
    >>> k, ids.gather(1, order)
    (2, tensor([[7, 8, 0, 5, 1], [7, 8, 6, 2, 1]]))
    ```
    """
    batch, width = input_ids.shape
    prompt_mask = attention_mask[:, :prompt_length].bool()
    starts = prompt_length - prompt_mask.sum(1)  # (B,) each row's first real prompt column
    columns = torch.arange(width, device=input_ids.device)
    if batch < 2 or not torch.equal(prompt_mask, columns[:prompt_length] >= starts[:, None]):
        return None
    limit = int((prompt_length - starts).min()) - 1
    if limit < 2:
        return None
    real = input_ids.gather(1, starts[:, None] + columns[:limit])  # (B, limit) each row's first real tokens
    k = int((real == real[:1]).all(0).long().cumprod(0).sum())
    if k < 2:
        return None
    order = torch.where(columns < k, starts[:, None] + columns, columns - k)
    order = torch.where(columns >= k + starts[:, None], columns.expand(batch, width), order)
    return k, order


def common_prefix_cache(model, input_ids, attention_mask, position_ids, k: int) -> Cache:
    """`encode_prefix` of the first `k` columns of rows laid out by `common_prefix`: one pass for all rows."""
    inverse = torch.zeros(input_ids.size(0), dtype=torch.long, device=input_ids.device)  # every row: the first's
    return encode_prefix(model, input_ids, attention_mask, k, (inverse[:1], inverse), position_ids)


def encode_prefix(model, input_ids, attention_mask, length: int, groups, position_ids=None, expand=True) -> Cache:
    """The KV cache of the first `length` positions, computed once per distinct prompt and indexed out to every row.

    Args:
        model (`torch.nn.Module`): a decoder-only model (or a DDP / PEFT wrapper) whose forward takes `use_cache`
            and `logits_to_keep`.
        input_ids (`torch.LongTensor`): `(B, T)`; rows of a group must be equal on `[:length]`.
        attention_mask (`torch.LongTensor`): `(B, T)`.
        length (`int`): how many leading positions to cache.
        groups (`tuple[torch.Tensor, torch.Tensor]`): `(first, inverse)` from `group_prompts`.
        position_ids (`torch.LongTensor`, *optional*): `(B, T)` positions (generation derives them from the mask);
            the model's default (`cache_position`) otherwise.
        expand (`bool`, defaults to `True`): index the cache out to the `B` rows; False: one row per distinct prompt
            (`split_rows` then makes caches for subsets of the rows).

    Returns:
        (`transformers.Cache`): the cache with `B` rows (`U` without `expand`). Under grad, the index from U to B
            rows is part of the graph, so the backward of every row's loss flows into one prompt pass per group.
    """
    first, inverse = groups
    kwargs = {} if position_ids is None else {"position_ids": position_ids[first, :length]}
    # The bare module: a DDP / DeepSpeed wrapper expects one forward per backward, and the row pass that follows
    # is that forward; gradients of both passes reach the parameters through autograd all the same.
    out = (model.module if hasattr(model, "module") else model)(
        input_ids=input_ids[first, :length],
        attention_mask=attention_mask[first, :length],
        use_cache=True,
        logits_to_keep=1,  # the prefix's logits are not needed
        **kwargs,
    )
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    return _select_rows(model, cache, inverse) if expand else cache


def split_rows(model, cache: Cache, indices: list[torch.Tensor]) -> list[Cache]:
    """Caches of the rows `indices[k]` of `cache` each (`encode_prefix(expand=False)`'s `U` rows indexed by a part
    of `inverse`), sharing nothing that a forward on one of them would change: e.g. one for rows scored with grad,
    one for rows scored without."""
    if not isinstance(getattr(cache, "layers", None), list):
        raise PrefixSharingUnsupported(f"its cache ({type(cache).__name__}) is not a list of layers to copy")
    parts = []
    for index in indices:
        part = copy.copy(cache)
        part.layers = [copy.copy(layer) for layer in cache.layers]  # a forward on `part` reassigns its layers' tensors
        parts.append(_select_rows(model, part, index))
    return parts


def _select_rows(model, cache: Cache, index: torch.Tensor) -> Cache:
    try:
        cache.batch_select_indices(index)  # (U, ...) -> (len(index), ...)
    except (AttributeError, NotImplementedError, TypeError) as e:
        reason = f"its cache ({type(cache).__name__}) cannot be expanded by row ({e})"
        _unsupported[type(_base_model(model))] = reason
        raise PrefixSharingUnsupported(reason) from e
    return cache


def _base_model(model):
    """The model under a DDP / DeepSpeed wrapper (`.module`) and a PEFT wrapper."""
    return base_model(model.module if hasattr(model, "module") else model)


def generation_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """`(B, T)` positions as `GenerationMixin` derives them from a left-padded mask: 0 on padding, then 0, 1, ..."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def cache_kwarg(model) -> str:
    """The KV-cache keyword of `model.forward` / `generate`: `cache` (transformers >= 5.2x), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(_base_model(model).forward).parameters else "past_key_values"


def unsupported_reason(model, extra_inputs: dict | None = None) -> str | None:
    """Why `model` (or these inputs) cannot take the shared-prefix path, or None when it can."""
    unwrapped = model.module if hasattr(model, "module") else model
    config = getattr(unwrapped, "config", None)
    if config is None:
        return "the model has no config"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models encode the prompt in the encoder"
    if extra_inputs:
        return f"rows carry extra inputs ({', '.join(sorted(extra_inputs))}), e.g. images"
    base = _base_model(model)
    if type(base) in _unsupported:
        return _unsupported[type(base)]
    supports_dynamic_cache = getattr(type(base), "_supports_default_dynamic_cache", None)
    if supports_dynamic_cache is None or not supports_dynamic_cache():
        return f"{type(base).__name__} does not use a dynamic KV cache"
    if any(getattr(m, "gradient_checkpointing", False) for m in unwrapped.modules()) and torch.is_grad_enabled():
        return "gradient checkpointing drops the KV cache in a forward with grad"
    return None


def expands_rows(generation_config) -> bool:
    """Whether `generate` decodes more rows than it is given (beam search, `num_return_sequences`): a cache built for
    the given rows does not fit them."""
    return any((getattr(generation_config, name, 1) or 1) > 1 for name in ("num_beams", "num_return_sequences"))


def sharing_obstacle(
    model, extra_inputs: dict | None = None, *, router_logits=False, generation_config=None, continuous_batching=False
) -> str | None:
    """Why `model`'s rows may not share prompts, or None: the model or its inputs (`unsupported_reason`), the MoE
    load-balancing loss (`router_logits`), and for a generation, beam search / `num_return_sequences`
    (`generation_config`) or continuous batching."""
    reason = unsupported_reason(model, extra_inputs)
    if reason is None and router_logits:
        reason = "the MoE load-balancing loss is computed over every row's tokens"
    if reason is None and generation_config is not None and expands_rows(generation_config):
        reason = "beam search / num_return_sequences expand the rows inside generate"
    if reason is None and continuous_batching:
        reason = "continuous batching manages its own paged cache"
    return reason


def may_share_prefix(where: str, model, extra_inputs: dict | None = None, *, obstacle=None, **conditions) -> bool:
    """Whether `where` (e.g. "generation", "log-prob forward") may encode repeated prompts once: no `sharing_obstacle`
    (`conditions`: its keywords) and no caller's `obstacle`; else the reason is reported once (`report_fallback`)."""
    reason = sharing_obstacle(model, extra_inputs, **conditions) or obstacle
    if reason is not None:
        report_fallback(where, reason)
    return reason is None


def chunk_groups(chunk: dict, generation_config) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of one padded generation chunk that share a prompt (`group_prompts`), or None, not reported (the
    caller's `may_share_prefix` reports what can be known before a chunk)."""
    if set(chunk) != {"input_ids", "attention_mask"} or expands_rows(generation_config):
        return None
    if getattr(generation_config, "cache_implementation", None) is not None:
        return None
    return group_prompts(chunk["input_ids"], chunk["attention_mask"])


def generation_prefix_cache(model, chunk: dict, groups) -> Cache | None:
    """The KV cache of every prompt position of a chunk but the last, one prefill per group, at the positions
    `generate` derives from the mask: decoding continues from it exactly as from its own prefill. None, reported
    once, when the model's cache cannot be expanded by row."""
    ids, mask = chunk["input_ids"], chunk["attention_mask"]
    try:
        return encode_prefix(model, ids, mask, ids.size(1) - 1, groups, position_ids=generation_positions(mask))
    except PrefixSharingUnsupported as e:
        report_fallback("generation", str(e))
        return None
