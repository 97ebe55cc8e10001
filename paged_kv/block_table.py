"""One sequence's block table and the allocation policy that fills it from the pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from paged_kv.block_pool import BlockPool, Retention
from paged_kv.prefix_keys import PrefixKey, block_key, chain_keys


@dataclass
class BlockTable:
    """Logical block i of a sequence lives in physical block ``block_ids[i]``.

    ``keys[i]`` is the prefix key of block i once that block is full and its KV computed
    (``len(keys) <= len(block_ids)``); the chain continues from ``keys[-1]``, and starts from
    ``root`` (``prefix_keys.salt_root``: None unless the request's cache is salted).
    """

    block_ids: list[int] = field(default_factory=list)
    keys: list[PrefixKey] = field(default_factory=list)
    root: PrefixKey | None = None

    def slot(self, position: int, block_size: int) -> int:
        """Flat index into the paged cache of the token at ``position``."""
        return self.block_ids[position // block_size] * block_size + position % block_size


class BlockManager:
    """Allocates, shares and frees blocks for block tables (prefix caching included).

    Invariants: a table holds exactly ``ceil(tokens it has allocated for / block_size)``
    blocks; a block is published under a prefix key only after every token in it has its KV
    written (``commit``), so a hit never reads KV that is still being computed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 retained_share: float = 0.5):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = BlockPool(num_blocks, retained_share)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """Extra blocks ``table`` needs to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(table.block_ids))

    def match_prefix(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Attach the longest cached prefix of ``token_ids`` to an empty table.

        Returns the number of tokens whose KV is already there. At most ``len - 1`` tokens
        hit, so the last prompt token is always computed: its logits give the first output.
        """
        if table.block_ids:
            raise RuntimeError("match_prefix on a table that already holds blocks")
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        keys = chain_keys(token_ids[: max_blocks * self.block_size], self.block_size, table.root)
        hits = self.pool.lookup(keys)
        self.pool.acquire(hits)
        table.block_ids.extend(hits)
        table.keys.extend(keys[: len(hits)])
        return len(hits) * self.block_size

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_needed(table, num_tokens) <= self.pool.num_free

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Allocate blocks so ``table`` can hold ``num_tokens`` tokens (raises OutOfBlocks)."""
        table.block_ids.extend(self.pool.allocate(self.blocks_needed(table, num_tokens)))

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish every block that is full of computed KV and not yet keyed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.keys), num_computed // bs):
            parent = table.keys[-1] if table.keys else table.root
            key = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            table.keys.append(key)
            self.pool.register(table.block_ids[i], key)

    def free(self, table: BlockTable, retain: Retention | None = None) -> None:
        """Return every block of ``table`` to the pool and empty it; its cached blocks are kept
        ahead of cold ones under ``retain`` (a session's, ``BlockPool``)."""
        self.pool.release(table.block_ids, retain)
        table.block_ids.clear()
        table.keys.clear()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
