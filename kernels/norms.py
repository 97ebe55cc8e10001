"""RMSNorm, optionally fused with the residual add that precedes it in a transformer block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._launch import check_device, check_float, check_last_contiguous, tile_cap


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
    if weight.dtype == x.dtype and x.device.type == "cpu":
        # torch's fused CPU kernel computes exactly this (fp32 math, one rounding: checked equal
        # bit for bit in tests/test_kernels_elementwise.py) in one call instead of eight.
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = (normed * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, r_ptr, out_ptr, new_r_ptr,
    M, B, N, eps,
    sx_a, sx_b, sr_a, sr_b,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Rows are the flattened leading dims of a logical [A, B, N] view: row m = (m // B, m % B).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < N)
    r64 = rows.to(tl.int64)
    a = r64 // B
    b = r64 % B
    x = tl.load(x_ptr + (a * sx_a + b * sx_b)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + (a * sr_a + b * sr_b)[:, None] + cols[None, :], mask=mask, other=0.0)
        # The sum is rounded to the input dtype, as the twin's `x + residual` is, before the norm.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_r_ptr + r64[:, None] * N + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = xf * inv[:, None] * w[None, :]
    tl.store(out_ptr + r64[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """A [A, B, N] view (or, for > 3 dims that cannot be viewed, copy) of ``x [..., N]``."""
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`rms_norm_torch` for ``x [..., N]`` (e.g. ``[T, N]`` or per-head
    ``[T, H, D]``; strided views are fine if the last dim is contiguous). Each program
    normalises a tile of whole rows in fp32. Outputs are new contiguous tensors."""
    op = "rms_norm"
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dim")
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"{op}: weight must be [{n}] for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    check_float(op, x=x, weight=weight)
    check_device(op, x, weight=weight)
    check_last_contiguous(op, x=x, weight=weight)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual {residual.dtype} must match x {x.dtype}")
        check_device(op, x, residual=residual)
        check_last_contiguous(op, residual=residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_r = torch.empty_like(out) if residual is not None else None
    m = x.numel() // n if n else 0
    if m > 0 and n > 0:
        x3 = _as_3d(x)
        r3 = _as_3d(residual) if residual is not None else x3
        block_n = triton.next_power_of_2(n)
        block_m = min(triton.next_power_of_2(m), max(1, tile_cap() // block_n))
        _rms_norm_kernel[(triton.cdiv(m, block_m),)](
            x3, weight, r3, out, new_r if new_r is not None else out,
            m, x3.shape[1], n, float(eps),
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        )
    return out if new_r is None else (out, new_r)
