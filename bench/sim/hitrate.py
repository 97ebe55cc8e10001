"""Sequence-only prefix-cache hit rate of a trace under one LRU cache (FAST'25 Fig. 9).

No timing: requests are replayed in order against a single cache of the given capacity, each
looking up its longest cached prefix and then storing all of its blocks.
"""

from __future__ import annotations

from typing import Sequence

from bench.trace import TraceEntry
from cluster.prefix_index import LRUBlockCache, prefix_tokens


def lru_hit_rate(entries: Sequence[TraceEntry], capacity_tokens: int | None, block_size: int = 512) -> float:
    """Token-weighted hit rate: reused prompt tokens over all prompt tokens."""
    if capacity_tokens is not None and capacity_tokens < 0:
        raise ValueError("capacity_tokens must be >= 0 or None")
    cache = LRUBlockCache(None if capacity_tokens is None else capacity_tokens // block_size)
    hit = total = 0
    for e in entries:
        hit += prefix_tokens(cache.match_len(e.hash_ids), e.input_length, block_size)
        total += e.input_length
        cache.insert(e.hash_ids)
    return hit / total if total else 0.0
