"""Write a step's new K and V into the paged KV cache.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``; the token with
flat slot ``s`` lives at ``cache.view(-1, H, D)[s]``. A negative slot marks padding and is
skipped.
"""

from __future__ import annotations

import torch


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch twin (the spec): ``k_cache.flat[slot_mapping[t]] = k[t]`` for slots >= 0."""
    h, d = k_cache.shape[-2:]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(-1, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
