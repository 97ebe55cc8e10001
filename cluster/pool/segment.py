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
  ``high_watermark``. A session's objects (a touch with ``retain``) go after the cold
  ones until ``session_retention_s`` has passed since, lowest priority first; they never pin
  (when nothing else is evictable they go too) and hold at most ``retained_share`` of DRAM
  (beyond it the lowest-ranked turn cold). With an SSD tier the victim moves down to it (a demotion) and stays
  published; a lease on it brings it back up (a promotion). Without one, or when the SSD tier
  evicts it in turn, or its write to the SSD fails (a full disk), it is gone and unpublished.

The SSD's files are read and written outside the segment's lock, which every request and the
owner's statistics (an instance's ``/poll``) take: a slow disk slows only the requests that
need it. A demotion copies the victim's bytes out of DRAM under the lock (a memory copy) and
writes them to the SSD after it; until then a lease takes them back from that copy. A promotion
reads the file outside the lock, then, under it, makes room and copies the bytes into DRAM, and
only then forgets the SSD copy: a promotion that finds no room leaves the object on the SSD.

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

from cluster.failpoints import FAILPOINTS
from cluster.messenger import Messenger, RegionHandle
from cluster.messenger.staging import StagingArea, StagingFull, StagingRange
from cluster.pool.messages import Grant
from cluster.pool.objects import part_checksums
from cluster.pool.ssd import SsdTier

log = logging.getLogger(__name__)


class PoolFull(RuntimeError):
    """No room for the object even after evicting everything evictable."""


