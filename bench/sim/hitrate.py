"""Sequence-only prefix-cache hit rate of a trace under one LRU cache (FAST'25 Fig. 9).

No timing: requests are replayed in order against a single cache of the given capacity, each
looking up its longest cached prefix and then storing all of its blocks.

``pool_hit_rate`` / ``pool_hits`` model the live cluster's KVCache pool the same way (one LRU
over pool blocks, capacity in blocks) with what the instances actually store and reuse: the
last prompt token's block is never reused, and a finished request also stores its output
blocks, which take room but nothing else reuses (``bench.pool_trace`` compares it with a run).
"""

from __future__ import annotations

from typing import Sequence

from bench.trace import TraceEntry
from cluster.policies.prefix_index import LRUBlockCache, prefix_tokens


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


def pool_hit_rate(entries: Sequence[TraceEntry], capacity_blocks: int | None, block_size: int = 512) -> float:
    """Token-weighted prefix hit rate of one global KVCache pool of ``capacity_blocks`` blocks
    (see ``pool_hits``): reused prompt tokens over all prompt tokens."""
    hits = pool_hits(entries, capacity_blocks, block_size)
    total = sum(e.input_length for e in entries)
    return sum(hits) / total if total else 0.0


def pool_hits(entries: Sequence[TraceEntry], capacity_blocks: int | None, block_size: int = 512) -> list[int]:
    """Prompt tokens each request reuses from one global KVCache pool of ``capacity_blocks`` blocks.

    Requests are replayed in order, each finishing before the next arrives. A request reuses
    the longest run of its leading ``hash_ids`` the pool holds, but never the block of its last
    prompt token (that token is always computed: its logits give the first output token). At
    its finish it stores every full block of its prompt and output whose KV was computed (all
    of prompt + output but the last sampled token): the prompt's full blocks under their
    ``hash_ids``, the rest (a full prompt block the trace has no id for, the partial last
    prompt block completed by output tokens, output blocks) under keys of its own that no other
    request shares. LRU over blocks (``LRUBlockCache``: a stored chain's head is kept longest).
    ``capacity_blocks`` None: unbounded.
    """
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError("capacity_blocks must be >= 0 or None")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    cache = LRUBlockCache(capacity_blocks)
    hits = []
    for i, e in enumerate(entries):
        lookable = max(0, e.input_length - 1) // block_size
        hits.append(cache.match_len(e.hash_ids[:lookable]) * block_size)
        prompt_keys = list(e.hash_ids[: e.input_length // block_size])
        stored = max(0, e.input_length + e.output_length - 1) // block_size
        own = [("own", i, j) for j in range(len(prompt_keys), stored)]
        cache.insert(prompt_keys + own)
    return hits
