"""Paged decode attention: one query token per sequence against its KV, read through its block table.

Shapes: ``q [S, Hq, D]``; caches ``[num_blocks, Hkv, block_size, D]``; ``block_tables
[S, max_blocks]`` int32 (rows padded with any valid block id); ``seq_lens [S]`` = context length
including this step's token (whose K/V ``store_kv`` has already written). ``Hq`` is a multiple of
``Hkv`` (GQA).
"""

from __future__ import annotations

import torch

from kernels.paged import gather_context


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch twin (the spec): gather each context, masked softmax attention in fp32."""
    s, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    max_len = int(seq_lens.max())
    k = gather_context(k_cache, block_tables, max_len).float()  # [S, Hkv, L, D]
    v = gather_context(v_cache, block_tables, max_len).float()
    # The query heads sharing a KV head act as a "query length" of `group` rows against
    # that head's keys, which avoids materialising repeated K/V for GQA.
    qg = q.view(s, hkv, group, d).float()
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # [S, Hkv, group, L]
    beyond = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), v)
    return out.reshape(s, hq, d).to(q.dtype)
