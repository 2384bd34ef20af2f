"""Padding-free forwards: the rows of a batch flattened into one sequence without padding, as TRL's `padding_free`
does for SFT.

Rows of a batch end at different lengths (completions stop at their EOS, prompts differ), and a padded forward pays
every layer's matmuls for the padding. Packed, the `B` rows become one row of `N = Σ_i L_i` real tokens whose position
ids restart at 0 at each row's first token; transformers reads the restarts as sequence boundaries and attends
within each sequence only: FlashAttention 2/3 through its variable-length kernel (no padding and no mask at all),
sdpa / eager / flex through a block-diagonal causal mask built from the position ids (`masking_utils`). The log-probs
are those of the padded forward with positions counted from each row's first real token, which is what generation
uses, and for rotary models (Llama, Qwen, Mistral, Gemma, ...) the same function as any constant shift of positions.

Where it pays: with FlashAttention the attention cost is Σ_i L_i² and the matmuls cover N tokens instead of
`B · max_i L_i`. On sdpa / eager the block-diagonal mask is dense, `N²` entries instead of `B · L²`: the matmuls still
shrink, the attention grows, so on CPU it pays only for short rows of very different lengths (`docs/lm_head.md`).

Guards: each model is checked once on its first packed forward of two or more rows (the second row's logits packed
must equal its logits alone, so a model whose attention ignores packed position ids, or that carries a recurrent
state across the boundary, is caught); rows whose real tokens are not contiguous, extra per-row inputs (images,
`token_type_ids`) and encoder-decoder models take the padded path, with one log line (`report_fallback`).
"""

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
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    source: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    shape: tuple[int, int]

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
        )

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """`(1, M)` per-scored-token values -> the `(B, C)` layout (zero / False where nothing is scored)."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.columns), values.reshape(-1))


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
    """Whether `model` keeps packed sequences apart, checked once per model on two rows of the batch: the second
    row's logits packed after the first must equal its logits alone (a mismatch is reported and turns packing off
    for that model). Batches of one row need no check (nothing to keep apart) and leave the model unchecked."""
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
        together = module(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                          logits_to_keep=packed.source[second]).logits  # fmt: skip
        apart = module(input_ids=alone.input_ids, position_ids=alone.position_ids, use_cache=False,
                       logits_to_keep=alone.source).logits  # fmt: skip
    tolerance = 1e-3 if together.dtype == torch.float32 else 5e-2
    _VERIFIED[bare] = together.shape == apart.shape and torch.allclose(
        together.float(), apart.float(), atol=tolerance, rtol=tolerance
    )
    if not _VERIFIED[bare]:
        report_fallback("log-prob forward", packing_obstacle(model, {}), "padding_free")
    return _VERIFIED[bare]
