"""One node's share of the KVCache pool: a DRAM segment (and maybe an SSD tier) it owns.

The owner alone allocates and evicts in its segment; writers and readers move the bytes with
one-sided Messenger transfers into and out of it (``cluster/pool/service.py`` answers their
requests). An object's life:

* ``allocate`` (a range, evicting if needed), the writer writes, ``seal`` (the owner checks
  every part's checksum, then the object is readable and published): write-then-publish, so a
  reader never sees an object that is not complete. ``abort``, or a writer that never seals
  within ``put_timeout_s``, returns the range.
* ``lease`` grants a reader the object's location and checksums for ``lease_ttl_s``; a leased
  object is never evicted or moved, so the range holds the same bytes while the lease lives.
  A reader that overran its lease may read bytes of a later object: its checksum check fails
  and the read is a miss, never another object's KV.
* Eviction is LRU over sealed, unleased objects, when an allocation would take DRAM use past
  ``high_watermark``. With an SSD tier the victim moves down to it (a demotion) and stays
  published; a lease on it brings it back up (a promotion). Without one, or when the SSD tier
  evicts it in turn, it is gone and unpublished.

Invariant (``check``): every DRAM object owns one allocated range and every allocated range
belongs to one object, sealed or pending.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cluster.pool.objects import part_checksums
from cluster.pool.ssd import SsdTier
from cluster.messenger.staging import StagingArea, StagingFull, StagingRange
from cluster.messenger import RegionHandle, Messenger

log = logging.getLogger(__name__)


class PoolFull(RuntimeError):
    """No room for the object even after evicting everything evictable."""


@dataclass(frozen=True)
class Grant:
    """A reader's right to read ``key`` at ``offset`` until its lease ends."""

    key: str
    offset: int
    nbytes: int
    part_bytes: int
    checksums: list[int]
    lease: int


@dataclass
class _Object:
    nbytes: int
    part_bytes: int
    range: StagingRange | None  # None while it sits on the SSD tier
    checksums: list[int] = field(default_factory=list)
    sealed: bool = False
    deadline: float = 0.0  # an unsealed put is abandoned after this
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> expiry
    reads: deque = field(default_factory=deque)  # times of recent leases (hot-spot detection)


