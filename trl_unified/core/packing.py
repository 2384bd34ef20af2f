"""Padding-free forwards (docs/padding_free.md): the `B` rows of a batch as one row of `N = Σ_i L_i` real tokens,
positions restarting at each row's first token, as TRL's `padding_free` for SFT; `segmented_sdpa` attends each
sequence on its own (`Σ_i L_i²`, not a dense `N²` mask). Each model is checked once; a fallback is logged once."""

import functools
import inspect
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..generation.fallbacks import report_fallback
from .lm_head import _bare


# Models checked to attend within packed sequences only: model -> True (they do) / False.
_VERIFIED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


@dataclass
class PackedRows:
    """`B` padded rows as one packed row, and where each scored position goes back.

    Fields:
        input_ids, position_ids (`(1, N)`): the real tokens of every row, row after row, and their positions
            (0 at each row's first real token).
        source (`(M,)`): for each scored token, the packed position that predicts it (the token before it).
        targets (`(M,)`): the scored tokens.
        rows, columns (`(M,)`): where each scored token's value goes in the `(B, C)` output.
        shape (`(B, C)`): the output shape (`C = logits_to_keep`).
        boundaries (`(B + 1,)`, int32): where each row's sequence starts in the pack, and `N` (FlashAttention's
            `cu_seq_lens`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    source: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    shape: tuple[int, int]
    boundaries: torch.Tensor

    @classmethod
    def build(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> "PackedRows | None":
        """The packed form of `input_ids` `(B, T)` scoring its last `logits_to_keep` positions, or None when a row's
        real tokens are not one contiguous span (its packed sequence would not be the padded row's)."""
        keep = attention_mask.bool()
        batch, width = keep.shape
        lengths = keep.sum(1)
        first = keep.long().argmax(1)
        last = width - 1 - keep.flip(1).long().argmax(1)
        if bool((lengths == 0).any()) or bool((last - first + 1 != lengths).any()):
            return None
        positions = keep.long().cumsum(1) - 1  # (B, T): 0 at each row's first real token
        packed_index = keep.flatten().long().cumsum(0).view(batch, width) - 1  # (B, T) -> position in the pack
        columns = torch.arange(width - logits_to_keep, width, device=keep.device)  # (C,) scored columns
        scored = keep[:, columns] & keep[:, (columns - 1).clamp(min=0)] & (columns >= 1)  # token and its predictor
        rows, j = scored.nonzero(as_tuple=True)
        t = columns[j]
        return cls(
            input_ids=input_ids[keep][None],
            position_ids=positions[keep][None],
            source=packed_index[rows, t - 1],
            targets=input_ids[rows, t],
            rows=rows,
            columns=j,
            shape=(batch, logits_to_keep),
            boundaries=torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32),
        )

    def forward_kwargs(self, model) -> dict:
        """The packed forward's inputs: the tokens, their positions, and (for a model whose forward passes keyword
        arguments on to its attention) the sequence boundaries; no cache, so that transformers reads the restarting
        positions as boundaries."""
        inputs = dict(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False)
        if _takes_var_keywords(type(_bare(model))):  # transformers models pass **kwargs on to their attention
            install_segmented_sdpa()
            longest = int((self.boundaries[1:] - self.boundaries[:-1]).max())
            inputs.update(
                cu_seq_lens_q=self.boundaries,
                cu_seq_lens_k=self.boundaries,
                max_length_q=longest,
                max_length_k=longest,
            )
        return inputs

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """`(1, M)` per-scored-token values -> the `(B, C)` layout (zero / False where nothing is scored)."""
        return values.new_zeros(self.shape).index_put((self.rows, self.columns), values.reshape(-1))


@functools.cache
def _takes_var_keywords(model_class: type) -> bool:
    parameters = inspect.signature(model_class.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


_SDPA: dict = {}  # "forward": transformers' own sdpa attention, once `segmented_sdpa` is registered over it


def install_segmented_sdpa() -> None:
    """Register `segmented_sdpa` as transformers' "sdpa" attention (once per process; idempotent)."""
    if _SDPA:
        return
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _SDPA["forward"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", segmented_sdpa)


def segmented_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' sdpa attention, run on each packed sequence on its own when the call carries the boundaries
    (`cu_seq_lens_q` equal to `cu_seq_lens_k`, one packed row, queries and keys over the whole pack): causal within
    `[b_i, b_{i+1})`, `Σ_i L_i²` work, transformers' block-diagonal mask (the same function) unused. Any other call
    is passed through unchanged (docs/padding_free.md lists them)."""
    forward = _SDPA["forward"]
    bounds_q, bounds_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    segmented = (
        isinstance(bounds_q, torch.Tensor)
        and (bounds_k is bounds_q or (isinstance(bounds_k, torch.Tensor) and torch.equal(bounds_k, bounds_q)))
        and query.size(0) == 1
        and query.size(2) == key.size(2) == int(bounds_q[-1])
        and kwargs.get("position_bias") is None
        and getattr(module, "is_causal", True)
        and getattr(getattr(module, "config", None), "attention_chunk_size", None) is None
    )
    if segmented:
        bounds = bounds_q.tolist()
        window = kwargs.get("sliding_window")  # a window no sequence outgrows restricts nothing
        segmented = window is None or max(b - a for a, b in zip(bounds[:-1], bounds[1:])) <= window
    if not segmented:
        return forward(module, query, key, value, attention_mask, *args, **kwargs)
    outputs = [
        forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, *args, **kwargs)[0]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outputs, dim=1), None


def packing_obstacle(model, forward_kwargs: dict) -> str | None:
    """Why `model`'s rows (with these extra inputs) cannot be packed, or None."""
    config = getattr(model.module if hasattr(model, "module") else model, "config", None)
    if config is None:
        return "the model has no config"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models encode the prompt in the encoder"
    extra = sorted(k for k in forward_kwargs if k not in ("output_router_logits", "use_cache"))
    if extra:
        return f"rows carry extra inputs ({', '.join(extra)}) that are not packed"
    if _VERIFIED.get(_bare(model)) is False:
        return f"{type(_bare(model)).__name__} does not attend within packed sequences only"
    return None


def check_packing(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """Whether `model` keeps packed sequences apart (docs/padding_free.md, "Guards and fallbacks"), checked once per
    model: the second row's logits packed after the first, through the model's own attention and mask (no boundaries
    passed), against its logits alone. Batches of one row need no check and leave the model unchecked."""
    bare = _bare(model)
    if bare in _VERIFIED or input_ids.size(0) < 2:
        return _VERIFIED.get(bare, True)
    packed = PackedRows.build(input_ids[:2], attention_mask[:2], input_ids.size(1) - 1)
    if packed is None:
        return True
    second = packed.rows == 1
    alone = PackedRows.build(input_ids[1:2], attention_mask[1:2], input_ids.size(1) - 1)
    module = model.module if hasattr(model, "module") else model  # a no-grad probe, outside DDP's bookkeeping
    with torch.no_grad():
        together = module(**packed.forward_kwargs(model), logits_to_keep=packed.source[second]).logits
        apart = module(
            input_ids=alone.input_ids, position_ids=alone.position_ids, use_cache=False, logits_to_keep=alone.source
        ).logits
    tolerance = 1e-3 if together.dtype == torch.float32 else 5e-2
    _VERIFIED[bare] = together.shape == apart.shape and torch.allclose(
        together.float(), apart.float(), atol=tolerance, rtol=tolerance
    )
    if not _VERIFIED[bare]:
        report_fallback("log-prob forward", packing_obstacle(model, {}), "padding_free")
    return _VERIFIED[bare]
