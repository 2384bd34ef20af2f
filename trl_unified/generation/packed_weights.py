"""Prepacked linear weights for decoding on CPU (calls of at least `MIN_NEW_TOKENS` tokens): every float32 `nn.Linear`
weight packed once (oneDNN) per generation call; why and how exactly: docs/decoding.md ("Prepacked linear weights")."""

import contextlib
import logging

import torch
from torch import nn


logger = logging.getLogger(__name__)

# Packing the 33.8M-parameter benchmark model takes ~30-60 ms, about what 5 decode steps save.
MIN_NEW_TOKENS = 8
_status: dict[str, str | None] = {}  # "reason": why packing is unavailable in this PyTorch build (None: available)


def _unavailable_reason() -> str | None:
    """Why this PyTorch build cannot pack linear weights (checked once, on a small product), or None."""
    if "reason" not in _status:
        try:
            if not torch.backends.mkldnn.is_available():
                raise RuntimeError("PyTorch was built without oneDNN (mkldnn)")
            generator = torch.Generator().manual_seed(0)  # not the global generator: sampling must not move
            weight, x = torch.randn(24, 16, generator=generator), torch.randn(3, 16, generator=generator)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 3)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            if not torch.allclose(out, nn.functional.linear(x, weight), rtol=1e-4, atol=1e-5):
                raise RuntimeError("the packed product differs from F.linear")
            _status["reason"] = None
        except Exception as e:  # any failure of the probe: keep F.linear
            _status["reason"] = f"{type(e).__name__}: {e}"
            logger.info(f"Linear weights are not prepacked for CPU decoding: {_status['reason']}.")
    return _status["reason"]


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear  # not quantised subclasses (bitsandbytes) or layers that bypass forward
        and weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not hasattr(module, "_hf_hook")  # accelerate offloading hooks move weights inside forward
    )


def _packed_forward(module: nn.Linear, rows: int):
    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_grad_enabled():  # the packed product has no backward
            return nn.functional.linear(x, module.weight, module.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")

    return forward


@contextlib.contextmanager
def packed_linear_weights(model: nn.Module, rows: int, enabled: bool = True):
    """Within the context, every float32 CPU `nn.Linear` of `model` multiplies with a once-packed copy of its weight.

    For inference only (the packed product has no backward); `rows` is the number of rows a decode step multiplies
    (the batch), a hint for the packing layout. Does nothing when `enabled` is False, when no layer qualifies, or when
    this PyTorch build cannot pack (logged once).
    """
    if not enabled or _unavailable_reason() is not None:
        yield
        return
    patched = []
    try:
        for module in model.modules():
            if _packable(module):
                own_forward = module.__dict__.get("forward")  # an instance-level forward, put back on exit
                module.forward = _packed_forward(module, max(int(rows), 1))
                patched.append((module, own_forward))
        yield
    finally:
        for module, own_forward in patched:
            if own_forward is None:
                del module.forward
            else:
                module.forward = own_forward
