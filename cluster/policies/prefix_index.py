"""Prefix-cache views over chained block keys, as the Conductor sees each prefill instance.

A request's prompt is named by the keys of its 512-token blocks (the traces' ``hash_ids``, or
``paged_kv.prefix_keys.chain_keys`` over real tokens). Keys are chained: key *i* names block *i*
*and everything before it*, so the reusable part of a prompt on an instance is the run of
leading keys that instance holds; one missing key ends the match even if later keys are present.

The policies only need ``match_len``; anything with that method (``PrefixView``) can stand for an
instance's cache, e.g. a set of keys a live prefill instance reported. ``LRUBlockCache`` is the
instance-local DRAM cache the simulator keeps.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container, Hashable, Protocol, Sequence

BlockKey = Hashable


def match_len(keys: Sequence[BlockKey], cached: Container[BlockKey]) -> int:
    """Number of leading ``keys`` in ``cached``: the reusable prefix, in blocks."""
    n = 0
    for k in keys:
        if k not in cached:
            break
        n += 1
    return n


class PrefixView(Protocol):
    """What a policy may ask of one instance's cache."""

    def match_len(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` present (the reusable prefix, in blocks)."""
        ...


class LRUBlockCache:
    """Block-key cache with least-recently-used eviction and a capacity in blocks.

    ``insert`` touches a prompt's keys from last to first, so the first block of a prompt is the
    most recently used: under pressure the tail of a chain goes before its head, and a cached
    suffix never outlives the prefix it depends on (a key without its parent is unreachable).
    """

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[BlockKey, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._keys

    def match_len(self, keys: Sequence[BlockKey]) -> int:
        return match_len(keys, self._keys)

    def insert(self, keys: Sequence[BlockKey]) -> None:
        """Store (or refresh) every key of a prompt, evicting the least recently used beyond capacity."""
        cached = self._keys
        for k in reversed(keys):
            if k in cached:
                cached.move_to_end(k)
            else:
                cached[k] = None
        cap = self.capacity_blocks
        if cap is not None:
            while len(cached) > cap:
                cached.popitem(last=False)
                self.evictions += 1


def prefix_tokens(blocks: int, input_length: int, block_size: int) -> int:
    """Tokens covered by ``blocks`` leading blocks; the last trace block is usually partial."""
    return min(blocks * block_size, input_length)
