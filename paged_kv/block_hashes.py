"""Block hashes in the convention KV indexers share (Mooncake RFC #1527, NVIDIA Dynamo).

Other engines and routers name a cached block by a 64-bit *sequence hash*: each full block's
token ids, as unsigned 32-bit little-endian integers, hashed with XXH3-64 (seed 1337) into its
*local hash*; the first block's sequence hash is its local hash, block i's is XXH3-64 (seed 1337)
of the 8 little-endian bytes of block i-1's sequence hash followed by those of block i's local
hash. A trailing partial block has none. Sources: Mooncake's Conductor indexer API reference
(docs/source/api-reference/http/conductor-indexer.md, "hashing"), Dynamo's KV router
(``compute_block_hash_for_seq``, ``XXH3_SEED``). Our engines' own keys (``prefix_keys``) differ:
they are wider, to be collision-free in the pool; these are for talking to others.
"""

from __future__ import annotations

import struct
from typing import Sequence

import xxhash

SEED = 1337


def local_hash(token_ids: Sequence[int]) -> int:
    """One block's local hash: XXH3-64 of its tokens as u32 little-endian."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(token_ids)}I", *token_ids), seed=SEED)


def sequence_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """The sequence hash of every full block of ``token_ids`` (``parent``: the sequence hash of
    the block before the first, None at the start of a sequence)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        local = local_hash(token_ids[start:start + block_size])
        parent = local if parent is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=SEED)
        out.append(parent)
    return out
