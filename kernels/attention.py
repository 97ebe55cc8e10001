"""Attention over the paged KV cache: decode (one query token per sequence) and extend
(a ragged batch of new tokens, causal among themselves, full attention to the cached prefix).

Both read K/V only from the cache: ``store_kv`` has already written the step's new tokens, so
the new tokens' own K/V are at the tail of each sequence's context.

Shapes: ``q [T, Hq, D]``; caches ``[num_blocks, Hkv, block_size, D]``; ``block_tables
[S, max_blocks]`` int32 (rows padded with any valid block id); ``seq_lens [S]`` = context length
of each sequence *including* this step's tokens; ``query_start_loc [S + 1]`` int32 offsets of
each sequence's queries in ``q`` (extend only). ``Hq`` is a multiple of ``Hkv`` (GQA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int
) -> torch.Tensor:
    """``[S, Hkv, max_len, D]`` contiguous copy of each sequence's first ``max_len`` slots."""
    num_blocks, h, bs, d = cache.shape
    nb = -(-max_len // bs)
    s = block_tables.shape[0]
    # (block, head) pairs are contiguous [bs, D] tiles: one index_select over them lands
    # every head's context contiguously, in the order attention reads it.
    tiles = block_tables[:, None, :nb].long() * h + torch.arange(h, device=cache.device)[None, :, None]
    out = torch.index_select(cache.view(num_blocks * h, bs, d), 0, tiles.view(-1))
    return out.view(s, h, nb * bs, d)[:, :, :max_len]


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch twin of paged decode attention: gather each context, one masked SDPA call."""
    s, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    max_len = int(seq_lens.max())
    k = _gather_context(k_cache, block_tables, max_len)  # [S, Hkv, L, D]
    v = _gather_context(v_cache, block_tables, max_len)
    # The query heads sharing a KV head act as a "query length" of `group` rows against
    # that head's keys, which avoids materialising repeated K/V for GQA.
    qg = q.view(s, hkv, group, d).to(k.dtype)
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # [S, Hkv, group, L]
    beyond = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), v)
    return out.reshape(s, hq, d).to(q.dtype)


def extend_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch twin of prefill/extend attention, one SDPA call per sequence."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        q_i = q[starts[i] : starts[i + 1]]
        n = q_i.shape[0]
        if n == 0:
            continue
        k = _gather_context(k_cache, block_tables[i : i + 1], ctx)  # [1, Hkv, ctx, D]
        v = _gather_context(v_cache, block_tables[i : i + 1], ctx)
        if ctx == n:  # no cached prefix: plain causal attention (SDPA's fast path)
            mask, causal = None, True
        else:
            # Query j sits at absolute position ctx - n + j and sees keys 0..ctx - n + j.
            rows = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= rows, False
        o = F.scaled_dot_product_attention(
            q_i.transpose(0, 1).unsqueeze(0).to(k.dtype), k, v,
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
        )
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1)
    return out
