"""Paged decode attention: one query token per sequence against its KV, read through its block table.

Shapes: ``q [S, Hq, D]``; caches ``[num_blocks, Hkv, block_size, D]``; ``block_tables
[S, max_blocks]`` int32 (rows padded with any valid block id); ``seq_lens [S]`` = context length
including this step's token (whose K/V ``store_kv`` has already written). ``Hq`` is a multiple of
``Hkv`` (GQA).

:func:`decode_attention_triton` is the Triton kernel (split-K flash-decoding, see below),
:func:`decode_attention_native` the CPU one (reads K and V through the block table in place,
no gathered copy); :func:`decode_attention_torch` is their specification.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cpu_ext
from ._launch import check_paged_attention, output_like
from .paged import DecodeContext, gather_tiles


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    context: DecodeContext | None = None,
) -> torch.Tensor:
    """Torch twin (the spec): gather each context, masked softmax attention in fp32.

    ``context``: how to read the contexts (:class:`kernels.paged.DecodeContext`, built once per
    step for every layer); worked out here from ``block_tables`` and ``seq_lens`` when not given.
    """
    s, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if context is None:
        context = DecodeContext.build(block_tables, seq_lens, hkv, k_cache.shape[2])
    out = None if len(context.groups) == 1 else torch.empty_like(q)
    for g in context.groups:
        n = s if g.rows is None else g.rows.shape[0]
        # [n * Hkv, L, D]: the (sequence, KV head) pairs as one batch of 3-D matmuls (a view).
        k = gather_tiles(k_cache, g.tiles, n, g.max_len).flatten(0, 1).float()
        v = gather_tiles(v_cache, g.tiles, n, g.max_len).flatten(0, 1).float()
        # The query heads sharing a KV head act as a "query length" of `group` rows against
        # that head's keys, which avoids materialising repeated K/V for GQA.
        qg = (q if g.rows is None else q[g.rows]).reshape(n * hkv, group, d).float()
        scores = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)  # [n * Hkv, group, L]
        if g.beyond is not None:
            scores.view(n, hkv, group, g.max_len).masked_fill_(g.beyond, float("-inf"))
        o = torch.bmm(scores.softmax(-1), v).view(n, hq, d).to(q.dtype)
        if out is None:
            return o
        out[g.rows] = o
    return out


def decode_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The native CPU kernel: each (sequence, KV head) reads its keys and values tile by tile
    through the block table (no gathered copy), scores the query heads of its GQA group against
    eight keys at a time and takes an exact softmax in fp32; (sequence, KV head, span of the
    context) items are split over torch's threads and the spans merged by their softmax partials
    (docs/kernels.md#native-cpu-kernels)."""
    return cpu_ext.load().decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


