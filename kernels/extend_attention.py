"""Prefill / extend attention: a ragged batch of new tokens, causal among themselves and with full
attention to each sequence's cached prefix, all read from the paged cache.

Shapes: ``q [T, Hq, D]``; caches ``[num_blocks, Hkv, block_size, D]``; ``block_tables
[S, max_blocks]`` int32; ``seq_lens [S]`` context lengths including the new tokens (whose K/V
``store_kv`` has already written); ``query_start_loc [S + 1]`` int32 offsets of each sequence's
queries in ``q``. Query ``j`` of sequence ``i`` sits at position ``seq_lens[i] - n_i + j``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._launch import check_device, check_int32, check_paged_attention, output_like
from .paged import gather_context


def extend_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch twin (the spec): one fp32 SDPA call per sequence."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        q_i = q[starts[i] : starts[i + 1]]
        n = q_i.shape[0]
        if n == 0:
            continue
        k = gather_context(k_cache, block_tables[i : i + 1], ctx).float()  # [1, Hkv, ctx, D]
        v = gather_context(v_cache, block_tables[i : i + 1], ctx).float()
        if ctx == n:  # no cached prefix: plain causal attention (SDPA's fast path)
            mask, causal = None, True
        else:
            # Query j sits at absolute position ctx - n + j and sees keys 0..ctx - n + j.
            rows = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= rows, False
        o = F.scaled_dot_product_attention(
            q_i.transpose(0, 1).unsqueeze(0).float(), k, v,
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
        )
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_tile(
    acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kvh, start, qpos, ctx,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    scale_log2,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One BLOCK_N-key step of the online softmax for a [ROWS, D_P] query tile."""
    keys = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_P)
    d_ok = d < HEAD_DIM
    if CAUSAL:
        key_ok = keys < ctx  # the tile's last keys may run past the context
    else:
        key_ok = keys >= 0  # the unmasked prefix tiles lie wholly inside the context
    # Per-key physical block: a tile may span several (small) cache blocks.
    blk = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = keys % BLOCK_SIZE
    k_off = blk * stride_kb + kvh * stride_kh + slot * stride_ks
    v_off = blk * stride_vb + kvh * stride_vh + slot * stride_vs
    kv_mask_t = d_ok[:, None] & key_ok[None, :]
    kt = tl.load(k_ptr + k_off[None, :] + d[:, None] * stride_kd, mask=kv_mask_t, other=0.0)
    if DOT_FP32:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = s * scale_log2  # log2 domain: exp2 below
    if CAUSAL:
        s = tl.where((keys[None, :] <= qpos[:, None]) & key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + v_off[:, None] + d[None, :] * stride_vd,
                mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _extend_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_bts,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program (sequence, query tile, kv head): BLOCK_M new tokens x the GROUP query heads that
    share the kv head, packed as ROWS = BLOCK_M * GROUP_P rows (row = token * GROUP_P + head)."""
    seq = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - q_start
    if m0 >= n:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    prefix = ctx - n

    ROWS: tl.constexpr = BLOCK_M * GROUP_P
    r = tl.arange(0, ROWS)
    tok = m0 + r // GROUP_P
    hg = r % GROUP_P
    row_ok = (tok < n) & (hg < GROUP)
    head = kvh * GROUP + hg
    qpos = prefix + tok  # absolute position of each row's token
    d = tl.arange(0, D_P)
    d_ok = d < HEAD_DIM
    row_t = (q_start + tok).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row_t[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Finite start: a row whose first tile is wholly masked keeps alpha = 1, p = 0 (no NaN).
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D_P], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts

    # Keys before the tile's first query position are visible to every row: no mask.
    full_end = ((prefix + m0) // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _extend_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kvh, start, qpos, ctx,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_vb, stride_vh, stride_vs, stride_vd, scale_log2,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_P, False, DOT_FP32,
        )
    # Then up to the tile's last visible key, causally masked.
    end = tl.minimum(ctx, prefix + m0 + BLOCK_M)
    for start in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _extend_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kvh, start, qpos, ctx,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_vb, stride_vh, stride_vs, stride_vd, scale_log2,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_P, True, DOT_FP32,
        )

    l_safe = tl.where(row_ok, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + row_t[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :] * stride_od, out.to(o_ptr.dtype.element_ty), mask=q_mask)


_MAX_HEAD_DIM = 256
_OP = "extend_attention_triton"


def _tiles(group: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """(GROUP_P, BLOCK_M, BLOCK_N, D_P, num_warps): ~128 packed query rows per program, 64 keys
    per step (half of each for head_dim > 128 to bound registers)."""
    group_p = triton.next_power_of_2(group)
    d_p = max(16, triton.next_power_of_2(head_dim))
    rows = 128 if d_p <= 128 else 64
    block_m = max(1, rows // group_p)
    block_n = 64 if d_p <= 128 else 32
    num_warps = 8 if block_m * group_p * d_p >= 128 * 128 else 4
    return group_p, block_m, block_n, d_p, num_warps


def extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton extend attention; same contract and result as :func:`extend_attention_torch`.

    ``max_query_len`` (the largest ``n_i``) sizes the grid. When it is ``None`` it is computed
    from ``query_start_loc`` on the host: one device->host copy, i.e. a stream sync on CUDA. That
    same copy also checks ``query_start_loc[-1] == T``, non-decreasing offsets and
    ``seq_lens[i] >= n_i``; a caller that passes ``max_query_len`` skips the sync and these value
    checks (it must then be >= every ``n_i``: tiles beyond it are never run).
    ``out`` (optional, shaped and typed like ``q``) receives the result.
    """
    check_paged_attention(
        _OP, q, k_cache, v_cache, block_tables, seq_lens, min_head_dim=1, max_head_dim=_MAX_HEAD_DIM
    )
    check_int32(_OP, 1, query_start_loc=query_start_loc)
    t, hq, d = q.shape
    _, hkv, block_size, _ = k_cache.shape
    s = seq_lens.shape[0]
    if query_start_loc.shape[0] != s + 1:
        raise ValueError(
            f"{_OP}: query_start_loc has {query_start_loc.shape[0]} entries; "
            f"expected S + 1 = {s + 1}"
        )
    check_device(_OP, q, query_start_loc=query_start_loc)
    out = output_like(_OP, q, out)
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()

    if max_query_len is None:
        if s == 0:
            max_query_len = 0
            last = 0
        else:
            n_i = query_start_loc[1:] - query_start_loc[:-1]
            # One host copy (a sync on CUDA) for the grid size and the value checks.
            last, max_query_len, min_n, min_prefix = torch.stack(
                [query_start_loc[-1], n_i.max(), n_i.min(), (seq_lens - n_i).min()]
            ).tolist()
            if min_n < 0:
                raise ValueError(f"{_OP}: query_start_loc must be non-decreasing")
            if min_prefix < 0:
                raise ValueError(
                    f"{_OP}: seq_lens[i] must be >= sequence i's number of new tokens"
                )
        if last != t:
            raise ValueError(f"{_OP}: query_start_loc[-1] = {last} but q has T = {t} tokens")
    if s == 0 or t == 0 or max_query_len <= 0:
        return out

    group = hq // hkv
    group_p, block_m, block_n, d_p, num_warps = _tiles(group, d)
    # fp16/bf16 dots run on the inputs' dtype (P cast to it for PV), accumulating in fp32. Triton's
    # interpreter gets bf16 arithmetic wrong, so bf16 is upcast there; fp32 inputs always use
    # IEEE fp32 dots (no TF32) to match the fp32 twin.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    dot_fp32 = q.dtype == torch.float32 or (interpreted and q.dtype == torch.bfloat16)
    grid = (s, triton.cdiv(max_query_len, block_m), hkv)
    _extend_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=d, D_P=d_p, DOT_FP32=dot_fp32,
        num_warps=num_warps, num_stages=2,
    )
    return out
