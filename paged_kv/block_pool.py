"""The pool of fixed-size KV blocks: reference counts, free list, prefix-cache index, LRU eviction.

Every block is in exactly one of three states, and ``check_integrity`` verifies it:

* **in use**     -- ``ref_count > 0``: some running sequence's block table holds it.
* **cached**     -- ``ref_count == 0`` and it holds a prefix key: its KV is still valid and a
  future request with the same prefix may take it back (a prefix-cache hit). Cached blocks are
  kept in LRU order and are evicted (their key dropped) only when no free block is left.
* **free**       -- ``ref_count == 0`` and no key: contents are garbage.

so that ``free + cached + in use == total`` at all times.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Sequence

from paged_kv.prefix_keys import PrefixKey


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free or evictable."""


_JOURNAL_LEN = 1 << 16


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.keys: list[PrefixKey | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._index: dict[PrefixKey, int] = {}
        self.num_evictions = 0
        # Bumped whenever the set of cached keys changes, so a reporter can skip unchanged sets.
        self.version = 0
        # (version after the change, key, added?) for the latest changes: a reporter that saw
        # version v sends only what changed since, not the whole set (``changes_since``).
        self._journal: deque[tuple[int, PrefixKey, bool]] = deque(maxlen=_JOURNAL_LEN)
        self._journal_floor = 0  # changes before this version are not in the journal

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take right now (free ones plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_unused(self) -> int:
        return len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        """Fraction of blocks held by running sequences (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_in_use / self.num_blocks

    def lookup(self, keys: Sequence[PrefixKey]) -> list[int]:
        """Blocks of the longest prefix of ``keys`` present in the cache (no reference taken)."""
        hits: list[int] = []
        for key in keys:
            block = self._index.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_keys(self) -> list[PrefixKey]:
        """Every prefix key whose KV this pool holds (for reporting cache contents upstream)."""
        return list(self._index)

    def changes_since(self, version: int) -> tuple[list[PrefixKey], list[PrefixKey]] | None:
        """Keys added to and removed from the cache after ``version``, in that order of
        application (removed after added), or None when the journal no longer reaches back that
        far (or ``version`` is not one of ours): the caller then takes ``cached_keys``."""
        if version == self.version:
            return [], []
        if not self._journal_floor <= version < self.version:
            return None
        if self._journal and self._journal[0][0] > version + 1:
            return None  # the oldest changes after ``version`` fell off the journal
        net: dict[PrefixKey, bool] = {}
        for v, key, added in self._journal:
            if v > version:
                net[key] = added  # the last change of a key wins
        return [k for k, a in net.items() if a], [k for k, a in net.items() if not a]

    def _changed(self, key: PrefixKey, added: bool) -> None:
        self.version += 1
        self._journal.append((self.version, key, added))

    # -- state changes --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks with ``ref_count == 1``, evicting LRU cached blocks only if needed."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} KV blocks, only {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                key = self.keys[block]
                self.keys[block] = None
                # The index may point at another block with the same key; only drop our entry.
                if self._index.get(key) == block:
                    del self._index[key]
                    self._changed(key, added=False)
                self.num_evictions += 1
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def acquire(self, blocks: Iterable[int]) -> None:
        """Take one more reference on blocks found by ``lookup`` (a prefix-cache hit)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become cached or free.

        Blocks are released tail first, so that under LRU eviction a sequence's last blocks
        (the ones least likely to be shared) go before its first ones.
        """
        for block in reversed(blocks):
            rc = self.ref_counts[block]
            if rc <= 0:
                raise RuntimeError(f"double free of KV block {block}")
            self.ref_counts[block] = rc - 1
            if rc == 1:
                if self.keys[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def register(self, block: int, key: PrefixKey) -> None:
        """Publish a block whose KV is complete under ``key`` so later requests can reuse it."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"register of unreferenced KV block {block}")
        if self.keys[block] is not None:
            return
        self.keys[block] = key
        # A duplicate of an existing key keeps the older entry; this block still carries the key
        # so it stays a valid (if unreachable) cached copy until evicted.
        if self._index.setdefault(key, block) == block:
            self._changed(key, added=True)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (unused cached blocks become free)."""
        for block in list(self._evictable):
            self.keys[block] = None
            self._free.append(block)
        self._evictable.clear()
        for block in range(self.num_blocks):
            self.keys[block] = None
        self._index.clear()
        self.version += 1
        self._journal.clear()
        self._journal_floor = self.version  # a reporter older than this takes the whole (empty) set

    # -- invariants -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert free + cached + in use == total and that the index agrees with block states."""
        in_use = sum(1 for rc in self.ref_counts if rc > 0)
        total = len(self._free) + len(self._evictable) + in_use
        if total != self.num_blocks:
            raise AssertionError(
                f"KV block accounting broken: free {len(self._free)} + cached "
                f"{len(self._evictable)} + in use {in_use} != total {self.num_blocks}"
            )
        if len(set(self._free)) != len(self._free):
            raise AssertionError("a KV block is on the free list twice")
        for block in self._free:
            if self.ref_counts[block] != 0 or self.keys[block] is not None:
                raise AssertionError(f"free KV block {block} is referenced or keyed")
        for block in self._evictable:
            if self.ref_counts[block] != 0 or self.keys[block] is None:
                raise AssertionError(f"cached KV block {block} is referenced or unkeyed")
        for key, block in self._index.items():
            if self.keys[block] != key:
                raise AssertionError(f"prefix index points at KV block {block} with another key")
