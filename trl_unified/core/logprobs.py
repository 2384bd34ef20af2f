"""Per-token log-probs and entropies of completion tokens, computed only where needed: only completion positions,
from the final hidden states in chunks of positions (`core/lm_head.py`), each distinct prompt encoded once where rows
repeat it (`generation/sharing.py`)."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import Cache

from ..generation.fallbacks import report_fallback
from ..generation.sharing import PrefixSharingUnsupported, cache_kwarg, encode_prefix, group_prompts, split_rows
from ..models.token_ids import embedding_rows, mask_padding
from .lm_head import HiddenStateHead, token_scores
from .packing import PackedRows, check_packing, packing_obstacle


# `padding_free=None` packs a call's rows when at least this share of their slots is padding. Measured on 2 CPU cores
# (`benchmarks/padded_completions.py --vocab 8k`, 16 rows): no padding, packed 1.19x the padded time; 7.6% padding,
# 0.92x; 30%, 0.74x.
PACKING_MIN_PADDING = 0.1


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
    chunks = zip((rows.float() for rows in logits.split(chunk_size)), index.split(chunk_size), strict=True)
    return torch.cat([z.gather(-1, i.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1) for z, i in chunks])


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy `H = logsumexp(z) - sum_v softmax(z)_v z_v` per position, chunked over rows in float32.

    Naive equivalent: `-(p * p.log()).sum(-1)` with `p = softmax(logits)`. `(B, T, V)` -> `(B, T)`.
    """
    chunk_size = chunk_size or max(1, _CHUNK_ELEMENTS // max(1, logits.size(1) * logits.size(2)))
    chunks = (rows.float() for rows in logits.split(chunk_size))
    return torch.cat([torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1) for z in chunks])