# --------------------------------------------------------------------------------------------
# Triton kernel: split-K ("flash-decoding") paged attention.
#
# Grid (sequence, kv head, split). A program owns every query head of one KV head (the GQA
# group, padded to BLOCK_G >= 16 rows so QK^T and PV run as tl.dot) and a contiguous range of
# the sequence's context tiles (BLOCK_N tokens each, read through the block table). It keeps an
# online softmax (running max / sum / accumulator, fp32, base-2 exponent) and writes either the
# final output (one split) or a normalised partial output plus its log2-sum-exp, which
# `_decode_reduce_kernel` combines across the splits.
# --------------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
_MIN_TOKENS_PER_SPLIT = 256
_NOMINAL_SMS = 132  # used when there is no CUDA device to ask (interpreter)
_sm_count_cache: dict[int, int] = {}


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, part_ptr, lse_ptr, out_ptr,
    num_splits,
    sq_s, sq_h, sq_d,
    sk_b, sk_h, sk_t, sk_d,
    sv_b, sv_h, sv_t, sv_d,
    sbt_s, sbt_b, ssl,
    sp_s, sp_h, sp_k,
    slse_s, slse_h,
    so_s, so_h, so_d,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK_PER_TILE: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(sl_ptr + seq * ssl)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g

    seq64 = seq.to(tl.int64)
    q = tl.load(
        q_ptr + seq64 * sq_s + heads[:, None] * sq_h + d[None, :] * sq_d,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    k_base = k_ptr + kvh.to(tl.int64) * sk_h
    v_base = v_ptr + kvh.to(tl.int64) * sv_h
    bt_row = bt_ptr + seq64 * sbt_s

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    for t in range(t_begin, t_end):
        start = t * BLOCK_N
        tok = start + n
        valid = tok < seq_len
        if ONE_BLOCK_PER_TILE:
            # The tile lies inside one cache block: one block-table lookup.
            blk = tl.load(bt_row + (start // BLOCK_SIZE) * sbt_b).to(tl.int64)
            slot = (start % BLOCK_SIZE) + n
            k_off = blk * sk_b + slot[:, None] * sk_t + d[None, :] * sk_d
            v_off = blk * sv_b + slot[:, None] * sv_t + d[None, :] * sv_d
        else:
            # The tile spans several cache blocks: look each token's block up.
            blk = tl.load(bt_row + (tok // BLOCK_SIZE) * sbt_b, mask=valid, other=0).to(tl.int64)
            slot = tok % BLOCK_SIZE
            k_off = blk[:, None] * sk_b + slot[:, None] * sk_t + d[None, :] * sk_d
            v_off = blk[:, None] * sv_b + slot[:, None] * sv_t + d[None, :] * sv_d
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_base + k_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + v_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(
            out_ptr + seq64 * so_s + heads[:, None] * so_h + d[None, :] * so_d,
            o.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        tl.store(
            part_ptr + seq64 * sp_s + heads[:, None] * sp_h + split * sp_k + d[None, :],
            o, mask=out_mask,
        )
        tl.store(lse_ptr + seq64 * slse_s + heads * slse_h + split, m_i + tl.log2(l_safe), mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_ptr, lse_ptr, sl_ptr, out_ptr,
    num_splits,
    ssl, sp_s, sp_h, sp_k, slse_s, slse_h, so_s, so_h, so_d,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    # Recompute which splits the split kernel gave work to (the rest wrote nothing useful).
    seq_len = tl.load(sl_ptr + seq * ssl)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), 1)
    used = tl.cdiv(num_tiles, per_split)

    kk = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    k_mask = kk < used
    d_mask = d < HEAD_DIM
    seq64 = seq.to(tl.int64)
    lse = tl.load(lse_ptr + seq64 * slse_s + h * slse_h + kk, mask=k_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(k_mask, tl.exp2(lse - m), 0.0)
    part = tl.load(
        part_ptr + seq64 * sp_s + h * sp_h + kk[:, None] * sp_k + d[None, :],
        mask=k_mask[:, None] & d_mask[None, :], other=0.0,
    )
    num = tl.sum(w[:, None] * part, 0)
    den = tl.sum(w, 0)
    den = tl.where(den > 0, den, 1.0)
    tl.store(
        out_ptr + seq64 * so_s + h * so_h + d * so_d,
        (num / den).to(out_ptr.dtype.element_ty), mask=d_mask,
    )


class DecodeWorkspace:
    """Preallocated split-K buffers for :func:`decode_attention_triton`.

    ``partial [max_batch, num_heads, max_splits, head_dim]`` fp32 (per-split normalised outputs)
    and ``lse [max_batch, num_heads, max_splits]`` fp32 (their log2-sum-exp). With one of these
    (and ``out=``) a call allocates nothing, so it can be captured in a CUDA graph. Calls with
    a smaller batch / fewer heads / smaller head_dim / fewer splits use a corner of it.
    """

    def __init__(
        self,
        max_batch: int,
        num_heads: int,
        head_dim: int,
        max_splits: int = _MAX_SPLITS,
        device: torch.device | str = "cuda",
    ):
        if min(max_batch, num_heads, head_dim, max_splits) < 1:
            raise ValueError("DecodeWorkspace: every size must be >= 1")
        self.max_batch, self.num_heads = max_batch, num_heads
        self.head_dim, self.max_splits = head_dim, max_splits
        self.device = torch.device(device)
        self.partial = torch.empty(
            max_batch, num_heads, max_splits, head_dim, dtype=torch.float32, device=self.device
        )
        self.lse = torch.empty(max_batch, num_heads, max_splits, dtype=torch.float32, device=self.device)

    def fits(self, batch: int, num_heads: int, head_dim: int, splits: int) -> bool:
        return (
            batch <= self.max_batch and num_heads <= self.num_heads
            and head_dim <= self.head_dim and splits <= self.max_splits
        )


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _NOMINAL_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count_cache:
        _sm_count_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count_cache[idx]


def decode_tile(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Context tokens per loop step: ~16 KiB of K per tile (register budget), 16..128 tokens.

    It is a multiple of the cache block (small blocks) or a power-of-two divisor of it (large
    blocks), so with power-of-two block sizes a tile never straddles a block boundary partway.
    """
    elem = torch.finfo(dtype).bits // 8
    n = 16384 // (triton.next_power_of_2(head_dim) * elem)
    return max(16, min(128, triton.next_power_of_2(n)))


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int = _NOMINAL_SMS) -> int:
    """Split-K factor: 1 for short contexts or when (sequence, kv head) programs already fill
    the GPU; otherwise enough splits for ~2 programs per SM, each split >= 256 tokens, <= 32."""
    programs = max(1, batch * num_kv_heads)
    if max_context <= 2 * _MIN_TOKENS_PER_SPLIT or programs >= sm_count:
        return 1
    want = -(-2 * sm_count // programs)
    return max(1, min(want, max_context // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged decode attention; same contract as :func:`decode_attention_torch`.

    ``num_splits``: split-K factor (default: :func:`choose_num_splits` from the batch, KV heads
    and the context bound ``block_tables.shape[1] * block_size``, clamped to the workspace).
    ``workspace``: preallocated split buffers (a temporary one is made when needed and not given).
    ``out``: ``[S, Hq, D]`` tensor of q's dtype to write into. Nothing here reads device data,
    so the call does not synchronise (CUDA-graph capturable with a workspace and ``out``).
    """
    op = "decode_attention_triton"
    check_paged_attention(op, q, k_cache, v_cache, block_tables, seq_lens, min_head_dim=16, max_head_dim=256)
    s, hq, d = q.shape
    if seq_lens.shape[0] != s:
        raise ValueError(f"{op}: batch mismatch: q has {s} sequences, seq_lens {seq_lens.shape[0]}")
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv

    out = output_like(op, q, out)
    if s == 0:
        return out

    block_n = decode_tile(bs, d, q.dtype)
    if num_splits is None:
        num_splits = choose_num_splits(s, hkv, block_tables.shape[1] * bs, _sm_count(q.device))
        if workspace is not None:
            num_splits = min(num_splits, workspace.max_splits)
    elif num_splits < 1:
        raise ValueError(f"{op}: num_splits must be >= 1, got {num_splits}")

    direct = num_splits == 1
    if direct:
        part = lse = out  # unused by the kernel
        part_strides, lse_strides = (0, 0, 0), (0, 0)
    else:
        if workspace is None:
            workspace = DecodeWorkspace(s, hq, d, num_splits, q.device)
        elif workspace.device != q.device:
            raise ValueError(f"{op}: workspace is on {workspace.device}, q on {q.device}")
        elif not workspace.fits(s, hq, d, num_splits):
            raise ValueError(
                f"{op}: workspace (batch {workspace.max_batch}, heads {workspace.num_heads}, "
                f"head_dim {workspace.head_dim}, splits {workspace.max_splits}) too small for "
                f"batch {s}, heads {hq}, head_dim {d}, splits {num_splits}"
            )
        part, lse = workspace.partial, workspace.lse
        part_strides, lse_strides = part.stride()[:3], lse.stride()[:2]

    block_g = max(16, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(d)
    one_block = bs % block_n == 0
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit
    num_warps = 4 if block_n * block_d <= 8192 else 8
    _decode_split_kernel[(s, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse, out,
        num_splits,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *block_tables.stride(), seq_lens.stride(0),
        *part_strides, *lse_strides, *out.stride(),
        float(scale) * _LOG2E,
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=bs,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        ONE_BLOCK_PER_TILE=one_block, DIRECT=direct, PRECISION=precision,
        num_warps=num_warps,
    )
    if not direct:
        _decode_reduce_kernel[(s, hq)](
            part, lse, seq_lens, out,
            num_splits,
            seq_lens.stride(0), *part_strides, *lse_strides, *out.stride(),
            HEAD_DIM=d, BLOCK_N=block_n,
            BLOCK_K=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
            num_warps=4,
        )
    return out
