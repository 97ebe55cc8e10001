"""SiLU-and-mul: the gated activation of the Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._launch import check_float, check_last_contiguous, tile_cap


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` concatenated on the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, M, N, sx,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    src = x_ptr + rows[:, None] * sx + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + N, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`silu_and_mul_torch` for ``x [..., 2N]`` -> new ``[..., N]``
    (fp32 math, one rounding to ``x.dtype``). Rows may be strided; the last dim must be contiguous."""
    op = "silu_and_mul"
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"{op}: last dim must be even (gate | up), got shape {tuple(x.shape)}")
    check_float(op, x=x)
    check_last_contiguous(op, x=x)
    n = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, 2 * n)  # a view for the usual contiguous / row-strided 2-D input
    m = x2.shape[0]
    block_n = min(triton.next_power_of_2(n), 1024 if tile_cap() <= 4096 else 1 << 14)
    block_m = min(triton.next_power_of_2(m), max(1, tile_cap() // block_n))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _silu_and_mul_kernel[grid](x2, out, m, n, x2.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
    return out
