"""SiLU-and-mul: the gated activation of the Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` concatenated on the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
