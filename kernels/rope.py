"""Rotary position embedding in the rotate-half (GPT-NeoX / HF Llama) layout."""

from __future__ import annotations

import torch


def rotary_embedding_torch(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor
) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by its tokens' ``positions [T]``.

    ``cos_sin_cache [max_pos, D]`` holds ``cos`` in the first ``D/2`` columns and ``sin`` in
    the rest. Dimension ``i`` pairs with ``i + D/2``.
    """
    half = x.shape[-1] // 2
    cos, sin = cos_sin_cache[positions].unsqueeze(1).split(half, dim=-1)
    x1, x2 = x.float().split(half, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
