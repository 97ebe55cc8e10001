"""Prefill / extend attention: a ragged batch of new tokens, causal among themselves and with full
attention to each sequence's cached prefix, all read from the paged cache.

Shapes: ``q [T, Hq, D]``; caches ``[num_blocks, Hkv, block_size, D]``; ``block_tables
[S, max_blocks]`` int32; ``seq_lens [S]`` context lengths including the new tokens (whose K/V
``store_kv`` has already written); ``query_start_loc [S + 1]`` int32 offsets of each sequence's
queries in ``q``. Query ``j`` of sequence ``i`` sits at position ``seq_lens[i] - n_i + j``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged import gather_context


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
