"""Rotary position embedding in the rotate-half (GPT-NeoX / HF Llama) layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_device, check_float, check_last_contiguous, tile_cap


def rotary_embedding_torch(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by its tokens' angles.

    ``cos_sin [T, D]`` holds token ``t``'s ``cos`` in the first ``D/2`` columns of row ``t`` and
    its ``sin`` in the rest: the rows of the model's table at the step's positions, gathered
    once per step for every layer. Dimension ``i`` pairs with ``i + D/2``.
    """
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    # Each half is written in place of a preallocated result: four fused multiply-adds, no
    # temporaries and no concatenation (per-call overhead is most of a decode step's rotary).
    out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
    return out.to(x.dtype)


@triton.jit
def _rope_kernel(
    x_ptr, cs_ptr, out_ptr,
    H, HALF,
    sx_t, sx_h, scs,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    imask = i < HALF
    mask = (h[:, None] < H) & imask[None, :]
    t64 = t.to(tl.int64)
    cos = tl.load(cs_ptr + t64 * scs + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + t64 * scs + HALF + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    h64 = h.to(tl.int64)[:, None]
    src = x_ptr + t64 * sx_t + h64 * sx_h + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (t64 * H + h64) * (2 * HALF) + i[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)


def rotary_embedding_triton(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`rotary_embedding_torch`: one program per (token, head tile), fp32
    math, a new contiguous ``[T, H, D]`` result. ``x`` may be a strided view (last dim
    contiguous)."""
    op = "rotary_embedding"
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [T, H, D], got {tuple(x.shape)}")
    t, h, d = x.shape
    if d % 2:
        raise ValueError(f"{op}: head_dim {d} must be even")
    if cos_sin.shape != (t, d):
        raise ValueError(f"{op}: cos_sin must be [{t}, {d}] (one row per token), got {tuple(cos_sin.shape)}")
    check_float(op, x=x, cos_sin=cos_sin)
    check_device(op, x, cos_sin=cos_sin)
    check_last_contiguous(op, x=x, cos_sin=cos_sin)
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(h), max(1, tile_cap() // (2 * block_half)))
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, cos_sin, out,
        h, half, x.stride(0), x.stride(1), cos_sin.stride(0),
        BLOCK_H=block_h, BLOCK_HALF=block_half,
    )
    return out
