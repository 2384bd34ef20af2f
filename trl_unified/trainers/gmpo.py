r"""Geometric-Mean Policy Optimization (GMPO), Zhao et al., 2025 (arXiv:2507.20673): a drop-in for TRL 1.16's
`trl.experimental.gmpo.GMPOTrainer`, which is GRPO with one loss: the "gmpo" entry of GRPO's loss table
(`online/policy_losses.py`, `LOSSES`; `GRPOConfig(loss_type="gmpo")` selects it in GRPO too).

Per sequence i with advantage A_i (GRPO's group-relative one) and per-token log-ratios log w_t = log(π_θ / π_old),
each clipped in log space on the side that would raise the objective (PPO's min),
c_t = min(log w_t, clip(log w_t, -ε, ε_high)) if A_i > 0 else max(log w_t, clip(log w_t, -ε, ε_high)):

    l_i = -exp((1/|o_i|) Σ_t c_t) · A_i          (the geometric mean of the clipped token ratios)

over the completion tokens (those `top_entropy_quantile` keeps), and the loss of a micro-batch is (1/B) Σ_i l_i / GA
(plus GRPO's KL term with β > 0). The geometric mean is far less sensitive to one outlier ratio than the arithmetic
mean, so the clipping range can be wider: ε = ε_high = 0.4 by default (log space: ratios in (e^-0.4, e^0.4)).
"""

from dataclasses import dataclass

from ..core.config import document_fields, option
from .grpo import GRPOConfig, GRPOTrainer


_TRL_DEFAULT_LOSS_TYPE = "dapo"  # GMPOConfig inherits GRPOConfig's loss_type and ignores it


@document_fields
@dataclass
class GMPOConfig(GRPOConfig):
    """Configuration of `GMPOTrainer`: every field of `trl.experimental.gmpo.GMPOConfig` 1.16 (GRPO's, with the
    clipping range in log space), same names and defaults."""

    epsilon: float = option(0.4, "Lower clipping bound in log space: ratios below exp(-epsilon) are clipped.")
    epsilon_high: float | None = option(None, "Upper clipping bound in log space (None: epsilon).")

    def __post_init__(self):
        if self.loss_type not in (_TRL_DEFAULT_LOSS_TYPE, "gmpo"):
            raise ValueError(
                f"loss_type={self.loss_type!r}: GMPO's loss is the geometric mean of the token ratios (loss_type "
                "'gmpo'); use GRPOTrainer for GRPO's other loss types."
            )
        self.loss_type = "gmpo"
        super().__post_init__()


class GMPOTrainer(GRPOTrainer):
    """GMPO (see the module docstring): GRPOTrainer with the "gmpo" loss. Same constructor as TRL's GMPOTrainer."""

    _name = "GMPO"
    config_class = GMPOConfig