@dataclass(frozen=True)
class SegmentConfig:
    dram_bytes: int
    high_watermark: float = 0.9  # Mooncake Store's default eviction trigger
    lease_ttl_s: float = 10.0  # Mooncake Store's default_kv_lease_ttl
    put_timeout_s: float = 30.0
    hot_window_s: float = 10.0
    # Puts being written may hold at most this share of DRAM: a writer allocates before its
    # prefill and seals after it (seconds), and a segment filled with unsealed objects could
    # neither evict nor promote anything for its readers meanwhile.
    max_pending_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ValueError(f"dram_bytes must be positive, got {self.dram_bytes}")
        if not 0 < self.high_watermark <= 1:
            raise ValueError(f"high_watermark must be in (0, 1], got {self.high_watermark}")
        if not 0 < self.max_pending_fraction <= 1:
            raise ValueError(f"max_pending_fraction must be in (0, 1], got {self.max_pending_fraction}")
        for name in ("lease_ttl_s", "put_timeout_s", "hot_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


class Segment:
    """Thread-safe: the Messenger serves each peer on its own thread."""

    def __init__(self, transfer: Messenger, config: SegmentConfig, ssd: SsdTier | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.area = StagingArea(transfer, config.dram_bytes)
        # Commit the contributed memory now, as Mooncake's segments are: otherwise every first
        # write into a page faults it in, and a put of a fresh megabyte costs three times as much.
        self.area.buffer.fill_(0)
        self.ssd = ssd
        self._clock = clock
        self._lock = threading.Lock()
        self._objects: OrderedDict[str, _Object] = OrderedDict()  # least recently used first
        # Puts allocated but not sealed: every allocation looks for abandoned ones, and a scan of
        # every object there would make puts slower the fuller the segment.
        self._pending: dict[str, _Object] = {}
        self._lease_ids = itertools.count(1)
        self.counters = dict.fromkeys(("stores", "leases", "evictions", "demotions", "promotions",
                                       "corrupt_puts", "aborted_puts"), 0)
        # Publications leave in the order the lock decided them, so an eviction's unpublish can
        # never overtake the publish of the same object.
        self._outbox: queue.SimpleQueue[tuple[str, bool] | None] = queue.SimpleQueue()
        self._publish: Callable[[str, bool], None] | None = None

    def start_publishing(self, publish: Callable[[str, bool], None]) -> None:
        """Send every object's arrival and final departure to ``publish(key, present)``, in order."""
        self._publish = publish
        threading.Thread(target=self._publish_loop, name="pool publisher", daemon=True).start()

    @property
    def handle(self) -> RegionHandle:
        return self.area.handle

    # -- writing ------------------------------------------------------------------------------------
    def allocate(self, key: str, nbytes: int, part_bytes: int) -> int | None:
        """A DRAM range for a new object; None when ``key`` is already stored or being stored
        (objects are immutable: equal keys mean equal prefixes). Raises ``PoolFull``."""
        if nbytes <= 0 or part_bytes <= 0 or nbytes % part_bytes:
            raise ValueError(f"object of {nbytes} bytes in parts of {part_bytes}")
        with self._lock:
            now = self._clock()
            self._reclaim_abandoned(now)
            if key in self._objects:
                return None
            pending = sum(o.nbytes for o in self._pending.values())
            if pending and pending + nbytes > self.config.max_pending_fraction * self.config.dram_bytes:
                raise PoolFull(f"segment busy: {pending} bytes of puts being written already")
            r = self._make_room(nbytes, now)
            obj = self._objects[key] = _Object(nbytes, part_bytes, r, deadline=now + self.config.put_timeout_s)
            self._pending[key] = obj
            return r.offset

    def seal(self, key: str, checksums: list[int]) -> bool:
        """Publish a written object once its bytes match ``checksums``; False (and the range
        freed) when they do not, or when the put was abandoned meanwhile."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is None or obj.sealed or obj.range is None:
                return False
            view = memoryview(self.area.buffer[obj.range.offset : obj.range.offset + obj.nbytes].numpy())
            if part_checksums(view, obj.part_bytes) != list(checksums):
                self._drop(key, obj, publish=False)
                self.counters["corrupt_puts"] += 1
                return False
            obj.sealed = True
            del self._pending[key]
            obj.checksums = list(checksums)
            self._objects.move_to_end(key)
            self.counters["stores"] += 1
            self._outbox.put((key, True))
            return True

    def abort(self, key: str) -> None:
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None and not obj.sealed:
                self._drop(key, obj, publish=False)
                self.counters["aborted_puts"] += 1

    # -- reading ------------------------------------------------------------------------------------
    def lease(self, keys: list[str], ttl_s: float | None = None) -> list[Grant | None]:
        """Leases on the objects present (promoted from SSD if needed), None for the others."""
        grants: list[Grant | None] = []
        with self._lock:
            now = self._clock()
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or not obj.sealed:
                    grants.append(None)
                    continue
                if obj.range is None and not self._promote(key, obj, now):
                    grants.append(None)
                    continue
                lease = next(self._lease_ids)
                obj.leases[lease] = now + (ttl_s or self.config.lease_ttl_s)
                obj.reads.append(now)
                self.counters["leases"] += 1
                grants.append(Grant(key, obj.range.offset, obj.nbytes, obj.part_bytes, obj.checksums, lease))
            self._refresh([g.key for g in grants if g is not None])
        return grants

    def touch(self, keys: list[str]) -> None:
        """Mark the objects of a prefix (in order) used now: a prefix a reader found elsewhere
        (its own cache) is as recently used as one it loaded."""
        with self._lock:
            self._refresh([k for k in keys if k in self._objects and self._objects[k].sealed])

    def _refresh(self, keys: list[str]) -> None:
        # A prefix comes in order; its head becomes the most recent, so LRU evicts a chain from
        # its end: an evicted head would strand the rest of the chain unreachable.
        for key in reversed(keys):
            self._objects.move_to_end(key)

    def release(self, key: str, lease: int) -> None:
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None:
                obj.leases.pop(lease, None)

    def hot_keys(self, min_reads: int) -> list[str]:
        """Sealed objects leased at least ``min_reads`` times in the last ``hot_window_s``."""
        with self._lock:
            cutoff = self._clock() - self.config.hot_window_s
            hot = []
            for key, obj in self._objects.items():
                while obj.reads and obj.reads[0] < cutoff:
                    obj.reads.popleft()
                if obj.sealed and len(obj.reads) >= min_reads:
                    hot.append(key)
            return hot

    def cool(self, key: str) -> None:
        """Forget ``key``'s recent reads (it just got another replica to share them)."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None:
                obj.reads.clear()

    def keys(self) -> list[str]:
        """The sealed objects held, in DRAM or on SSD."""
        with self._lock:
            return [k for k, o in self._objects.items() if o.sealed]

    # -- state --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            dram = sum(1 for o in self._objects.values() if o.sealed and o.range is not None)
            on_ssd = sum(1 for o in self._objects.values() if o.range is None)
            stored = sum(o.nbytes for o in self._objects.values() if o.sealed)
            leased = sum(1 for o in self._objects.values() if o.leases)
            pending = len(self._pending)
        return {
            "objects": dram + on_ssd, "objects_dram": dram, "objects_ssd": on_ssd, "bytes": stored,
            "leased_objects": leased, "pending_puts": pending,
            "dram_bytes": self.config.dram_bytes, "dram_free_bytes": self.area.num_free_bytes,
            "ssd_bytes": self.ssd.capacity_bytes if self.ssd else 0,
            "ssd_free_bytes": self.ssd.capacity_bytes - self.ssd.used_bytes if self.ssd else 0,
            **self.counters,
        }

    def check(self) -> None:
        with self._lock:
            ranges = sorted(o.range.offset for o in self._objects.values() if o.range is not None)
            if len(ranges) != self.area.num_allocated or len(set(ranges)) != len(ranges):
                raise AssertionError(f"segment: {len(ranges)} object ranges, {self.area.num_allocated} allocated")
            unsealed = {k for k, o in self._objects.items() if not o.sealed}
            if unsealed != set(self._pending):
                raise AssertionError(f"segment: unsealed {sorted(unsealed)}, pending {sorted(self._pending)}")
            for key, o in self._objects.items():
                if o.range is None and (self.ssd is None or key not in self.ssd):
                    raise AssertionError(f"segment: {key} is neither in DRAM nor on SSD")
        self.area.check()

    def close(self) -> None:
        self._outbox.put(None)

    # -- internals (lock held) ----------------------------------------------------------------------
    def _make_room(self, nbytes: int, now: float) -> StagingRange:
        limit = self.config.high_watermark * self.config.dram_bytes
        while True:
            used = self.config.dram_bytes - self.area.num_free_bytes
            if used + nbytes <= limit or used == 0:
                try:
                    return self.area.allocate(nbytes)
                except StagingFull:
                    pass  # fragmented: evict more
                except ValueError as exc:
                    raise PoolFull(str(exc)) from None
            if not self._evict_one(now):
                raise PoolFull(f"segment full: {nbytes} bytes wanted, {self.area.num_free_bytes} free, "
                               f"nothing evictable (leased or being written)")

    def _evict_one(self, now: float) -> bool:
        for key, obj in self._objects.items():  # least recently used first
            if obj.sealed and obj.range is not None and not self._leased(obj, now):
                self._demote_or_drop(key, obj)
                return True
        return False

    def _leased(self, obj: _Object, now: float) -> bool:
        for lease, expiry in list(obj.leases.items()):
            if expiry <= now:
                del obj.leases[lease]
        return bool(obj.leases)

    def _demote_or_drop(self, key: str, obj: _Object) -> None:
        if self.ssd is not None and obj.nbytes <= self.ssd.capacity_bytes:
            view = memoryview(self.area.buffer[obj.range.offset : obj.range.offset + obj.nbytes].numpy())
            for gone in self.ssd.put(key, view):
                self._objects.pop(gone, None)
                self.counters["evictions"] += 1
                self._outbox.put((gone, False))
            self.area.release(obj.range)
            obj.range = None
            self.counters["demotions"] += 1
            return
        self._drop(key, obj, publish=True)
        self.counters["evictions"] += 1

    def _promote(self, key: str, obj: _Object, now: float) -> bool:
        assert self.ssd is not None
        # Read it out first: making room below may push other objects down and evict this one.
        data = bytearray(obj.nbytes)
        try:
            self.ssd.read_into(key, memoryview(data))
        except OSError as exc:
            log.warning("pool: SSD object %s unreadable (%s); dropped", key, exc)
            self._drop(key, obj, publish=True)
            return False
        self.ssd.delete(key)
        self._objects.pop(key)  # not a candidate while room is made for it
        try:
            r = self._make_room(obj.nbytes, now)
        except PoolFull:
            self._outbox.put((key, False))
            self.counters["evictions"] += 1
            return False
        self.area.buffer[r.offset : r.offset + obj.nbytes].copy_(torch.frombuffer(data, dtype=torch.uint8))
        obj.range = r
        self._objects[key] = obj
        self.counters["promotions"] += 1
        return True

    def _drop(self, key: str, obj: _Object, publish: bool) -> None:
        if obj.range is not None:
            self.area.release(obj.range)
        elif self.ssd is not None:
            self.ssd.delete(key)
        self._objects.pop(key, None)
        self._pending.pop(key, None)
        if publish and obj.sealed:
            self._outbox.put((key, False))

    def _reclaim_abandoned(self, now: float) -> None:
        for key, obj in list(self._pending.items()):
            if obj.deadline <= now:
                self._drop(key, obj, publish=False)
                self.counters["aborted_puts"] += 1

    def _publish_loop(self) -> None:
        while (event := self._outbox.get()) is not None:
            try:
                self._publish(*event)
            except Exception:  # the index heals: a reader's lease on a missing object is a miss
                log.exception("pool: could not publish %s", event)
