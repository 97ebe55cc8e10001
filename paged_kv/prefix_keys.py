"""Hash-chained prefix keys of full KV blocks.

The key of block i commits to every token before it: ``key_i = H(key_{i-1} || tokens of block i)``.
Two sequences share block i's key exactly when their first ``(i + 1) * block_size`` tokens are
equal, so a key identifies a reusable prefix, not just a chunk of tokens. The Mooncake traces
use the same construction with 512-token blocks (their ``hash_ids``).

A *cache salt* (``salt_root``) gives a chain a parent of its own: two requests under different
salts never share a key, so one never learns from a hit that the other sent the same prefix
(``--cache-scope per-key`` salts every user's requests with that user's identity).

Keys are 16-byte BLAKE2b digests: stable across processes and machines (Python's ``hash`` of a
tuple is not guaranteed to be), which matters once keys travel to the Conductor and the KV pool.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

PrefixKey = bytes

_DIGEST_SIZE = 16


def block_key(parent: PrefixKey | None, token_ids: Sequence[int]) -> PrefixKey:
    """Key of one full block given the key of the block before it (None for the first block)."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(parent if parent is not None else b"\x00" * _DIGEST_SIZE)
    # int64 encoding: token ids are non-negative and far below 2**63.
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_keys(
    token_ids: Sequence[int], block_size: int, parent: PrefixKey | None = None
) -> list[PrefixKey]:
    """Keys of every *full* block of ``token_ids``; a trailing partial block gets no key."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[PrefixKey] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


def salt_root(salt: str | None) -> PrefixKey | None:
    """The parent of the first block of a chain under ``salt`` (None: no salt, the shared chain)."""
    if salt is None:
        return None
    # A label no token encoding can produce keeps a salted root from equalling any block's key.
    return hashlib.blake2b(b"cache-salt\x00" + salt.encode(), digest_size=_DIGEST_SIZE).digest()


def reusable_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[PrefixKey]:
    """Keys of the full blocks of ``token_ids`` a prefix cache can serve: those before its last
    token, which is always computed (its logits give the first output token)."""
    return chain_keys(token_ids[: (len(token_ids) - 1) // block_size * block_size], block_size, salt_root(salt))
