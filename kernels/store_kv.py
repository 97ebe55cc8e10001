"""Write a step's new K and V into the paged KV cache.

Cache layout (one layer): ``[num_blocks, num_kv_heads, block_size, head_dim]``. Token slot
``s`` is position ``s % block_size`` of block ``s // block_size``. Heads come before slots so
that one head's keys of one block are a contiguous ``[block_size, head_dim]`` tile: gathering a
sequence's blocks per head then yields ``[heads, context, head_dim]`` directly, the layout
attention reads, with no transpose copy. A negative slot marks padding and is skipped.
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
    """Torch twin (the spec): ``cache[s // bs, :, s % bs] = new[t]`` for ``s = slot_mapping[t] >= 0``."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    bs = k_cache.shape[2]
    block, offset = slot_mapping // bs, slot_mapping % bs
    # Advanced indices around a slice: the indexed view is [T, H, D], matching k and v.
    k_cache[block, :, offset] = k.to(k_cache.dtype)
    v_cache[block, :, offset] = v.to(v_cache.dtype)
