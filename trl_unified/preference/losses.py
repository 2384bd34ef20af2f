r"""The preference losses, one home for what DPO, online DPO, ORPO, CPO (SimPO, AlphaPO) and TPO share.

- Sequence log-probs of a completion from its per-token log-probs: summed, or length-normalised (SimPO, ORPO, IPO):
  `sequence_logps`. The NLL term (ORPO's, CPO's behaviour cloning, TPO's gold response, DPO's "sft"): `nll`.
- Losses of a margin Δ between a pair's two scores (`sigmoid_loss`, `hinge_loss`, `ipo_loss`, and SimPO's target
  margin through `margin_losses`): DPO reads Δ from log-ratios against a reference model, the reference-free losses
  (CPO, SimPO, TPO) from the policy's log-probs alone.
- ORPO's log odds ratio (`log_odds_ratio`, with `log1mexp` done stably) and AlphaPO's reward (`alphapo_rewards`).
- DPO's scores per completion from its log-ratio (`f_scores`, f-DPO) and the loss of each pair per loss type
  (`pair_losses`; the module docstring of `trainers/dpo.py` gives the objective they enter).
"""

import math

import torch
import torch.nn.functional as F


def sequence_logps(per_token: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """log π(y|x) per row `(B,)` from per-token log-probs `(B, T)` over the tokens of `mask`: the sum Σ_t, or with
    `average` the length-normalised mean (1/|y|) Σ_t (SimPO, arXiv:2405.14734, Eq. 4; ORPO; IPO as TRL), |y| at
    least 1 (a row without completion tokens reads 0, not 0/0)."""
    total = (per_token * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def nll(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood of the tokens of `mask`, averaged over those tokens (all rows together, as a
    cross-entropy over the batch's tokens): -Σ_{i,t} m_it log π(y_it) / Σ_{i,t} m_it."""
    return -(per_token * mask).sum() / mask.sum()


def sigmoid_loss(margin: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """-(1 - ε) log σ(βΔ) - ε log σ(-βΔ): DPO's Eq. 7 (arXiv:2305.18290), with ε the label-flip probability of
    conservative DPO (cDPO, Mitchell, 2023) when `label_smoothing` > 0. `(B,)` in, `(B,)` out."""
    loss = -F.logsigmoid(beta * margin) * (1 - label_smoothing)
    return loss - F.logsigmoid(-beta * margin) * label_smoothing if label_smoothing else loss


def hinge_loss(margin: torch.Tensor, beta: float) -> torch.Tensor:
    """max(0, 1 - βΔ) (SLiC, Zhao et al., 2023, arXiv:2305.10425)."""
    return torch.relu(1 - beta * margin)


def ipo_loss(margin: torch.Tensor, beta: float) -> torch.Tensor:
    """(Δ - 1/(2τ))², τ = β (IPO, Azar et al., 2023, arXiv:2310.12036, Eq. 17)."""
    return (margin - 1 / (2 * beta)) ** 2


def margin_losses(
    loss_type: str, margin: torch.Tensor, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0
) -> torch.Tensor:
    """The loss `(B,)` of a margin Δ = s_w - s_l for the reference-free loss types: "sigmoid", "hinge", "ipo", and
    "simpo" (SimPO, Meng et al., 2024, arXiv:2405.14734, Eq. 6: the sigmoid loss of Δ - γ/β, a target reward margin
    γ; TPO's "tpo-l" is the same with its own γ)."""
    if loss_type == "sigmoid":
        return sigmoid_loss(margin, beta, label_smoothing)
    if loss_type == "hinge":
        return hinge_loss(margin, beta)
    if loss_type == "ipo":
        return ipo_loss(margin, beta)
    if loss_type == "simpo":
        return sigmoid_loss(margin - gamma / beta, beta, label_smoothing)
    raise ValueError(f"Unknown loss type {loss_type!r}: expected sigmoid, hinge, ipo or simpo.")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x <= 0, stable over the whole range (Mächler, 2012): log(-expm1(x)) near 0, where 1 - e^x
    loses its digits, and log1p(-e^x) below -log 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def log_odds_ratio(logps_w: torch.Tensor, logps_l: torch.Tensor) -> torch.Tensor:
    """ORPO's log odds ratio (Hong et al., 2024, arXiv:2403.07691, Eq. 4-6) from length-normalised log-probs
    P = exp(logps): log(odds(y_w) / odds(y_l)), odds(y) = P / (1 - P), in log space:
    (logps_w - logps_l) - (log(1 - P_w) - log(1 - P_l)). Computed in float32. `(B,)` each."""
    logps_w, logps_l = logps_w.float(), logps_l.float()
    return (logps_w - logps_l) - (log1mexp(logps_w) - log1mexp(logps_l))


def alphapo_rewards(logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """AlphaPO's reward (Gupta et al., 2025, arXiv:2501.03884): r = (1 - p^(-α)) / α with p = exp(logps), computed
    as (1 - exp(-α logps)) / α (no underflow of p for a long sequence); α → 0 gives r = logps."""
    return (1 - torch.exp(-alpha * logps)) / alpha


def f_scores(logratios: torch.Tensor, kind: str, alpha: float) -> torch.Tensor:
    """s = f'(exp h) for the f-divergence (f-DPO): reverse KL h; forward KL 1 - e^-h; JS log 2 + log σ(h);
    α-divergence (e^((α-1)h) - 1)/(α-1), exponent clamped at 80 (h itself at α = 1)."""
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:
        exponent = torch.clamp(((alpha - 1.0) * logratios).float(), max=80.0)
        return (torch.exp(exponent) - 1.0).to(logratios.dtype) / (alpha - 1.0)
    return logratios


def pair_losses(t: dict, loss_type: str, beta: float, smoothing: float, tau: float) -> torch.Tensor:
    """Per-pair loss `(B,)` of one loss type. `t`: h_w, h_l (log-ratios), delta (score difference), s_w, s_l,
    logps_w/l and ref_w/l (sequence log-probs), len_w/len_l (completion lengths), sft (the chosen-token NLL)."""
    h_w, h_l, d = t["h_w"], t["h_l"], t["delta"]
    if loss_type == "sigmoid":  # DPO, Eq. 7: -log σ(βΔ)
        return sigmoid_loss(d, beta)
    if loss_type == "hinge":
        return hinge_loss(d, beta)
    if loss_type in ("ipo", "sigmoid_norm"):  # per-token scores Δ̄; IPO: (Δ̄ - 1/2τ)², τ=β
        d = t["s_w"] / t["len_w"] - t["s_l"] / t["len_l"]
        return ipo_loss(d, beta) if loss_type == "ipo" else sigmoid_loss(d, beta)
    if loss_type == "exo_pair":  # EXO (arXiv:2402.00856, Eq. 16): KL(softmax(βΔ) || [1-ε, ε])
        q_w, q_l = torch.sigmoid(beta * d), torch.sigmoid(-beta * d)
        return q_w * (F.logsigmoid(beta * d) - math.log1p(-smoothing)) + q_l * (
            F.logsigmoid(-beta * d) - math.log(smoothing)
        )
    if loss_type == "nca_pair":  # NCA (arXiv:2402.05369): -log σ(βh_w) - ½ log σ(-βh_w) - ½ log σ(-βh_l)
        return -F.logsigmoid(beta * h_w) - 0.5 * F.logsigmoid(-beta * h_w) - 0.5 * F.logsigmoid(-beta * h_l)
    if loss_type == "robust":  # rDPO (arXiv:2403.00409, Eq. 5), ε = label_smoothing
        return (-(1 - smoothing) * F.logsigmoid(beta * d) + smoothing * F.logsigmoid(-beta * d)) / (1 - 2 * smoothing)
    if loss_type == "bco_pair":  # BCO (arXiv:2404.04656), paired: -log σ(βh_w) - log σ(-βh_l)
        return -F.logsigmoid(beta * h_w) - F.logsigmoid(-beta * h_l)
    if loss_type == "sppo_hard":  # SPPO (arXiv:2405.00675), hard labels: (h_w - 1/2β)² + (h_l + 1/2β)²
        return (h_w - 0.5 / beta) ** 2 + (h_l + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_unpaired"):  # AOT (arXiv:2406.05882): sorted log-ratio distributions, smoothed
        pair = (t["logps_w"] - t["logps_l"], t["ref_w"] - t["ref_l"]) if loss_type == "aot" else (h_w, h_l)
        a, b = (torch.sort(x, dim=0)[0] for x in pair)
        return sigmoid_loss(a - b, beta, smoothing)
    if loss_type == "apo_zero":  # APO (arXiv:2408.06266, Eq. 7): 1 - σ(βh_w) + σ(βh_l)
        return 1 - torch.sigmoid(beta * h_w) + torch.sigmoid(beta * h_l)
    if loss_type == "apo_down":  # APO, Eq. 8: σ(βh_w) + 1 - σ(β(h_w - h_l))
        return torch.sigmoid(beta * h_w) + 1 - torch.sigmoid(beta * (h_w - h_l))
    if loss_type == "discopop":  # DiscoPOP (arXiv:2406.08414, Eq. 5): log-ratio modulated logistic/exponential mix
        mix = torch.sigmoid(beta * d / tau)
        return -F.logsigmoid(beta * d) * (1 - mix) + torch.exp(-beta * d) * mix
    if loss_type == "sft":  # NLL of the chosen tokens (RPO-style term), the same value for every pair
        return t["sft"].expand(h_w.size(0))
    raise ValueError(f"Unknown loss type {loss_type!r}")
