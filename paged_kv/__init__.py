"""Paged KV cache bookkeeping: blocks, block tables, hash-chained prefix keys."""

from paged_kv.block_pool import BlockPool, OutOfBlocks
from paged_kv.block_table import BlockManager, BlockTable
from paged_kv.prefix_keys import PrefixKey, block_key, chain_keys

__all__ = [
    "BlockManager",
    "BlockPool",
    "BlockTable",
    "OutOfBlocks",
    "PrefixKey",
    "block_key",
    "chain_keys",
]
