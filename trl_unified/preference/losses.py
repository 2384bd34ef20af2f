r"""The pairwise preference losses DPO and online DPO share: a score per completion from its log-ratio against the
reference (`f_scores`, f-DPO), and the loss of each pair (`pair_losses`, one formula and paper per loss type; the
module docstring of `trainers/dpo.py` gives the objective they enter)."""

import math

import torch
import torch.nn.functional as F


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
        return -F.logsigmoid(beta * d)
    if loss_type == "hinge":  # SLiC, Zhao et al., 2023 (arXiv:2305.10425): max(0, 1 - βΔ)
        return torch.relu(1 - beta * d)
    if loss_type in ("ipo", "sigmoid_norm"):  # per-token scores; IPO (arXiv:2310.12036, Eq. 17): (Δ̄ - 1/2τ)², τ=β
        d = t["s_w"] / t["len_w"] - t["s_l"] / t["len_l"]
        return (d - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * d)
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
        return -F.logsigmoid(beta * (a - b)) * (1 - smoothing) - F.logsigmoid(-beta * (a - b)) * smoothing
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