@dataclass
class TokenLogprobs:
    """Per-token log-probs `(B, C)`, entropies `(B, C)` or None, the MoE auxiliary loss or None, the `(B, C)`
    statistics a `logits_stats` function returned (no grad), by name, and with `score_prompt` the log-probs
    `(B, P - 1)` of the prompt tokens after the first (`prompt_logps`)."""

    logps: torch.Tensor
    entropy: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt_logps: torch.Tensor | None = None

    @classmethod
    def concat(cls, chunks: list["TokenLogprobs"]) -> "TokenLogprobs":
        """The rows of several chunks of rows in one (the MoE auxiliary loss: their mean)."""
        aux_losses = [chunk.aux_loss for chunk in chunks if chunk.aux_loss is not None]
        entropies = [chunk.entropy for chunk in chunks]
        prompt_logps = [chunk.prompt_logps for chunk in chunks]
        return cls(
            logps=torch.cat([chunk.logps for chunk in chunks]),
            entropy=None if any(e is None for e in entropies) else torch.cat(entropies),
            aux_loss=torch.stack(aux_losses).mean() if aux_losses else None,
            stats={name: torch.cat([chunk.stats[name] for chunk in chunks]) for name in chunks[0].stats},
            prompt_logps=None if any(p is None for p in prompt_logps) else torch.cat(prompt_logps),
        )

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "TokenLogprobs":
        """The same fields with `fn` applied to every per-completion-token tensor (e.g. a change of layout);
        `prompt_logps` is left as it is."""
        return TokenLogprobs(
            logps=fn(self.logps),
            entropy=None if self.entropy is None else fn(self.entropy),
            aux_loss=self.aux_loss,
            stats={name: fn(value) for name, value in self.stats.items()},
            prompt_logps=self.prompt_logps,
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
    from_hidden_states: bool = True,
    padding_free: bool | None = False,
    score_padding: bool = False,
    score_prompt: bool = False,
    **forward_kwargs,
) -> TokenLogprobs:
    """Log-probs of the last `logits_to_keep` tokens of `input_ids` under `model`, logits divided by `temperature`.

    By default (`from_hidden_states`) from the final hidden states through the LM head in chunks of positions,
    recomputed in the backward (`core/lm_head.py`, no `(B, C, V)` tensor); else from the model's last logits.

    Args:
        model (`PreTrainedModel`): a causal LM (or PEFT/VLM wrapper) whose forward accepts `logits_to_keep`.
        input_ids, attention_mask (`torch.LongTensor`): `(B, P + C)` prompt then completion tokens, and their mask.
        logits_to_keep (`int`): `C`, the number of completion positions to score.
        temperature (`float`, defaults to `1.0`): the sampling temperature.
        compute_entropy (`bool`, defaults to `False`): also entropies; under grad iff `entropy_requires_grad`.
        batch_size (`int`, *optional*): rows per forward pass (a memory cap for no-grad passes); all at once if None.
        output_router_logits (`bool`, defaults to `False`): the MoE load-balancing loss too (`aux_loss`).
        shared_prefix (`bool`, defaults to `False`): encode each distinct prompt of a chunk once for the rows that
            repeat it (`generation/sharing.py`); the caller decides whether the model may (`may_share_prefix`).
        position_ids (`torch.LongTensor`, *optional*): `(B, P + C)` positions; the model's default otherwise.
        logits_stats (`Callable`, *optional*): `(logits (b, n, V), targets (b, n)) -> {name: (b, n)}`, no grad.
        from_hidden_states (`bool`, defaults to `True`): the chunked head path above; False: the model's logits.
        padding_free (`bool`, *optional*, defaults to `False`): pack each batch of rows into one row where allowed
            (`core/packing.py`, docs/padding_free.md); exclusive with `shared_prefix` and `position_ids`. None: auto.
        score_padding (`bool`, defaults to `False`): score padding too (TRL's PPO entropy); else it reads 0.
        score_prompt (`bool`, defaults to `False`): also `TokenLogprobs.prompt_logps` `(B, P - 1)`, the prompt's
            tokens after the first (0 where predicted from padding), from the shared prompt pass where prompts are
            shared (ORPO's NLL); rows are then not packed.
        **forward_kwargs: other model inputs with a leading batch dimension (e.g. `token_type_ids`), or, for
            vision-language models, the full image tensors (then `batch_size` must cover the whole batch).

    Returns `TokenLogprobs`, `logps` `(B, C)` float32: e.g. `(out.logps * completion_mask).sum(1)` per sequence.
    """
    batch_size = batch_size or input_ids.size(0)
    auto = padding_free is None
    padding_free = not score_prompt and padding_free is not False  # a packed row scores completions only
    padding_free = padding_free and _packs(model, attention_mask, shared_prefix, position_ids, forward_kwargs, auto)
    forward_kwargs = dict(forward_kwargs, output_router_logits=True) if output_router_logits else forward_kwargs
    input_ids = mask_padding(input_ids, attention_mask, embedding_rows(model))  # a pad beyond the table: read as 0
    head = HiddenStateHead.of(model) if from_hidden_states else None
    scoring = dict(
        temperature=temperature,
        compute_entropy=compute_entropy,
        entropy_requires_grad=entropy_requires_grad,
        logits_stats=logits_stats,
    )
    chunks = []
    for start in range(0, input_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        kwargs = _row_inputs(forward_kwargs, rows, input_ids.size(0))
        positions = None if position_ids is None else position_ids[rows]
        inputs = (input_ids[rows], attention_mask[rows], logits_to_keep, shared_prefix, positions, kwargs)
        packed = _packed(model, inputs) if padding_free else None
        prompt_scores = None
        if packed is not None:
            scores, outputs, head = _score_packed(model, head, packed, kwargs, scoring)
        else:
            scores, outputs, head, prompt_scores = _score_rows(
                model, head, inputs, scoring, score_padding, score_prompt
            )
        logps, entropy, stats = scores
        aux_loss = getattr(outputs, "aux_loss", None) if output_router_logits else None
        chunks.append(TokenLogprobs(logps, entropy, aux_loss, stats, prompt_scores))
    return TokenLogprobs.concat(chunks)


def _row_inputs(kwargs: dict, rows: slice, num_rows: int) -> dict:
    """The model inputs of one batch of rows: per-row tensors sliced (image tensors of the whole batch stay whole)."""
    return {k: v[rows] if isinstance(v, torch.Tensor) and v.shape[:1] == (num_rows,) else v for k, v in kwargs.items()}


def _score_rows(model, head: HiddenStateHead | None, inputs, scoring: dict, score_padding=False, score_prompt=False):
    """`((log-probs, entropies, stats), outputs, head, prompt log-probs or None)` for one batch of rows: from the
    hidden states through `head` when given and it reproduces the model's logits, else from the model's logits (then
    `head` comes back None, for the next rows). Through `head`, only the positions whose token is real (mask 1) are
    projected to the vocabulary unless `score_padding`; the others read 0, as in the packed path. `score_prompt`: the
    prompt tokens' log-probs too (`_prompt_scores`)."""
    input_ids, attention_mask, logits_to_keep, shared_prefix, positions, kwargs = inputs
    targets = input_ids[:, -logits_to_keep:]
    if head is not None:
        prefix = {}  # the prompt pass's hidden states and groups, when the prompt is shared and scored
        on_prefix = (lambda groups: prefix.update(hidden=head.hidden, groups=groups)) if score_prompt else None
        with head.capture():
            outputs = _forward(
                model, input_ids, attention_mask, logits_to_keep, 1, shared_prefix, positions, kwargs, on_prefix
            )
        if head.matches(outputs.logits):
            hidden = head.hidden[:, -(logits_to_keep + 1) : -1]  # position t predicts token t + 1
            real, place = None if score_padding else attention_mask[:, -logits_to_keep:].bool(), None
            if real is not None and 0 < int(real.sum()) < real.numel():  # only real tokens to the vocabulary
                hidden, targets = hidden[real][None], targets[real][None]
                place = lambda values: values.new_zeros(real.shape).masked_scatter(real, values)
            vocabulary = outputs.logits.size(-1)
            scores = token_scores(hidden, targets, head.logits, vocabulary=vocabulary, linear=head.linear(), **scoring)
            prompt = None
            if score_prompt:
                prompt = _prompt_scores(head, input_ids, attention_mask, logits_to_keep, prefix, scoring)
            return (scores if place is None else _place(scores, place)), outputs, head, prompt
    width = input_ids.size(1) if score_prompt else logits_to_keep + 1  # the prompt's logits too: an unshared pass
    outputs = _forward(
        model, input_ids, attention_mask, logits_to_keep, width, shared_prefix and not score_prompt, positions, kwargs
    )
    logits = outputs.logits
    prompt = None
    if score_prompt:
        prompt_length = input_ids.size(1) - logits_to_keep
        real = attention_mask[:, 1:prompt_length] * attention_mask[:, : prompt_length - 1]
        scaled = logits[:, : prompt_length - 1] / scoring["temperature"]
        prompt = selective_log_softmax(scaled, input_ids[:, 1:prompt_length]) * real
    scores = _scores_from_logits(logits[:, -(logits_to_keep + 1) : -1, :], targets, **scoring)
    return scores, outputs, None, prompt


def _prompt_scores(head: HiddenStateHead, input_ids, attention_mask, logits_to_keep: int, prefix: dict, scoring):
    """`(B, P - 1)` log-probs of the prompt tokens after the first, P = T - `logits_to_keep`, from the hidden states
    of the pass that read the prompt: the shared prompt pass (`prefix`: one row per distinct prompt, indexed out to
    the rows) or the rows' own. 0 where the token or the position predicting it is padding."""
    prompt_length = input_ids.size(1) - logits_to_keep
    targets = input_ids[:, 1:prompt_length]
    real = (attention_mask[:, 1:prompt_length] * attention_mask[:, : prompt_length - 1]).bool()
    if prefix:
        first, inverse = prefix["groups"]
        hidden, targets, real = prefix["hidden"][:, : prompt_length - 1], targets[first], real[first]
    else:
        inverse, hidden = None, head.hidden[:, : prompt_length - 1]
    scoring = dict(scoring, compute_entropy=False, logits_stats=None)  # log-probs only
    values = torch.zeros(real.shape, device=input_ids.device)
    if bool(real.any()):
        logps, _, _ = token_scores(
            hidden[real][None],
            targets[real][None],
            head.logits,
            linear=head.linear(),
            vocabulary=head.head.weight.size(0),
            **scoring,
        )
        values = values.masked_scatter(real, logps[0])
    return values if inverse is None else values[inverse]


def shift_right(labels: torch.Tensor, decoder_start_token_id: int | None) -> torch.Tensor:
    """The decoder's inputs for teacher forcing on `labels` `(B, C)`: `decoder_start_token_id`, then the labels but
    the last (as an encoder-decoder model's own loss does)."""
    if decoder_start_token_id is None:
        raise ValueError(
            "model.config.decoder_start_token_id has to be defined. It is usually set to the pad_token_id."
        )
    start = labels.new_full((labels.size(0), 1), decoder_start_token_id)
    return torch.cat([start, labels[:, :-1]], dim=1)


def compute_decoder_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    decoder_start_token_id: int | None,
    compute_entropy: bool = False,
    output_router_logits: bool = False,
    logits_stats: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None,
) -> TokenLogprobs:
    """Per-token log-probs `(B, C)` of an encoder-decoder model's targets: the encoder reads `input_ids` /
    `attention_mask` `(B, P)`, the decoder the targets `labels` `(B, C)` shifted right (`shift_right`). Padding
    targets are scored too: mask them. Options as `compute_token_logprobs` (temperature 1)."""
    kwargs = {"output_router_logits": True} if output_router_logits else {}
    outputs = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        decoder_input_ids=shift_right(labels, decoder_start_token_id),
        use_cache=False,
        **kwargs,
    )
    logps, entropy, stats = _scores_from_logits(outputs.logits, labels, 1.0, compute_entropy, False, logits_stats)
    aux_loss = getattr(outputs, "aux_loss", None) if output_router_logits else None
    return TokenLogprobs(logps=logps, entropy=entropy, aux_loss=aux_loss, stats=stats)


