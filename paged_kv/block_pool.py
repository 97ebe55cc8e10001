"""The pool of fixed-size KV blocks: reference counts, free list, prefix-cache index, LRU eviction.

Every block is in exactly one of three states, and ``check_integrity`` verifies it:

* **in use**     -- ``ref_count > 0``: some running sequence's block table holds it.
* **cached**     -- ``ref_count == 0`` and it holds a prefix key: its KV is still valid and a
  future request with the same prefix may take it back (a prefix-cache hit). Cached blocks are
  kept in LRU order and are evicted (their key dropped) only when no free block is left.
* **free**       -- ``ref_count == 0`` and no key: contents are garbage.

so that ``free + cached + in use == total`` at all times.

Soft retention: a session's blocks may be released with a ``Retention`` (keep until
a deadline, at a priority). Retained blocks are cached blocks still: a hit takes them back and an
allocation may evict them, so retention never refuses an allocation. It only orders eviction:
cold (unretained) blocks go first, LRU; then retained blocks whose deadline passed; then live
retained ones, lowest priority and nearest deadline first. Retained blocks never exceed
``retained_share`` of the pool: one over it demotes the lowest-ranked retained block to cold.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Iterable, Sequence

from paged_kv.prefix_keys import PrefixKey


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free or evictable."""


_JOURNAL_LEN = 1 << 16


@dataclass(frozen=True)
class Retention:
    """Keep released blocks cached, ahead of cold ones, until ``until`` (the pool's clock) at
    ``priority`` (higher is evicted later). A bias, never a pin."""

    until: float
    priority: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, retained_share: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if not 0 <= retained_share <= 1:
            raise ValueError(f"retained_share must be in [0, 1], got {retained_share}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.keys: list[PrefixKey | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        # Retained cached blocks: block -> (priority, until, order released); evictable too.
        self._retained: dict[int, tuple[int, float, int]] = {}
        self.max_retained = int(retained_share * num_blocks)
        self._clock = clock
        self._released = itertools.count()
        self.num_retained_evictions = 0  # retained blocks evicted before their deadline
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
        return len(self._free) + len(self._evictable) + len(self._retained)

    @property
    def num_cached_unused(self) -> int:
        return len(self._evictable) + len(self._retained)

    @property
    def num_retained(self) -> int:
        """Cached blocks held under a ``Retention`` (expired ones included until evicted)."""
        return len(self._retained)

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
        victims = self._retained_victims(n - len(self._free) - len(self._evictable))
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block = self._evictable.popitem(last=False)[0] if self._evictable else next(victims)
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

    def _retained_victims(self, n: int) -> Iterable[int]:
        """The ``n`` retained blocks to evict, in order: expired ones first, then by rank."""
        if n <= 0:
            return iter(())
        now = self._clock()
        ranked = sorted(self._retained, key=lambda b: (self._retained[b][1] > now, *self._retained[b]))[:n]
        for block in ranked:
            if self._retained.pop(block)[1] > now:
                self.num_retained_evictions += 1
        return iter(ranked)

    def acquire(self, blocks: Iterable[int]) -> None:
        """Take one more reference on blocks found by ``lookup`` (a prefix-cache hit)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                if self._retained.pop(block, None) is None:
                    del self._evictable[block]
            self.ref_counts[block] += 1

    def release(self, blocks: Sequence[int], retain: Retention | None = None) -> None:
        """Drop one reference from each block; blocks reaching zero become cached or free.

        Blocks are released tail first, so that under LRU eviction a sequence's last blocks
        (the ones least likely to be shared) go before its first ones; under ``retain`` too.
        """
        for block in reversed(blocks):
            rc = self.ref_counts[block]
            if rc <= 0:
                raise RuntimeError(f"double free of KV block {block}")
            self.ref_counts[block] = rc - 1
            if rc == 1:
                if self.keys[block] is None:
                    self._free.append(block)
                elif retain is not None:
                    self._retained[block] = (retain.priority, retain.until, next(self._released))
                else:
                    self._evictable[block] = None
        if len(self._retained) > self.max_retained:
            # Over the share: the lowest-ranked retained blocks turn cold (the newest end of
            # the LRU: released under a hint, they are no colder than the cold ones).
            excess = len(self._retained) - self.max_retained
            for block in sorted(self._retained, key=self._retained.__getitem__)[:excess]:
                del self._retained[block]
                self._evictable[block] = None

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
        for block in [*self._evictable, *self._retained]:
            self.keys[block] = None
            self._free.append(block)
        self._evictable.clear()
        self._retained.clear()
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
        total = len(self._free) + self.num_cached_unused + in_use
        if total != self.num_blocks:
            raise AssertionError(
                f"KV block accounting broken: free {len(self._free)} + cached "
                f"{self.num_cached_unused} + in use {in_use} != total {self.num_blocks}"
            )
        if len(self._retained) > self.max_retained or set(self._retained) & set(self._evictable):
            raise AssertionError(f"{len(self._retained)} retained KV blocks (at most {self.max_retained}), "
                                 "or a block both retained and cold")
        if len(set(self._free)) != len(self._free):
            raise AssertionError("a KV block is on the free list twice")
        for block in self._free:
            if self.ref_counts[block] != 0 or self.keys[block] is not None:
                raise AssertionError(f"free KV block {block} is referenced or keyed")
        for block in [*self._evictable, *self._retained]:
            if self.ref_counts[block] != 0 or self.keys[block] is None:
                raise AssertionError(f"cached KV block {block} is referenced or unkeyed")
        for key, block in self._index.items():
            if self.keys[block] != key:
                raise AssertionError(f"prefix index points at KV block {block} with another key")
