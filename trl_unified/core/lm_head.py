"""The language-model head applied outside the model's forward, to chunks of positions recomputed in the backward: no
`(B, T, V)` tensor, and only where it reproduces the model's logits (a fallback logged once; docs/lm_head.md)."""

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..generation.fallbacks import report_fallback
from ..models.loading import base_model


logger = logging.getLogger(__name__)

# A chunk's float32 logits stay under this many elements (256 MB: 442 positions at 152k tokens; docs/lm_head.md).
_CHUNK_ELEMENTS = 2**26
# `LinearTokenScores` cuts its chunks into work chunks of at most this many logits (64 MB): it sets the peak.
_WORK_ELEMENTS = 2**24

# Models whose hidden-state path was checked against their own logits: model -> True (matches) / False.
_VERIFIED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def apply_logit_transform(logits: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """What a model does to its head's output before returning it: a scale, then a tanh soft cap."""
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def logit_transform(model) -> tuple[float, float | None]:
    """`(scale, softcap)` a model applies to its LM head's output, so that hidden states times the head give the
    model's own logits: Cohere's `logit_scale`, Falcon-H1's `lm_head_multiplier`, `output_multiplier`, Granite's
    division by `logits_scaling`, and Gemma 2's `final_logit_softcapping`."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scales = [getattr(config, name, None) for name in ("logit_scale", "lm_head_multiplier", "output_multiplier")]
    scale = next((float(s) for s in scales if s is not None), None)
    if scale is None:
        scale = 1.0 / float(config.logits_scaling) if getattr(config, "logits_scaling", None) is not None else 1.0
    return scale, getattr(config, "final_logit_softcapping", None)


def _bare(model) -> nn.Module:
    """`model` without DDP / DeepSpeed / PEFT wrappers (the `PreTrainedModel` whose forward ends in the head)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return base_model(model)


def _sharded(weight) -> bool:
    """Whether `weight` is only whole inside the forward (ZeRO-3 partition, FSDP flat or DTensor shard)."""
    return (
        hasattr(weight, "ds_id")
        or type(weight).__name__ == "DTensor"
        or not isinstance(weight, torch.Tensor)
        or weight.numel() == 0
    )


@dataclass
class HiddenStateHead:
    """The head of one model, applied outside its forward: `capture()` records the decoder's final hidden states
    during a forward, `token_scores(..., head.logits)` turns them into per-token values chunk by chunk."""

    model: nn.Module
    decoder: nn.Module
    head: nn.Module
    transform: tuple[float, float | None]
    hidden: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(cls, model) -> "HiddenStateHead | None":
        """The head path of `model`, or None (the reason logged once) where the model's own logits must be used."""
        bare, reason = _bare(model), None
        if _VERIFIED.get(bare) is False:
            return None
        if "OptimizedModule" in type(model).__name__ or hasattr(bare, "_orig_mod"):
            reason = "the model is compiled (torch.compile)"
        else:
            decoder = head = None
            with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
                decoder, head = bare.get_decoder(), bare.get_output_embeddings()
            if head is None or decoder is None or decoder is bare:
                reason = f"{type(bare).__name__} has no separate decoder and output embeddings"
            elif _sharded(getattr(head, "weight", None)):
                reason = "the LM head is sharded outside the forward (ZeRO-3 / FSDP)"
        if reason is not None:
            report_fallback("log-probs", reason, "chunked_lm_head")
            return None
        return cls(model, decoder, head, logit_transform(bare))

    @contextlib.contextmanager
    def capture(self):
        """Record the decoder's output hidden states `(B, T, H)` of every forward inside (the last one is kept)."""

        def hook(module, args, output):
            self.hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        handle = self.decoder.register_forward_hook(hook)
        try:
            yield self
        finally:
            handle.remove()

    def keep_one(self) -> dict:
        """`{"logits_to_keep": 1}` where the model's forward takes it (one position projected), else `{}`."""
        parameters = inspect.signature(_bare(self.model).forward).parameters
        return {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return apply_logit_transform(self.head(hidden), *self.transform)

    def linear(self) -> tuple[torch.Tensor, float] | None:
        """`(weight, scale)` where the head is a plain bias-free `nn.Linear` times a scale (no soft cap, no hooks but
        `cast_lm_head_to_fp32`'s input cast), for the fused chunked function; None otherwise (LoRA on the head,
        quantized heads, Gemma 2's soft cap: the checkpointed module call instead)."""
        head, (scale, softcap) = self.head, self.transform
        hooks = {*head._forward_pre_hooks.values(), *head._forward_hooks.values()}
        hooks.discard(getattr(head, "_fp32_input", None))
        if type(head) is not nn.Linear or head.bias is not None or softcap is not None or hooks:
            return None
        return head.weight, scale

    def checked(self) -> bool:
        """Whether `matches` has already compared this model's head with its logits (it then runs no check)."""
        return _bare(self.model) in _VERIFIED

    def matches(self, model_logits: torch.Tensor) -> bool:
        """Whether the head on the last captured position gives the model's own last-position logits `(B, 1, V)`
        (checked once per model; a mismatch turns the path off for that model, with a log line)."""
        bare = _bare(self.model)
        if bare not in _VERIFIED and self.hidden is None:
            _VERIFIED[bare] = False
            report_fallback("log-probs", f"{type(bare).__name__}'s forward skips its decoder", "chunked_lm_head")
        if bare not in _VERIFIED:
            with torch.no_grad():
                ours, theirs = self.logits(self.hidden[:, -1:]).float(), model_logits[:, -1:].float()
                _VERIFIED[bare] = ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3)
            if not _VERIFIED[bare]:
                reason = f"{type(bare).__name__}'s decoder output times its LM head does not give its logits"
                report_fallback("log-probs", reason, "chunked_lm_head")
        return _VERIFIED[bare]


def token_scores(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    compute_entropy: bool = False,
    entropy_requires_grad: bool = False,
    logits_stats: Callable | None = None,
    vocabulary: int | None = None,
    linear: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """`(log-probs, entropies or None, stats)`, each `(B, C)`, of `targets` `(B, C)` from hidden states `(B, C, H)`.

    `logits_fn(h)` gives a chunk's logits `(n, V)`; they are divided by `temperature`, then
    `log p = z[target] - logsumexp(z)` and `H = logsumexp(z) - sum_v softmax(z)_v z_v` in float32 (the formulas of
    `selective_log_softmax` and `entropy_from_logits`); `logits_stats(logits (1, n, V), targets (1, n))` runs without
    grad on each chunk. Chunks of positions (from `_CHUNK_ELEMENTS` and `vocabulary`) are recomputed in the backward
    when the hidden states require grad and there is more than one chunk: by `LinearTokenScores` where the head is a
    plain linear layer (`linear`: its weight and scale), else by running each chunk under `checkpoint`."""
    batch, width = targets.shape
    flat_hidden, flat_targets = hidden.reshape(batch * width, -1), targets.reshape(-1)
    chunk_size = max(1, _CHUNK_ELEMENTS // max(1, vocabulary or 1))
    grad = torch.is_grad_enabled() and flat_hidden.requires_grad
    # One chunk holds everything: checkpointing it would save nothing and recompute its logits.
    checkpointed = grad and flat_hidden.size(0) > chunk_size
    options = (logits_fn, temperature, compute_entropy, entropy_requires_grad and grad, logits_stats)
    if checkpointed and linear is not None:
        stats_out: dict[str, list[torch.Tensor]] = {}
        weight, scale = linear
        logp, entropy = LinearTokenScores.apply(
            flat_hidden,
            weight,
            flat_targets,
            scale / temperature,
            chunk_size,
            compute_entropy,
            logits_stats,
            stats_out,
        )
        entropy = entropy if entropy_requires_grad else entropy.detach()
        stats = {name: torch.cat(values).view(batch, width) for name, values in stats_out.items()}
        return logp.view(batch, width), entropy.view(batch, width) if compute_entropy else None, stats
    logps, entropies, sinks = [], [], []
    for start in range(0, flat_hidden.size(0), chunk_size):
        sink = {}  # no-grad per-chunk values, filled by the chunk's first run (a checkpoint's recompute skips them)
        arguments = (flat_hidden[start : start + chunk_size], flat_targets[start : start + chunk_size], sink, *options)
        if checkpointed:
            logp, entropy = checkpoint(_chunk, *arguments, use_reentrant=False)
        else:
            logp, entropy = _chunk(*arguments)
        logps.append(logp)
        entropies.append(entropy if entropy is not None else sink.get("entropy"))
        sinks.append(sink)
    names = [name for name in (sinks[0] if sinks else {}) if name != "entropy"]
    stats = {name: torch.cat([s[name] for s in sinks]).view(batch, width) for name in names}
    entropy = torch.cat(entropies).view(batch, width) if compute_entropy else None
    return torch.cat(logps).view(batch, width), entropy, stats


def _chunk(hidden, targets, sink, logits_fn, temperature, compute_entropy, entropy_with_grad, logits_stats):
    logits = logits_fn(hidden)
    if temperature != 1.0:
        logits = logits / temperature
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if entropy_with_grad else None
    if not sink:  # the first run of this chunk (not a checkpoint recompute)
        with torch.no_grad():
            if compute_entropy and not entropy_with_grad:
                sink["entropy"] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
            if logits_stats is not None:
                for name, value in logits_stats(logits[None], targets[None]).items():
                    sink[name] = value[0]
    return logp, entropy


class LinearTokenScores(torch.autograd.Function):
    """Log-probs and entropies of `targets` under `z = factor * hidden @ weight.T`, chunk by chunk, each chunk's
    logits recomputed in the backward into one gradient buffer (no autograd graph per chunk, no `(N, V)` tensor
    beyond a chunk).

    Forward, per chunk of n positions: `z` `(n, V)` float32, `lse = logsumexp(z)`, `log p_t = z_t - lse`, and
    `H = lse - sum_v p_v z_v`; only `lse` and `H` `(N,)` are saved. Backward, with upstream gradients `g` (log-probs)
    and `g_H` (entropies): `dz = g (onehot_t - p) - g_H p (log p + H)` (since `dH/dz = -p (log p + H)`), times
    `factor`; `d hidden = dz @ weight` and `d weight += dz.T @ hidden` (skipped for a frozen head). The autocast state
    of the forward is restored for the recompute, so both see the same logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, factor, chunk_size, compute_entropy, logits_stats, stats_out):
        n = hidden.size(0)
        chunk_size = max(1, min(chunk_size, _WORK_ELEMENTS // max(1, weight.size(0))))
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, entropy = torch.empty_like(logp), torch.zeros_like(logp)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            z = LinearTokenScores._logits(hidden[rows], weight, factor)
            if logits_stats is not None:
                for name, value in logits_stats(z[None], targets[None, rows]).items():
                    stats_out.setdefault(name, []).append(value[0])
            lse[rows] = torch.logsumexp(z, dim=-1)
            logp[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
            if compute_entropy:  # H = -sum_v p_v log p_v, in two (n, V) buffers: z becomes log p
                log_p = z.sub_(lse[rows, None])
                entropy[rows] = -log_p.exp().mul_(log_p).sum(-1)
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.factor, ctx.chunk_size = factor, chunk_size
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: its term is skipped
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        with torch.autocast(*ctx.autocast):  # the forward's (device, dtype, enabled)
            for start in range(0, hidden.size(0), ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                g = None if grad_logp is None else grad_logp[rows]
                g_entropy = None if grad_entropy is None else grad_entropy[rows]
                dz = LinearTokenScores._dz(
                    hidden[rows], weight, targets[rows], lse[rows], entropy[rows], ctx.factor, g, g_entropy
                )
                if grad_hidden is not None:
                    grad_hidden[rows] = (dz @ weight).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(dz.T, hidden[rows].to(weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None, None

    @staticmethod
    def _dz(hidden, weight, targets, lse, entropy, factor, grad_logp, grad_entropy):
        """One chunk's `dz` `(n, V)` in the weight's dtype, in at most two `(n, V)` float32 buffers: the logits
        become `log p` in place, then `dz` (the chunk tensors are the backward's largest; it runs while every
        activation of the forward is still held)."""
        dz = LinearTokenScores._logits(hidden, weight, factor).sub_(lse[:, None])  # log p
        g = None if grad_logp is None else grad_logp.float()[:, None]
        if grad_entropy is None:
            dz.exp_().mul_(-g)  # -g p
        else:
            p = dz.exp()
            dz.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None].float())  # -g_H p (log p + H)
            if g is not None:
                dz.addcmul_(p, g, value=-1.0)
            del p
        if g is not None:
            dz.scatter_add_(1, targets[:, None], g)
        return dz.mul_(factor).to(weight.dtype)

    @staticmethod
    def _logits(hidden, weight, factor):
        z = (hidden.to(weight.dtype) @ weight.T).float()
        return z.mul_(factor) if factor != 1.0 else z
