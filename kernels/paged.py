"""Reading a sequence's KV out of the paged cache (shared by the attention twins).

Cache layout (one layer): ``[num_blocks, Hkv, block_size, D]``; ``block_tables [S, max_blocks]``
int32 rows padded with any valid block id.
"""

from __future__ import annotations

import torch


def gather_context(
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
