r"""The generalized Jensen-Shannon divergence of on-policy distillation (GKD, Agarwal et al., 2024, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes", arXiv:2306.13649), as TRL computes it.

Per position, with student and teacher log-probs s = log_softmax(z_S / T), t = log_softmax(z_T / T) over the
vocabulary (both logits divided by the temperature T) and p_S = e^s, p_T = e^t:

    beta = 0:   D = KL(p_T || p_S) = sum_v p_T (t - s)                    (forward KL)
    beta = 1:   D = KL(p_S || p_T) = sum_v p_S (s - t)                    (reverse KL)
    otherwise:  m = log((1 - beta) p_S + beta p_T)
                D = beta KL(p_T || e^m) + (1 - beta) KL(p_S || e^m)

Two ways in: `generalized_jsd_loss` on full logits (TRL 1.10's static method, kept for its callers and tests), and
`token_divergence` on hidden states, chunked over positions, which never holds a `(positions, vocabulary)` tensor
for more than one chunk. Where both heads are plain linear layers (`LinearDivergence`), each chunk's gradient is
computed in the forward from the closed forms below, so the backward recomputes nothing while the loss weighs every
position alike (the trainers' sum over tokens / N); otherwise each chunk runs under `torch.utils.checkpoint` and its
logits are recomputed in the backward. Either way the forward and the backward peak at one chunk of logits.

Gradients with respect to the student's scaled logits u = z_S / T (so s = log_softmax(u)):

    beta = 0:   dD/du = p_S - p_T
    beta = 1:   dD/du = p_S (s - t - D)
    otherwise:  g = (1 - beta) p_S (s - m),   dD/du = g - p_S sum_v g_v
"""

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .lm_head import _WORK_ELEMENTS, apply_logit_transform


# Positions per chunk: one chunk's float32 logits stay under this many elements (x 2 models, x a few temporaries).
CHUNK_ELEMENTS = 2**24


def jsd_divergence(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """Elementwise terms of D (same shape as the inputs, `(..., V)`); summed over V they give D per position."""
    if beta == 0:
        return F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    if beta == 1:
        return F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    beta_t = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
    mixture = torch.logsumexp(
        torch.stack([student_log_probs + torch.log1p(-beta_t), teacher_log_probs + torch.log(beta_t)]), dim=0
    )
    kl_teacher = F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture, student_log_probs, reduction="none", log_target=True)
    return beta_t * kl_teacher + (1 - beta_t) * kl_student


def reduce_divergence(jsd, completion_mask=None, reduction="batchmean", num_items_in_batch=None):
    """TRL's `_reduce_divergence_loss`: keep the rows of `completion_mask` (if given), then the sum divided by
    `num_items_in_batch` when given, else by the kept rows ("batchmean"; the first dimension without a mask), the
    plain sum ("sum"), the elementwise mean ("mean"), or nothing ("none")."""
    mask = completion_mask.bool() if completion_mask is not None else None
    jsd = jsd[mask] if mask is not None else jsd
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(jsd.device)
    if num_items_in_batch is not None:
        return jsd.sum() / num_items_in_batch
    if reduction == "batchmean":
        denominator = mask.sum().clamp_min(1) if mask is not None else max(jsd.size(0), 1)
        return jsd.sum() / denominator
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    return jsd


def generalized_jsd_loss(
    student_logits,
    teacher_logits,
    labels=None,
    beta=0.5,
    temperature=1.0,
    reduction="batchmean",
    num_items_in_batch=None,
):
    """TRL's `generalized_jsd_loss` on `(B, T, V)` logits: the elementwise D terms reduced by `reduce_divergence`
    over the positions whose `labels` are not -100 (all positions without labels)."""
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    jsd = jsd_divergence(student_log_probs, teacher_log_probs, beta)
    mask = (labels != -100) if labels is not None else None
    return reduce_divergence(jsd, mask, reduction, num_items_in_batch)


# ---------------------------------------------------------------------------------------------- sparse supports
# A teacher on a server reports only a few log-probs per position (its top-k, and the sampled token's). D is then
# taken over that support: the student's full-vocabulary log-probs gathered there, both sides completed by a tail
# bucket holding the rest of the mass (log(1 - sum_k p_k)), or renormalised over the support (TRL's `loss_add_tail`).