def compute_shared_logprobs(
    model, input_ids, attention_mask, logits_to_keep, detached_rows: int, position_ids=None, **options
) -> tuple[TokenLogprobs, torch.Tensor] | None:
    """`compute_token_logprobs(..., shared_prefix=True)` on the rows `[:B - k]`, and the log-probs `(k, C)` of the
    `k = detached_rows` last rows without grad, each distinct prompt encoded once for both (KTO's completion and KL
    rows, docs/shared_prefix.md). None (a cache that cannot be split is reported once) where the prompts cannot be
    shared this way: the caller then runs the two passes.

    `options` (`temperature`, `from_hidden_states`, `compute_entropy`, `entropy_requires_grad`, `logits_stats`)
    score the rows with grad; the detached rows get log-probs only, at the same temperature and head path.
    """
    prompt_length, split = input_ids.size(1) - logits_to_keep, input_ids.size(0) - detached_rows
    groups = group_prompts(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
    head = HiddenStateHead.of(model) if options.pop("from_hidden_states", True) else None
    # A first use of the head checks it against the logits and, failing, re-runs the forward: not on a used cache.
    if groups is None or not 0 < detached_rows < input_ids.size(0) or (head is not None and not head.checked()):
        return None
    input_ids = mask_padding(input_ids, attention_mask, embedding_rows(model))
    try:
        cache = encode_prefix(model, input_ids, attention_mask, prompt_length - 1, groups, position_ids, expand=False)
        caches = split_rows(model, cache, [groups[1][:split], groups[1][split:]])
    except PrefixSharingUnsupported as e:
        report_fallback("log-prob forward", str(e))
        return None
    inputs = [
        (input_ids[r], attention_mask[r], logits_to_keep, c, None if position_ids is None else position_ids[r], {})
        for r, c in zip((slice(0, split), slice(split, None)), caches, strict=True)
    ]
    scoring = dict(temperature=1.0, compute_entropy=False, entropy_requires_grad=False, logits_stats=None)
    temperature = options.get("temperature", 1.0)
    with torch.no_grad():
        (detached, _, _), _, head, _ = _score_rows(model, head, inputs[1], {**scoring, "temperature": temperature})
    (logps, entropy, stats), _, _, _ = _score_rows(model, head, inputs[0], {**scoring, **options})
    return TokenLogprobs(logps=logps, entropy=entropy, stats=stats), detached


def _packs(model, attention_mask: torch.Tensor, shared_prefix: bool, position_ids, forward_kwargs, auto: bool) -> bool:
    """Whether this call packs its rows: `padding_free=True` where allowed (raises with shared_prefix or position_ids,
    reports a model or inputs that cannot be packed), or auto with no other layout asked for, 2+ rows and at least
    `PACKING_MIN_PADDING` of the slots padding (a packed row attends each sequence on its own: dearer than one
    batched attention over rows without padding)."""
    if auto and (shared_prefix or position_ids is not None or attention_mask.size(0) < 2):
        return False
    if auto and int(attention_mask.sum()) > (1 - PACKING_MIN_PADDING) * attention_mask.numel():
        return False
    if shared_prefix:
        raise ValueError("padding_free and shared_prefix are two layouts of the same forward: choose one.")
    if position_ids is not None:
        raise ValueError("padding_free counts positions from each row's first real token; do not pass position_ids.")
    reason = packing_obstacle(model, forward_kwargs)
    if reason is not None:
        report_fallback("log-prob forward", reason, "padding_free")
    return reason is None


def _packed(model, inputs) -> PackedRows | None:
    """The packed form of one batch of rows, or None (reported) where its rows or the model cannot be packed."""
    packed = PackedRows.build(*inputs[:3])
    if packed is None:
        report_fallback("log-prob forward", "a row's real tokens are not one contiguous span", "padding_free")
    elif packed.source.numel() == 0 or not check_packing(model, *inputs[:2]):
        return None
    return packed


def _score_packed(model, head: HiddenStateHead | None, packed: PackedRows, kwargs: dict, scoring: dict):
    """`_score_rows` on the packed row: only the scored positions are projected to the vocabulary (through `head`
    in chunks, or the model's `logits_to_keep` given as their indices) and scattered back to `(B, C)`."""
    inputs = dict(kwargs, **packed.forward_kwargs(model))
    targets = packed.targets[None]
    if head is not None:
        with head.capture():
            outputs = model(**inputs, logits_to_keep=1)
        if head.matches(outputs.logits):
            hidden, vocabulary = head.hidden[:, packed.source], outputs.logits.size(-1)  # (1, M, H), V
            scores = token_scores(hidden, targets, head.logits, vocabulary=vocabulary, linear=head.linear(), **scoring)
            return _place(scores, packed.scatter), outputs, head
    outputs = model(**inputs, logits_to_keep=packed.source)
    return _place(_scores_from_logits(outputs.logits, targets, **scoring), packed.scatter), outputs, None


def _place(scores, place):
    """`(log-probs, entropies or None, stats)` of the scored positions `(1, M)`, each laid out by `place` as `(b, C)`
    (`PackedRows.scatter`, or the real positions of padded rows), 0 on the unscored ones."""
    logps, entropy, stats = scores
    return place(logps), None if entropy is None else place(entropy), {name: place(v) for name, v in stats.items()}


def _forward(model, input_ids, attention_mask, logits_to_keep, keep, shared_prefix, positions, kwargs, on_prefix=None):
    """The model's outputs on one batch of rows, projecting the last `keep` positions to the vocabulary: with
    `shared_prefix`, each distinct prompt but its last token encoded once and the rest run per row on its cache
    (a model that cannot is reported once and run plainly); `shared_prefix` may also be that cache, built by the
    caller (`compute_shared_logprobs`). `on_prefix(groups)` is called right after the prompt pass, if one ran."""
    kwargs = dict(kwargs)
    prompt_length = input_ids.size(1) - logits_to_keep
    prebuilt = shared_prefix if isinstance(shared_prefix, Cache) else None
    groups = None
    if shared_prefix and prebuilt is None:
        groups = group_prompts(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
    if groups is not None or prebuilt is not None:
        try:
            cache = prebuilt or encode_prefix(model, input_ids, attention_mask, prompt_length - 1, groups, positions)
            if on_prefix is not None and prebuilt is None:
                on_prefix(groups)
            if positions is not None:
                kwargs["position_ids"] = positions[:, prompt_length - 1 :]
            return model(
                input_ids=input_ids[:, prompt_length - 1 :],
                attention_mask=attention_mask,
                use_cache=True,
                logits_to_keep=keep,
                **kwargs,
                **{cache_kwarg(model): cache},
            )
        except PrefixSharingUnsupported as e:
            report_fallback("log-prob forward", str(e))
    if positions is not None:
        kwargs["position_ids"] = positions
    return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, **kwargs)


def _scores_from_logits(logits, targets, temperature, compute_entropy, entropy_requires_grad, logits_stats):
    """`(log-probs, entropies or None, stats)` `(b, C)` from the model's logits `(b, C, V)`."""
    if temperature != 1.0:
        logits = logits / temperature
    logps = selective_log_softmax(logits, targets)
    with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits) if compute_entropy else None
    with torch.no_grad():
        stats = logits_stats(logits, targets) if logits_stats is not None else {}
    return logps, entropy, stats
