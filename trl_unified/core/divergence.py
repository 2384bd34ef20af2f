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
for more than one chunk: each chunk's logits are recomputed in the backward (`torch.utils.checkpoint`), so the
forward and the backward peak at one chunk of student and teacher logits.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .lm_head import apply_logit_transform


# Positions per chunk: one chunk's float32 logits stay under this many elements (x 2 models, x a few temporaries).
_CHUNK_ELEMENTS = 2**24


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
    mask = None
    if completion_mask is not None:
        mask = completion_mask.bool()
        jsd = jsd[mask]
    if num_items_in_batch is not None:
        total = jsd.sum()
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    if reduction == "batchmean":
        denominator = mask.sum().clamp_min(1) if mask is not None else max(jsd.size(0), 1)
        return jsd.sum() / denominator
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    return jsd


def generalized_jsd_loss(
    student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0, reduction="batchmean",
    num_items_in_batch=None,
):  # fmt: skip
    """TRL's `generalized_jsd_loss` on `(B, T, V)` logits: the elementwise D terms reduced by `reduce_divergence`
    over the positions whose `labels` are not -100 (all positions without labels)."""
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    jsd = jsd_divergence(student_log_probs, teacher_log_probs, beta)
    mask = (labels != -100) if labels is not None else None
    return reduce_divergence(jsd, mask, reduction, num_items_in_batch)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(D, student entropy)` per position, `(B, C)` each, from the final hidden states `(B, C, H)` of both models
    and their LM heads. Positions are processed `chunk_size` at a time inside `checkpoint`: only each chunk's hidden
    states are saved, and both chunks of logits (the teacher's without grad) are recomputed in the backward. The
    entropy carries no gradient."""
    batch, width = student_hidden.shape[:2]
    flat_student = student_hidden.reshape(batch * width, -1)
    flat_teacher = teacher_hidden.reshape(batch * width, -1)
    vocabulary = student_head.weight.size(0)
    chunk_size = chunk_size or max(1, _CHUNK_ELEMENTS // max(1, vocabulary))
    divergences, entropies = [], []
    for start in range(0, flat_student.size(0), chunk_size):
        rows = slice(start, start + chunk_size)
        arguments = (flat_student[rows], flat_teacher[rows], student_head, teacher_head, beta, temperature,
                     tuple(student_transform), tuple(teacher_transform))  # fmt: skip
        if torch.is_grad_enabled() and flat_student.requires_grad:
            divergence, entropy = checkpoint(_chunk, *arguments, use_reentrant=False)
        else:
            divergence, entropy = _chunk(*arguments)
        divergences.append(divergence)
        entropies.append(entropy)
    return torch.cat(divergences).view(batch, width), torch.cat(entropies).view(batch, width)
