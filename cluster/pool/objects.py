"""What the KVCache pool stores: one object per pool block of a prompt's prefix.

A pool block is ``blocks_per_object`` consecutive engine blocks (the paper used 256- and
512-token blocks). Its object is named by the namespace and the prefix-chain key of its *last*
engine block, which depends on every token before it, so equal keys mean equal prefixes. The
namespace hashes the model's identity and the KV page geometry (layers, heads, block size, head
dim, dtype) with the object size: two models, or one model at two dtypes, never share a key.

Inside, an object is the ``KVLayout.shape(blocks_per_object)`` tensor, layer-major, so layer
``l`` is one contiguous range (``part``) that can be loaded, and checksummed, on its own.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

import xxhash

from engine.kv_layout import KVLayout
from paged_kv.prefix_keys import chain_keys, salt_root


@dataclass(frozen=True)
class PoolGeometry:
    layout: KVLayout
    blocks_per_object: int
    model_id: str

    def __post_init__(self) -> None:
        if self.blocks_per_object <= 0:
            raise ValueError(f"blocks_per_object must be positive, got {self.blocks_per_object}")
        if not self.model_id:
            raise ValueError("model_id must not be empty")

    @property
    def namespace(self) -> str:
        ident = json.dumps([self.model_id, self.layout.to_dict(), self.blocks_per_object], sort_keys=True)
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    @property
    def tokens_per_object(self) -> int:
        return self.blocks_per_object * self.layout.block_size

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes(self.blocks_per_object)

    @property
    def part_bytes(self) -> int:
        """One layer of one object."""
        return self.layout.layer_bytes(self.blocks_per_object)

    @property
    def num_parts(self) -> int:
        return self.layout.num_layers

    def object_keys(self, token_ids: Sequence[int], limit_tokens: int | None = None,
                    salt: str | None = None) -> list[str]:
        """Keys of the full pool blocks of ``token_ids[:limit_tokens]`` (cached under ``salt``),
        in prefix order."""
        n = len(token_ids) if limit_tokens is None else min(limit_tokens, len(token_ids))
        count = n // self.tokens_per_object
        keys = chain_keys(token_ids[: count * self.tokens_per_object], self.layout.block_size, salt_root(salt))
        return object_keys(self.namespace, keys, self.blocks_per_object)


def object_keys(namespace: str, block_keys: Sequence[bytes], blocks_per_object: int) -> list[str]:
    """The pool keys of the full pool blocks covered by a prompt's engine-block chain keys
    (what the Conductor, which knows only the chain keys, looks up)."""
    count = len(block_keys) // blocks_per_object
    return [f"{namespace}/{block_keys[(i + 1) * blocks_per_object - 1].hex()}" for i in range(count)]


def part_checksums(data: memoryview, part_bytes: int) -> list[int]:
    """xxh3 of each ``part_bytes`` range of ``data`` (a reader verifies each layer it loads)."""
    if part_bytes <= 0 or len(data) % part_bytes:
        raise ValueError(f"{len(data)} bytes do not split into parts of {part_bytes}")
    return [xxhash.xxh3_64_intdigest(data[i : i + part_bytes]) for i in range(0, len(data), part_bytes)]