def add_tail_bucket(log_probs: torch.Tensor, valid_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(..., K)` log-probs of a support and its mask, extended to `(..., K + 1)` with the tail bucket (the support's
    mass clamped below 1 so that the tail stays finite); the tail is always valid."""
    mass = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    tail = torch.log(-torch.expm1(mass))
    return torch.cat([log_probs, tail], dim=-1), torch.cat([valid_mask, torch.ones_like(valid_mask[..., :1])], dim=-1)


def masked_jsd_divergence(s: torch.Tensor, t: torch.Tensor, beta: float, support_mask=None) -> torch.Tensor:
    """`jsd_divergence`'s terms over a support whose masked entries (log-prob -inf) contribute 0 (TRL's
    `_jsd_divergence`); without a mask, `jsd_divergence` itself."""
    if support_mask is None:
        return jsd_divergence(s, t, beta)
    s0, t0 = s.masked_fill(~support_mask, 0.0), t.masked_fill(~support_mask, 0.0)
    ps, pt = s.exp().masked_fill(~support_mask, 0.0), t.exp().masked_fill(~support_mask, 0.0)
    if beta == 0:
        return torch.nan_to_num(pt * (t0 - s0))
    if beta == 1:
        return torch.nan_to_num(ps * (s0 - t0))
    mixture = torch.log(((1 - beta) * ps + beta * pt).clamp_min(torch.finfo(s.dtype).tiny))
    mixture = mixture.masked_fill(~support_mask, 0.0)
    return beta * torch.nan_to_num(pt * (t0 - mixture)) + (1 - beta) * torch.nan_to_num(ps * (s0 - mixture))


def sparse_divergence(student_log_probs, support_ids, teacher_log_probs, support_mask, beta: float, add_tail: bool):
    """D per position `(B, T)` over a support `(B, T, K)` (`support_ids`, the teacher's log-probs there, a mask):
    the student's full-vocabulary log-probs `(B, T, V)` gathered on it, both sides with a tail bucket or
    renormalised over the support."""
    student = student_log_probs.gather(-1, support_ids).masked_fill(~support_mask, -math.inf)
    teacher = teacher_log_probs.masked_fill(~support_mask, -math.inf)
    if add_tail:
        student, mask = add_tail_bucket(student, support_mask)
        teacher, _ = add_tail_bucket(teacher, support_mask)
    else:
        mask = support_mask
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    return masked_jsd_divergence(student, teacher, beta, mask).sum(-1).clamp_min(0.0)  # D >= 0, rounding aside


def top1_support(top1_ids, top1_log_probs, sampled_ids, sampled_log_probs, beta: float):
    """The support of the mixed (0 < beta < 1) and reverse (beta = 1) server losses: the teacher's top-1 token and
    the sampled one (the second slot masked where they coincide), or the sampled token alone at beta = 1. Returns
    `(ids, teacher log-probs, mask)`, each `(B, T, K)` with K = 2 or 1."""
    if beta == 1:
        return sampled_ids[..., None], sampled_log_probs[..., None], torch.ones_like(sampled_ids[..., None]).bool()
    ids = torch.stack([top1_ids, sampled_ids], dim=-1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[..., 1] = sampled_ids != top1_ids
    return ids.masked_fill(~mask, 0), torch.stack([top1_log_probs, sampled_log_probs], dim=-1), mask


def topk_support(student_logits, teacher_logits, beta: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """IW-OPD's support of the local top-k divergence `(ids, mask)` `(..., K')`: the teacher's top-k at beta = 0,
    the student's at beta = 1, otherwise both (K' = 2k), a token already in the support masked."""
    if beta == 0:
        ids = teacher_logits.topk(top_k, dim=-1).indices
        return ids, torch.ones_like(ids, dtype=torch.bool)
    if beta == 1:
        ids = student_logits.topk(top_k, dim=-1).indices
        return ids, torch.ones_like(ids, dtype=torch.bool)
    ids = torch.cat([teacher_logits.topk(top_k, dim=-1).indices, student_logits.topk(top_k, dim=-1).indices], dim=-1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    for i in range(1, ids.size(-1)):
        mask[..., i] &= ~((ids[..., i : i + 1] == ids[..., :i]) & mask[..., :i]).any(dim=-1)
    return ids.masked_fill(~mask, 0), mask


def topk_generalized_jsd_loss(
    student_logits,
    teacher_logits,
    labels=None,
    beta=0.5,
    temperature=1.0,
    reduction="batchmean",
    top_k=0,
    add_tail=True,
    num_items_in_batch=None,
):
    """IW-OPD's `generalized_jsd_loss` (TRL 1.16): `generalized_jsd_loss` on the whole vocabulary (`top_k=0`), or
    D on the `topk_support` of the logits (with the tail bucket, or renormalised), reduced alike."""
    if not 0 < top_k < student_logits.size(-1):
        return generalized_jsd_loss(
            student_logits, teacher_logits, labels, beta, temperature, reduction, num_items_in_batch
        )
    zs, zt = student_logits / temperature, teacher_logits / temperature
    ids, mask = topk_support(zs, zt, beta, top_k)
    teacher = F.log_softmax(zt, dim=-1).gather(-1, ids)
    divergence = sparse_divergence(F.log_softmax(zs, dim=-1), ids, teacher, mask, beta, add_tail)[..., None]
    return reduce_divergence(
        divergence, (labels != -100) if labels is not None else None, reduction, num_items_in_batch
    )


SELF_DISTILLATION_MODES = ("sampled_token", "full_logits", "topk_logits")


def sampled_token_divergence(student_logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
    """The REINFORCE estimator of reverse KL's gradient on the sampled tokens y, from their log-probs `(B, C)`:
    sg(log p_S(y) - log p_T(y)) · log p_S(y) (its value is not a divergence)."""
    return (student_logps - teacher_logps).detach() * student_logps


def self_distillation_divergence(
    student_logits, teacher_logits, completion_ids, mode: str, alpha: float, top_k=None, add_tail: bool = False
) -> torch.Tensor:
    """The per-token loss `(B, C)` of self-distillation (SDFT, arXiv:2601.19897; SDPO, arXiv:2601.20802) as TRL 1.16
    computes it, from both models' temperature-scaled logits `(B, C, V)` at the completion positions; D is
    `jsd_divergence` with beta = `alpha` (0: forward KL, 1: reverse KL):

      - `"full_logits"`: D over the whole vocabulary.
      - `"topk_logits"`: D over the student's top-`top_k` tokens, both distributions renormalised on them, or with
        `add_tail` a (K+1)-th bucket holding the rest of each one's mass.
      - `"sampled_token"`: the REINFORCE estimator of reverse KL's gradient on the sampled token y,
        sg(log p_S(y) - log p_T(y)) · log p_S(y) (its value is not a divergence; reverse KL only)."""
    if mode == "sampled_token":
        if alpha != 1.0:
            raise ValueError(
                "Only reverse KL (alpha=1.0) is supported for token-level distillation when "
                f"`distillation_mode='sampled_token'`, got alpha={alpha}"
            )
        student = student_logits.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        teacher = teacher_logits.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        return sampled_token_divergence(student, teacher)
    student, teacher = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    if mode == "full_logits":
        return jsd_divergence(student, teacher, alpha).sum(-1)
    if mode != "topk_logits":
        raise ValueError(f"distillation_mode must be one of: {SELF_DISTILLATION_MODES}, got {mode!r}")
    if top_k is None:
        raise ValueError("`distillation_mode='topk_logits'` requires `distillation_topk` to be set.")
    support = student_logits.topk(min(top_k, student_logits.size(-1)), dim=-1).indices  # k > V: all of V
    return support_divergence(student.gather(-1, support), teacher.gather(-1, support), alpha, add_tail)


def support_divergence(student, teacher, alpha: float, add_tail: bool) -> torch.Tensor:
    """D per position from both models' log-probs `(..., K)` on a support of K tokens: renormalised on it, or with
    `add_tail` the tail bucket appended to each (TRL's self-distillation top-k term)."""
    if add_tail:
        valid = torch.ones_like(student, dtype=torch.bool)
        student, teacher = add_tail_bucket(student, valid)[0], add_tail_bucket(teacher, valid)[0]
    else:
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    return jsd_divergence(student, teacher, alpha).sum(-1)


def clipped_importance_weights(student_logps, old_logps, clip: float) -> torch.Tensor:
    """`min(π_θ(y) / π_old(y), clip)` per token, without gradient (the log-ratio clamped to ±20 first): TRL's
    correction of a self-distillation loss on completions sampled by an older policy."""
    return torch.exp((student_logps - old_logps).detach().clamp(-20.0, 20.0)).clamp(max=clip)


def position_weighted_advantages(teacher, rollout, valid, gamma: float, epsilon: float):
    """IW-OPD's token advantages and their weights `(B, T)` each (Xie et al., 2026, arXiv:2606.22600), both without
    gradient: a_t = log p_T(y_t) - log p_roll(y_t) on `valid` positions (0 elsewhere), and
    w_t = 1 + gamma (1 - S_t / Z), S_t = sum_{j<t} |a_j|, Z = max(sum_j |a_j|, epsilon): w in [1, 1 + gamma], larger
    before much of the row's |a| has accumulated. A teacher log-prob that is not finite at a `valid` position (a
    server that returned none there) is an error."""
    missing = int((valid & ~torch.isfinite(teacher)).sum())
    if missing:
        raise ValueError(f"Teacher logprobs are missing for required IW-OPD positions: {missing}/{int(valid.sum())}.")
    advantage = (teacher.masked_fill(~valid, 0.0) - rollout.masked_fill(~valid, 0.0)).detach() * valid
    magnitude = advantage.abs()
    spent = (magnitude.cumsum(dim=1) - magnitude) / magnitude.sum(dim=1, keepdim=True).clamp_min(epsilon)
    return advantage, (1 + gamma * (1 - spent)).detach()


def _chunk(student_hidden, teacher_hidden, head, teacher_head, beta, temperature, transform, teacher_transform):
    """D and the student's entropy for one chunk of positions. The teacher's logits are computed here (no grad), so
    under `checkpoint` only the chunk's hidden states are saved, never its logits."""
    with torch.no_grad():
        teacher_logits = apply_logit_transform(teacher_head(teacher_hidden), *teacher_transform) / temperature
    student_logits = apply_logit_transform(head(student_hidden), *transform) / temperature
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    divergence = jsd_divergence(s, t, beta).sum(-1)
    with torch.no_grad():
        entropy = -(s.exp() * s).sum(-1)
    return divergence, entropy


def token_divergence(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head,
    teacher_head,
    beta: float,
    temperature: float = 1.0,
    student_transform=(1.0, None),
    teacher_transform=(1.0, None),
    chunk_size: int | None = None,
    linear: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(D, student entropy)` per position, `(B, C)` each, from the final hidden states `(B, C, H)` of both models
    and their LM heads. With `linear` (`((student weight, scale), (teacher weight, scale))`: both heads plain
    bias-free linear layers, `HiddenStateHead.linear`), by `LinearDivergence`; otherwise positions are processed
    `chunk_size` at a time inside `checkpoint`: only each chunk's hidden states are saved, and both chunks of logits
    (the teacher's without grad) are recomputed in the backward. The entropy carries no gradient."""
    batch, width = student_hidden.shape[:2]
    flat_student, flat_teacher = student_hidden.reshape(batch * width, -1), teacher_hidden.reshape(batch * width, -1)
    vocabulary = student_head.weight.size(0)
    chunk_size = chunk_size or max(1, CHUNK_ELEMENTS // max(1, vocabulary))
    if linear is not None:
        (weight, scale), (teacher_weight, teacher_scale) = linear
        arguments = (
            flat_student,
            weight,
            flat_teacher,
            teacher_weight,
            scale / temperature,
            teacher_scale / temperature,
            beta,
            chunk_size,
        )
        if torch.is_grad_enabled():
            divergence, entropy = LinearDivergence.apply(*arguments)
        else:  # evaluation: no gradient to compute
            divergence, entropy = LinearDivergence._run(*arguments[:4], arguments[4:], False, False)[:2]
        return divergence.view(batch, width), entropy.view(batch, width)
    grad = torch.is_grad_enabled() and flat_student.requires_grad
    parts = []
    for start in range(0, flat_student.size(0), chunk_size):
        rows = slice(start, start + chunk_size)
        arguments = (
            flat_student[rows],
            flat_teacher[rows],
            student_head,
            teacher_head,
            beta,
            temperature,
            tuple(student_transform),
            tuple(teacher_transform),
        )
        parts.append(checkpoint(_chunk, *arguments, use_reentrant=False) if grad else _chunk(*arguments))
    return tuple(torch.cat(values).view(batch, width) for values in zip(*parts))


class LinearDivergence(torch.autograd.Function):
    """D and the student's entropy of `u = factor * hidden @ weight.T` against `teacher_factor * teacher_hidden @
    teacher_weight.T`, chunk by chunk, with the gradient computed in the forward (no autograd graph per chunk, no
    `(N, V)` tensor beyond a chunk, no logits recomputed in the backward).

    Forward, per chunk of n positions: both logits `(n, V)` in float32, D, the entropy, `du` from the closed forms of
    the module docstring, then `d hidden_i = factor du_i @ weight` `(N, H)` and `d weight = factor sum_i du_i.T
    hidden_i` (a frozen head skips it). Backward, with upstream gradients `g` `(N,)`: `d hidden_i` times `g_i`, and
    `d weight` times `g` where `g` is the same at every position (a sum or mean of D over positions, the trainers'
    loss); any other `g` recomputes the chunks with `g` applied, as a checkpoint would."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, factor, teacher_factor, beta, chunk_size):
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.options = (factor, teacher_factor, beta, max(1, min(chunk_size, _WORK_ELEMENTS // max(1, weight.size(0)))))
        divergence, entropy, grad_hidden, grad_weight = LinearDivergence._run(
            hidden, weight, teacher_hidden, teacher_weight, ctx.options, *ctx.needs_input_grad[:2]
        )
        ctx.save_for_backward(hidden, weight, teacher_hidden, teacher_weight, grad_hidden, grad_weight)
        ctx.mark_non_differentiable(entropy)
        return divergence, entropy

    @staticmethod
    def backward(ctx, grad_divergence, grad_entropy):
        hidden, weight, teacher_hidden, teacher_weight, grad_hidden, grad_weight = ctx.saved_tensors
        g = grad_divergence.float()
        if ctx.needs_input_grad[1] and not bool((g == g[:1]).all()):  # weights differ by position: recompute
            with torch.autocast(*ctx.autocast):  # the forward's (device, dtype, enabled)
                _, _, grad_hidden, grad_weight = LinearDivergence._run(
                    hidden, weight, teacher_hidden, teacher_weight, ctx.options, gradients=True, weight_grad=True, g=g
                )
            g = None
        d_hidden = grad_hidden if g is None else grad_hidden * g[:, None]
        d_weight = grad_weight if g is None or grad_weight is None else grad_weight * g[:1].to(grad_weight.dtype)
        return d_hidden.to(hidden.dtype), d_weight, None, None, None, None, None, None

    @staticmethod
    def _run(hidden, weight, teacher_hidden, teacher_weight, options, gradients, weight_grad, g=None):
        """`(D, entropy, d hidden, d weight)` over all chunks; the gradients (times the per-position `g` when given)
        only with `gradients` / `weight_grad`, else None."""
        factor, teacher_factor, beta, chunk_size = options
        n = hidden.size(0)
        divergence = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(divergence)
        grad_hidden = torch.empty(n, hidden.size(1), dtype=torch.float32, device=hidden.device) if gradients else None
        grad_weight = torch.zeros_like(weight) if weight_grad else None
        with torch.no_grad():
            for start in range(0, n, chunk_size):
                rows = slice(start, start + chunk_size)
                h, h_t = hidden[rows].to(weight.dtype), teacher_hidden[rows].to(teacher_weight.dtype)
                s = F.log_softmax((h @ weight.T).float().mul_(factor), dim=-1)
                t = F.log_softmax((h_t @ teacher_weight.T).float().mul_(teacher_factor), dim=-1)
                divergence[rows] = jsd_divergence(s, t, beta).sum(-1)
                p = s.exp()
                entropy[rows] = -(p * s).sum(-1)
                if not gradients:
                    continue
                du = LinearDivergence._du(s, t, p, divergence[rows], beta)
                del s, t, p
                du = du.mul_(factor if g is None else factor * g[rows, None]).to(weight.dtype)
                grad_hidden[rows] = du @ weight
                if grad_weight is not None:
                    grad_weight.addmm_(du.T, h)
        return divergence, entropy, grad_hidden, grad_weight

    @staticmethod
    def _du(s, t, p, divergence, beta):
        """dD/du `(n, V)` (the module docstring's closed forms), reusing the chunk's buffers."""
        if beta == 0:
            return p.sub_(t.exp_())
        if beta == 1:
            return p.mul_(s.sub_(t).sub_(divergence[:, None]))
        mixture = torch.logaddexp(s + math.log1p(-beta), t.add_(math.log(beta)))
        g = s.sub_(mixture).mul_(p).mul_(1 - beta)
        return g.sub_(p.mul_(g.sum(-1, keepdim=True)))