@dataclass
class _Object:
    nbytes: int
    part_bytes: int
    range: StagingRange | None  # None while it sits on the SSD tier
    spill: bytes | None = None  # a demoted object's bytes while they are being written to the SSD
    checksums: list[int] = field(default_factory=list)
    sealed: bool = False
    deadline: float = 0.0  # an unsealed put is abandoned after this
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> expiry
    reads: deque = field(default_factory=deque)  # times of recent leases (hot-spot detection)
    retain: tuple[int, float, int] | None = None  # a session's: (priority, until, order), ranks eviction


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
    # Soft retention of sessions' objects in DRAM (the SSD tier stays LRU): how long after a
    # session's touch, and at most which share of DRAM (``engine.config.EngineConfig``'s twins).
    session_retention_s: float = 600.0
    retained_share: float = 0.5

    def __post_init__(self) -> None:
        if not self.session_retention_s >= 0 or not 0 <= self.retained_share <= 1:
            raise ValueError("session_retention_s must be >= 0 and retained_share in [0, 1]")
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
        self._retain_order = itertools.count()
        self.counters = dict.fromkeys(("stores", "leases", "evictions", "demotions", "promotions",
                                       "corrupt_puts", "corrupt_ssd_reads", "aborted_puts", "ssd_errors",
                                       "retained_evictions"), 0)
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
        spills: list[tuple[str, _Object, bytes]] = []
        try:
            with self._lock:
                now = self._clock()
                self._reclaim_abandoned(now)
                if key in self._objects:
                    return None
                pending = sum(o.nbytes for o in self._pending.values())
                if pending and pending + nbytes > self.config.max_pending_fraction * self.config.dram_bytes:
                    raise PoolFull(f"segment busy: {pending} bytes of puts being written already")
                r = self._make_room(nbytes, now, spills)
                obj = self._objects[key] = _Object(nbytes, part_bytes, r, deadline=now + self.config.put_timeout_s)
                self._pending[key] = obj
                return r.offset
        finally:
            self._spill(spills)

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
            if FAILPOINTS.fire("pool.flip_bit"):
                self.area.buffer[obj.range.offset] ^= 1  # bit rot in DRAM, after the writer's checksums
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
        read = self._read_from_ssd(keys)
        spills: list[tuple[str, _Object, bytes]] = []
        try:
            with self._lock:
                now = self._clock()
                for key in keys:
                    obj = self._objects.get(key)
                    if obj is not None and obj.sealed and not self._leased(obj, now) \
                            and FAILPOINTS.fire("pool.evict_on_lease"):
                        self._drop(key, obj, publish=True)  # evicted after the reader's lookup found it
                        self.counters["evictions"] += 1
                        obj = None
                    if obj is None or not obj.sealed:
                        grants.append(None)
                        continue
                    if obj.range is None and not self._promote(key, obj, read, now, spills):
                        grants.append(None)
                        continue
                    lease = next(self._lease_ids)
                    obj.leases[lease] = now + (ttl_s or self.config.lease_ttl_s)
                    obj.reads.append(now)
                    self.counters["leases"] += 1
                    grants.append(Grant(key, obj.range.offset, obj.nbytes, obj.part_bytes, obj.checksums, lease))
                self._refresh([g.key for g in grants if g is not None])
        finally:
            self._spill(spills)
        return grants

    def _read_from_ssd(self, keys: list[str]) -> dict[str, bytearray | None]:
        """The bytes of those ``keys`` on the SSD tier, read and checked without the lock (None:
        unreadable, or not what was written)."""
        with self._lock:
            wanted = [(key, o.nbytes, o.part_bytes, o.checksums) for key in keys
                      if (o := self._objects.get(key)) is not None and o.sealed and o.range is None
                      and o.spill is None]
        read: dict[str, bytearray | None] = {}
        for key, nbytes, part_bytes, checksums in wanted:
            data = bytearray(nbytes)
            try:
                self.ssd.read_into(key, memoryview(data))
                read[key] = data
            except OSError as exc:
                log.warning("pool: SSD object %s unreadable (%s); dropped", key, exc)
                read[key] = None
                continue
            # A disk can return other bytes than were written (bit rot, a file changed under us):
            # such a copy never reaches DRAM, where readers would take it for the object.
            if part_checksums(memoryview(data), part_bytes) != checksums:
                log.warning("pool: SSD object %s does not match its checksums; dropped", key)
                read[key] = None
                with self._lock:
                    self.counters["corrupt_ssd_reads"] += 1
        return read

    def touch(self, keys: list[str], retain: int | None = None, promote: bool = False) -> int:
        """Mark the objects of a prefix (in order) used now: a prefix a reader found elsewhere
        (its own cache) is as recently used as one it loaded. ``retain``: they are a session's,
        kept ahead of cold objects at this priority for ``session_retention_s``. ``promote``:
        those on the SSD tier come up to DRAM now, as a read would bring them (a session's
        pre-staging); returns how many did."""
        read = self._read_from_ssd(keys) if promote else {}
        spills: list[tuple[str, _Object, bytes]] = []
        try:
            return self._touch(keys, retain, read, spills)
        finally:
            self._spill(spills)

    def _touch(self, keys: list[str], retain: int | None, read: dict[str, bytearray | None], spills: list) -> int:
        with self._lock:
            now = self._clock()
            promoted = sum(self._promote(k, o, read, now, spills) for k in read
                           if (o := self._objects.get(k)) is not None and o.sealed and o.range is None)
            held = [k for k in keys if k in self._objects and self._objects[k].sealed]
            self._refresh(held)
            if retain is not None and self.config.session_retention_s:
                until = now + self.config.session_retention_s
                for key in reversed(held):  # tail first: of one chain, the tail goes first
                    obj = self._objects[key]
                    if obj.range is not None:
                        obj.retain = (retain, until, next(self._retain_order))
                self._cap_retained()
            return promoted

    def _cap_retained(self) -> None:
        retained = sorted((o.retain, o) for o in self._objects.values() if o.retain is not None)
        over = sum(o.nbytes for _, o in retained) - self.config.retained_share * self.config.dram_bytes
        for _, obj in retained:
            if over <= 0:
                break
            obj.retain = None  # turns cold, at the recent end of the LRU where the touch put it
            over -= obj.nbytes

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
            now = self._clock()
            retained = sum(1 for o in self._objects.values() if o.retain is not None and o.retain[1] > now)
            pending = len(self._pending)
        return {
            "objects": dram + on_ssd, "objects_dram": dram, "objects_ssd": on_ssd, "bytes": stored,
            "leased_objects": leased, "retained_objects": retained, "pending_puts": pending,
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
                if o.range is None and o.spill is None and (self.ssd is None or key not in self.ssd):
                    raise AssertionError(f"segment: {key} is neither in DRAM nor on SSD")
        self.area.check()

    def close(self) -> None:
        self._outbox.put(None)
        if self.ssd is not None:
            self.ssd.sweep()

    # -- internals (lock held) ----------------------------------------------------------------------
    def _make_room(self, nbytes: int, now: float, spills: list) -> StagingRange:
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
            if not self._evict_one(now, spills):
                raise PoolFull(f"segment full: {nbytes} bytes wanted, {self.area.num_free_bytes} free, "
                               f"nothing evictable (leased or being written)")

    def _evict_one(self, now: float, spills: list) -> bool:
        retained = []
        for key, obj in self._objects.items():  # least recently used first
            if obj.sealed and obj.range is not None and not self._leased(obj, now):
                if obj.retain is not None and obj.retain[1] > now:
                    retained.append((obj.retain, key, obj))
                    continue
                self._demote_or_drop(key, obj, spills)
                return True
        if not retained:
            return False
        _, key, obj = min(retained)  # nothing cold is left: the lowest-ranked session object
        self.counters["retained_evictions"] += 1
        self._demote_or_drop(key, obj, spills)
        return True

    def _leased(self, obj: _Object, now: float) -> bool:
        for lease, expiry in list(obj.leases.items()):
            if expiry <= now:
                del obj.leases[lease]
        return bool(obj.leases)

    def _demote_or_drop(self, key: str, obj: _Object, spills: list) -> None:
        obj.retain = None  # retention ranks DRAM only: on the SSD tier it is LRU
        if self.ssd is not None and obj.nbytes <= self.ssd.capacity_bytes:
            # The bytes leave DRAM now (a memory copy); the SSD write comes after the lock (_spill).
            obj.spill = self.area.buffer[obj.range.offset : obj.range.offset + obj.nbytes].numpy().tobytes()
            self.area.release(obj.range)
            obj.range = None
            spills.append((key, obj, obj.spill))
            self.counters["demotions"] += 1
            return
        self._drop(key, obj, publish=True)
        self.counters["evictions"] += 1

    def _promote(self, key: str, obj: _Object, read: dict[str, bytearray | None], now: float, spills: list) -> bool:
        """Bring ``obj`` up from its SSD copy (or its bytes still on their way there) into DRAM;
        the SSD copy is forgotten only once the DRAM copy is in place."""
        assert self.ssd is not None
        data = obj.spill
        if data is None:
            if key not in read:
                return False  # demoted between the read and now: a miss this time
            data = read[key]
            if data is None:  # unreadable: gone
                self._drop(key, obj, publish=True)
                self.counters["evictions"] += 1
                return False
        del self._objects[key]  # not a candidate while room is made for it
        try:
            r = self._make_room(obj.nbytes, now, spills)
        except PoolFull:
            self._objects[key] = obj  # stays on the SSD, still published: a miss this time
            return False
        self.area.buffer[r.offset : r.offset + obj.nbytes].copy_(torch.frombuffer(data, dtype=torch.uint8))
        obj.range = r
        self._objects[key] = obj
        if obj.spill is not None:
            obj.spill = None  # its SSD write, when done, finds the object in DRAM and forgets the copy
        else:
            self.ssd.delete(key)
        self.counters["promotions"] += 1
        return True

    def _drop(self, key: str, obj: _Object, publish: bool) -> None:
        if obj.range is not None:
            self.area.release(obj.range)
        elif self.ssd is not None:
            self.ssd.delete(key)
        obj.spill = None
        self._objects.pop(key, None)
        self._pending.pop(key, None)
        if publish and obj.sealed:
            self._outbox.put((key, False))

    # -- the SSD writes of demotions (lock not held) -------------------------------------------------
    def _spill(self, spills: list[tuple[str, _Object, bytes]]) -> None:
        for key, obj, data in spills:
            try:
                evicted, stored = self.ssd.put(key, data), True
            except OSError as exc:  # a full disk (ENOSPC) or a failing one: the object is gone
                log.warning("pool: SSD write of %s failed (%s); object dropped", key, exc)
                evicted, stored = [], False
            with self._lock:
                if not stored:
                    self.counters["ssd_errors"] += 1
                for gone in evicted:
                    o = self._objects.get(gone)
                    if o is not None and o.range is None and o.spill is None:
                        self._drop(gone, o, publish=True)
                        self.counters["evictions"] += 1
                current = self._objects.get(key)
                if current is obj and obj.spill is data:
                    obj.spill = None
                    if not stored:
                        self._drop(key, obj, publish=True)
                        self.counters["evictions"] += 1
                elif stored and (current is None or current.range is not None):
                    self.ssd.delete(key)  # promoted or dropped meanwhile: the copy is of no use
        if self.ssd is not None:
            self.ssd.sweep()

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
