"""RMSNorm, optionally fused with the residual add that precedes it in a transformer block."""

from __future__ import annotations

import torch


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)`` over the last dim, computed in fp32.

    With ``residual``: ``x = x + residual`` first, and returns ``(normed, x)`` where ``x`` is the
    new residual stream.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)
