"""Block-quantized linear layers on CPU: the weight formats, the native kernel's launcher and the
torch twin that specifies it.

* q4: per block of ``BLOCK`` weights along a row, 4-bit codes ``q`` in 0..15, an fp16 scale ``d``
  and an fp16 minimum ``m``: ``w = q * d + m`` (GGUF's Q4_1 grid). Packed ``[N, K / 32 * 20]``
  uint8: each row its blocks' codes, 16 bytes a block, then its blocks' ``d``, then their ``m``.
  A pair of blocks is 32 bytes whose low nibbles are the first block's codes and high nibbles
  the second's, so the kernel unpacks 64 codes with one load, a shift and two masks; an odd
  last block holds codes 0..15 in its low nibbles and 16..31 in its high ones.

The kernel quantizes each row of activations per block of 32 in two 8-bit levels, ``x ~= d *
(q + r / 256)`` with ``d = max|x| / 127`` and ``r`` coding what ``q`` rounded off (codes rounded
half to even, ``r`` clamped to +-127), keeps each block's exact float sum for the ``m`` term, and
multiplies with integer dot products (``(q . w) << 8 + r . w`` per block, then one float scale):
GGUF's Q8_1 activations with a second level, because 8 bits alone were too coarse for this
model's activations (kernels/csrc/cpu_decode.cpp says by how much). The twin computes the same
sums in float.
"""

from __future__ import annotations

import torch

from . import cpu_ext

BLOCK = 32
Q4_BLOCK_BYTES = 20


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` codes 0..15, ``d`` and ``m [N, K / 32]`` fp16 -> the packed q4 weight."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"q4 needs input features divisible by {BLOCK}, got {k}")
    nb = k // BLOCK
    codes = q.to(torch.uint8).view(n, nb, BLOCK)
    pairs = codes[:, : nb // 2 * 2].view(n, nb // 2, 2, BLOCK)
    parts = [(pairs[:, :, 0] | (pairs[:, :, 1] << 4)).view(n, -1)]
    if nb % 2:
        parts.append(codes[:, -1, :16] | (codes[:, -1, 16:] << 4))
    parts.append(torch.cat((d.to(torch.float16), m.to(torch.float16)), dim=-1).view(torch.uint8))  # [N, nb * 4]
    return torch.cat(parts, dim=-1).contiguous()


def unpack_q4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_q4`: ``q`` (uint8), ``d`` and ``m`` (fp16)."""
    n, nb = packed.shape[0], packed.shape[1] // Q4_BLOCK_BYTES
    pairs = packed[:, : nb // 2 * 32].reshape(n, nb // 2, 1, BLOCK)
    parts = [torch.cat((pairs & 0x0F, pairs >> 4), dim=2).reshape(n, -1)]
    if nb % 2:
        last = packed[:, nb // 2 * 32 : nb * 16]
        parts.append(torch.cat((last & 0x0F, last >> 4), dim=-1))
    scales = packed[:, nb * 16 :].contiguous().view(torch.float16)
    return torch.cat(parts, dim=-1), scales[:, :nb], scales[:, nb:]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``x [M, K]`` per block of 32, as the kernel computes them: the two levels of int8
    codes ``q`` and ``r`` ``[M, K]``, the blocks' scales ``d`` (``max|x| / 127``) and exact float
    sums ``[M, K / 32]``; ``x ~= d * (q + r / 256)``."""
    m, k = x.shape
    xb = x.float().view(m, k // BLOCK, BLOCK)
    scale = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    v = xb * inv[..., None]
    q = torch.round(v)
    r = torch.round((v - q) * 256).clamp_(-127, 127)
    return q.view(m, k).to(torch.int8), r.view(m, k).to(torch.int8), scale, xb.sum(dim=-1)


def quant_linear_torch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin (the spec): ``x [M, K]`` float times a q4 weight (``scale`` None) or a q8 one
    (int8 ``packed`` and its row ``scale``), ``[M, N]`` float32."""
    m, k = x.shape
    xq, xr, xd, xs = quantize_activations(x)
    # The activations on their grid, in units of the block's scale (exact in float32: < 2^16).
    xg = (xq.float() * 256 + xr.float()).view(m, k // BLOCK, BLOCK) / 256
    if scale is None:
        q, d, mins = unpack_q4(packed)
        qw = q.float().view(q.shape[0], k // BLOCK, BLOCK)
        # per block: d_w * d_x * (q_w . x_grid) + m_w * sum(x)
        dots = torch.einsum("mbi,nbi->mnb", xg, qw)
        return (dots * d.float()[None] * xd[:, None]).sum(-1) + xs @ mins.float().T
    qw = packed.float().view(packed.shape[0], k // BLOCK, BLOCK)
    dots = torch.einsum("mbi,nbi->mnb", xg, qw)
    return (dots * xd[:, None]).sum(-1) * scale[None]


def quant_linear_native(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The native kernel (threads: torch's); same arguments and result as the twin."""
    return cpu_ext.load().quant_linear(x.float(), packed, scale)
