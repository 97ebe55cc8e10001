"""Block-quantized linear layers on CPU: the weight formats, the native kernel's launcher and the
torch twin that specifies it.

The native kernel is an integer GEMM (kernels/csrc/int_gemm.h) that reads a weight in panels of
``NR`` = 16 output columns, unpacked once in registers for a tile of activation rows, so every row
costs only its multiply-adds. Both formats are packed in those panels (the last one padded with
zero columns), block by block of ``BLOCK`` = 32 inputs:

* q4: per block of 32 weights along a row, 4-bit codes ``q`` in 0..15, an fp16 scale ``d`` and an
  fp16 minimum ``m``: ``w = q * d + m`` (GGUF's Q4_1 grid). ``[panels, K / 32, 320]`` uint8: per
  block 4 groups of 64 bytes of codes, then the panel's 16 ``d``, then its 16 ``m``. In group ``g``
  bytes ``4l..4l+3`` are column ``l``'s: the low nibble of byte ``4l+i`` codes input ``8g+i``, the
  high nibble input ``8g+4+i`` (an AND gives four inputs of all 16 columns, a shift the next four).
* q8: int8 codes with a float scale per column, ``w = q * scale``. ``[panels, K / 32, 512]``
  uint8: per block 8 quads of 64 bytes, bytes ``4l..4l+3`` of quad ``j`` column ``l``'s inputs
  ``4j..4j+3``, as ``q + 128`` (unsigned, the operand the integer dot instructions take); the
  scales padded to whole panels.

The kernel quantizes each row of activations per block of 32 in two 8-bit levels, ``x ~= d *
(q + r / 256)`` with ``d = max|x| / 127`` and ``r`` coding what ``q`` rounded off (codes rounded
half to even, ``r`` clamped to +-127), keeps each block's exact float sum for the ``m`` term, and
multiplies with integer dot products (``(q . w) << 8 + r . w`` per block, then one float scale):
GGUF's Q8_1 activations with a second level, because 8 bits alone were too coarse for this
model's activations (kernels/csrc/int_gemm.h says by how much). Its sums run in one order
whatever the rows, threads or instruction set (int_gemm.h), so a row's result is the same bits in
any batch. The twin computes the same sums in float.
"""

from __future__ import annotations

import torch

from . import cpu_ext

BLOCK = 32
NR = 16
Q4_PANEL_BLOCK = 320
Q8_PANEL_BLOCK = 512


def _panels(n: int) -> int:
    return -(-n // NR)


def _pad_columns(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t [n, ...]`` with zero rows added up to whole panels."""
    extra = _panels(n) * NR - n
    return t if not extra else torch.cat((t, t.new_zeros((extra, *t.shape[1:]))))


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` codes 0..15, ``d`` and ``m [N, K / 32]`` fp16 -> the packed q4 weight."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"q4 needs input features divisible by {BLOCK}, got {k}")
    nb, p = k // BLOCK, _panels(n)
    # [panel, column l, block, group g, nibble h, i] -> [panel, block, g, l, i, h]
    codes = _pad_columns(q.to(torch.uint8), n).view(p, NR, nb, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    codes = (codes[..., 0] | (codes[..., 1] << 4)).reshape(p, nb, 256)
    scales = [_pad_columns(t.to(torch.float16), n).view(p, NR, nb).transpose(1, 2).contiguous().view(torch.uint8)
              for t in (d, m)]
    return torch.cat((codes, *scales), dim=-1).contiguous()


def unpack_q4(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_q4` for a weight of ``n`` columns: ``q`` (uint8), ``d`` and ``m`` (fp16)."""
    p, nb, _ = packed.shape
    codes = packed[..., :256].reshape(p, nb, 4, NR, 4)  # [panel, block, g, l, i]
    both = torch.stack((codes & 0x0F, codes >> 4), dim=-1)  # [..., i, h]
    q = both.permute(0, 3, 1, 2, 5, 4).reshape(p * NR, nb * BLOCK)[:n]

    def scales(at: int) -> torch.Tensor:
        t = packed[..., at : at + 32].contiguous().view(torch.float16)  # [panel, block, l]
        return t.transpose(1, 2).reshape(p * NR, nb)[:n]

    return q, scales(256), scales(288)


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, K]`` int8 codes in -127..127 and ``scale [N]`` -> the packed q8 weight and its
    float32 scales padded to whole panels."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"q8 needs input features divisible by {BLOCK}, got {k}")
    nb, p = k // BLOCK, _panels(n)
    offset = (q.to(torch.int16) + 128).to(torch.uint8)
    codes = _pad_columns(offset, n).view(p, NR, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(p, nb, Q8_PANEL_BLOCK)
    return codes.contiguous(), _pad_columns(scale.float(), n).contiguous()


def unpack_q8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The int8 codes ``[n, K]`` of a packed q8 weight."""
    p, nb, _ = packed.shape
    codes = packed.view(p, nb, 8, NR, 4).permute(0, 3, 1, 2, 4).reshape(p * NR, nb * BLOCK)[:n]
    return (codes.to(torch.int16) - 128).to(torch.int8)


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


def quant_linear_torch(x: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin (the spec): ``x [M, K]`` float times a packed q4 weight of ``n`` columns
    (``scale`` None) or a q8 one (its padded column ``scale``), ``[M, n]`` float32."""
    m, k = x.shape
    xq, xr, xd, xs = quantize_activations(x)
    # The activations on their grid, in units of the block's scale (exact in float32: < 2^16).
    xg = (xq.float() * 256 + xr.float()).view(m, k // BLOCK, BLOCK) / 256
    if scale is None:
        q, d, mins = unpack_q4(packed, n)
        qw = q.float().view(n, k // BLOCK, BLOCK)
        # per block: d_w * d_x * (q_w . x_grid) + m_w * sum(x)
        dots = torch.einsum("mbi,nbi->mnb", xg, qw)
        return (dots * d.float()[None] * xd[:, None]).sum(-1) + xs @ mins.float().T
    qw = unpack_q8(packed, n).float().view(n, k // BLOCK, BLOCK)
    dots = torch.einsum("mbi,nbi->mnb", xg, qw)
    return (dots * xd[:, None]).sum(-1) * scale[None, :n]


def quant_linear_native(x: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The native kernel (threads: torch's); same arguments and result as the twin."""
    return cpu_ext.load().quant_linear(x.float(), packed, scale, n)
