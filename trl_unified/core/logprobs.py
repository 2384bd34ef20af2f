"""Per-token log-probs and entropies of completion tokens, computed only where needed."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..generation.fallbacks import report_fallback
from ..generation.sharing import PrefixSharingUnsupported, cache_kwarg, encode_prefix, group_prompts
from .token_ids import embedding_rows, mask_padding


# Rows per log-softmax chunk are chosen so one chunk's float32 logits stay under this many elements.
_CHUNK_ELEMENTS = 2**25


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token (as `generate` numbers them)."""
    return (attention_mask.long().cumsum(1) - attention_mask.long()).clamp(min=0)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """`log_softmax(logits)` gathered at `index`, without materialising the full-vocabulary log-softmax.

    Rows are processed `chunk_size` at a time in float32: `logit[index] - logsumexp(logits)`.
    Naive equivalent: `torch.log_softmax(logits.float(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)`.

    Args:
        logits (`torch.Tensor`): `(B, T, V)`.
        index (`torch.LongTensor`): `(B, T)`.
        chunk_size (`int`, *optional*): rows per chunk; chosen from the vocabulary size if not given.

    Returns:
        `torch.Tensor`: `(B, T)` float32 log-probabilities.
    """
    chunk_size = chunk_size or max(1, _CHUNK_ELEMENTS // max(1, logits.size(1) * logits.size(2)))
    out = []
    for rows, idx in zip(logits.split(chunk_size), index.split(chunk_size), strict=True):
        rows = rows.float()
        out.append(rows.gather(-1, idx.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(rows, dim=-1))
    return torch.cat(out)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy `H = logsumexp(z) - sum_v softmax(z)_v z_v` per position, chunked over rows in float32.

    Naive equivalent: `-(p * p.log()).sum(-1)` with `p = softmax(logits)`. `(B, T, V)` -> `(B, T)`.
    """
    chunk_size = chunk_size or max(1, _CHUNK_ELEMENTS // max(1, logits.size(1) * logits.size(2)))
    out = []
    for rows in logits.split(chunk_size):
        rows = rows.float()
        probs = torch.softmax(rows, dim=-1)
        out.append(torch.logsumexp(rows, dim=-1) - (probs * rows).sum(-1))
    return torch.cat(out)


@dataclass
class TokenLogprobs:
    """Per-token log-probs `(B, C)`, entropies `(B, C)` or None, the MoE auxiliary loss or None, and the `(B, C)`
    statistics a `logits_stats` function returned (no grad), by name."""

    logps: torch.Tensor
    entropy: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "TokenLogprobs":
        """The same fields with `fn` applied to every per-token tensor (e.g. a change of layout)."""
        return TokenLogprobs(
            logps=fn(self.logps),
            entropy=None if self.entropy is None else fn(self.entropy),
            aux_loss=self.aux_loss,
            stats={name: fn(value) for name, value in self.stats.items()},
        )


def compute_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    entropy_requires_grad: bool = False,
    batch_size: int | None = None,
    output_router_logits: bool = False,
    shared_prefix: bool = False,
    position_ids: torch.Tensor | None = None,
    logits_stats: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    **forward_kwargs,
) -> TokenLogprobs:
    """Log-probs of the last `logits_to_keep` tokens of `input_ids` under `model`, logits divided by `temperature`.

    Only the `logits_to_keep + 1` last positions are projected to the vocabulary (the model's `logits_to_keep`),
    and log-softmax is chunked (see `selective_log_softmax`). Rows are run through the model `batch_size` at a time
    when given (a memory cap for the no-grad reference pass).

    Args:
        model (`PreTrainedModel`): a causal LM (or PEFT/VLM wrapper) whose forward accepts `logits_to_keep`.
        input_ids (`torch.LongTensor`): `(B, P + C)` prompt then completion tokens.
        attention_mask (`torch.LongTensor`): `(B, P + C)`.
        logits_to_keep (`int`): `C`, the number of completion positions to score.
        temperature (`float`, *optional*, defaults to `1.0`): the sampling temperature.
        compute_entropy (`bool`, *optional*, defaults to `False`): also return per-token entropies.
        entropy_requires_grad (`bool`, *optional*, defaults to `False`): keep the entropies in the autograd graph
            (an entropy bonus in the loss); otherwise they are computed without grad, for logging and masks.
        batch_size (`int`, *optional*): rows per forward pass; all rows at once by default.
        output_router_logits (`bool`, *optional*, defaults to `False`): return the MoE load-balancing loss.
        logits_stats (`Callable`, *optional*): called without grad on each chunk's scaled logits `(b, C, V)` and its
            target ids `(b, C)`; returns `(b, C)` tensors by name, concatenated into `TokenLogprobs.stats` (per-token
            metrics that need the full logits, computed while they exist).
        shared_prefix (`bool`, *optional*, defaults to `False`): encode each distinct prompt (`input_ids[:, :-C]`) of a
            chunk once and reuse its KV cache for the rows that repeat it (see `generation/sharing.py`); same
            log-probs and, under grad, same gradients as the plain forward, less compute when prompts repeat. The
            caller decides whether the model supports it (`sharing.may_share_prefix`).
        position_ids (`torch.LongTensor`, *optional*): `(B, P + C)` positions, e.g. those of another layout of the
            same rows (`preference_data.shared_prompt_layout`); the model's default otherwise.
        **forward_kwargs (`Any`): other model inputs with a leading batch dimension (e.g. `token_type_ids`), or, for
            vision-language models, the full image tensors (then `batch_size` must cover the whole batch).

    Returns:
        `TokenLogprobs` with `logps` `(B, C)` float32.

    Example:
    ```python
    >>> out = compute_token_logprobs(model, ids, mask, logits_to_keep=completion_ids.size(1))
    >>> seq_logps = (out.logps * completion_mask).sum(1)  # (B,)
    ```
    """
    batch_size = batch_size or input_ids.size(0)
    input_ids = mask_padding(input_ids, attention_mask, embedding_rows(model))  # a pad beyond the table: read as 0
    logps, entropies, aux_losses = [], [], []
    stats: dict[str, list[torch.Tensor]] = {}
    for start in range(0, input_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        kwargs = {
            k: v[rows]
            if isinstance(v, torch.Tensor) and v.size(0) == input_ids.size(0) and batch_size < input_ids.size(0)
            else v
            for k, v in forward_kwargs.items()
        }
        if output_router_logits:
            kwargs["output_router_logits"] = True
        prompt_length = input_ids.size(1) - logits_to_keep
        groups = None
        if shared_prefix:
            groups = group_prompts(input_ids[rows, :prompt_length], attention_mask[rows, :prompt_length])
        outputs = None
        positions = None if position_ids is None else position_ids[rows]
        if groups is not None:  # the prompt but its last token once per group; the rest per row, on the cache
            try:
                cache = encode_prefix(
                    model, input_ids[rows], attention_mask[rows], prompt_length - 1, groups, positions
                )
                if positions is not None:
                    kwargs["position_ids"] = positions[:, prompt_length - 1 :]
                outputs = model(
                    input_ids=input_ids[rows, prompt_length - 1 :],
                    attention_mask=attention_mask[rows],
                    use_cache=True,
                    logits_to_keep=logits_to_keep + 1,
                    **kwargs,
                    **{cache_kwarg(model): cache},
                )
            except PrefixSharingUnsupported as e:
                report_fallback("log-prob forward", str(e))
        if outputs is None:
            if positions is not None:
                kwargs["position_ids"] = positions
            outputs = model(
                input_ids=input_ids[rows],
                attention_mask=attention_mask[rows],
                logits_to_keep=logits_to_keep + 1,
                **kwargs,
            )
        logits = outputs.logits[:, -(logits_to_keep + 1) : -1, :]  # (b, C, V): position t predicts token t + 1
        if temperature != 1.0:
            logits = logits / temperature
        logps.append(selective_log_softmax(logits, input_ids[rows, -logits_to_keep:]))
        if compute_entropy:
            with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
                entropies.append(entropy_from_logits(logits))
        if logits_stats is not None:
            with torch.no_grad():
                for name, value in logits_stats(logits, input_ids[rows, -logits_to_keep:]).items():
                    stats.setdefault(name, []).append(value)
        if output_router_logits and getattr(outputs, "aux_loss", None) is not None:
            aux_losses.append(outputs.aux_loss)
    return TokenLogprobs(
        logps=torch.cat(logps),
        entropy=torch.cat(entropies) if compute_entropy else None,
        aux_loss=torch.stack(aux_losses).mean() if aux_losses else None,
        stats={name: torch.cat(values) for name, values in stats.items()},
    )
