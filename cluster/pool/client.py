"""The pool as its users see it: find a prefix, read it into a registered buffer, store objects.

Every instance holds a ``PoolClient`` (a standalone pool node holds one to replicate hot
objects). It is a ``PoolIndex`` (``index.py``: which segments hold which objects, and where
each segment is, read from the metadata; the Conductor holds only that) that also moves the
bytes, which never pass through the metadata store. It speaks to the segments' owners in the
messages of ``messages.py``:

* ``get``: the longest run of consecutive keys present; for each object the least-loaded
  replica; one lease request per segment (``SegmentService``), then one-sided Messenger reads
  straight into the caller's buffer, then every part's checksum, then a release (not waited
  for). A replica that vanished, failed its read or its checksum ends the run there: the
  caller computes the rest.
* ``put`` / ``put_many``: write-then-publish on the segment with the most free DRAM (Mooncake
  Store's ``free_ratio_first``): allocate, write, seal (the owner checks the checksums and
  publishes), each one round trip for all the objects a segment takes.

A lease or an allocation is on a prompt's way to its first token, so a segment that does not
answer one within ``call_timeout_s`` (1 s: its node is frozen, or cut off) costs that prompt its
objects there, and is then passed over for ``suspect_s``: a frozen node costs about a second,
once, not a transfer timeout per prompt (``segments_passed_over`` counts the calls it missed).

A pipeline group's stages share this work (``cluster.cpp.stage``): the first stage leases a prefix
and reserves new objects; each stage reads and writes only its layers' parts, the later ones
under the first stage's leases and reservations (``PoolRead.leases``, ``read_leased``,
``PoolWrite.reservation``, ``write_reserved``), and the first stage seals with every stage's
checksums.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from cluster.failpoints import FAILPOINTS
from cluster.messenger import Batch, Messenger, RegionHandle, TransferError
from cluster.messenger.wire import Status
from cluster.pool.index import CLIENT_COUNTERS, PoolIndex, SegmentInfo
from cluster.pool.messages import (
    AbortRequest, AllocReply, AllocRequest, Grant, LeaseReply, LeaseRequest, NewObjectSize, PoolRequest,
    ReleaseRequest, SealReply, SealRequest, TouchReply, TouchRequest,
)
from cluster.metadata import MetadataStore
from cluster.protocol import BadRequest

log = logging.getLogger(__name__)

R = TypeVar("R", LeaseReply, AllocReply, SealReply)


def _ask(transfer: Messenger, segment: SegmentInfo, request: PoolRequest, reply: type[R] | None,
         timeout_s: float | None = None) -> R | None:
    """``request`` to ``segment``'s owner; its answer as ``reply`` (None for a request answered
    with nothing), or None when the owner refused it. Raises ``TransferError`` when the owner
    cannot be reached, does not answer within ``timeout_s``, or answers something else (the
    owner's fault)."""
    status, answer = transfer.call(segment.address, request.to_dict(), timeout_s=timeout_s)
    if status != Status.OK:
        log.debug("pool: segment %s refused %s: %s", segment.segment_id, request.OP, answer.get("reason", status))
        return None
    try:
        return None if reply is None else reply.from_dict(answer)
    except BadRequest as exc:
        raise TransferError(f"segment {segment.segment_id} answered {request.OP} wrongly: {exc}") from None


class PoolClient(PoolIndex):
    """Thread-safe; blocking calls (run them off the event loop)."""

    def __init__(self, transfer: Messenger | None, metadata: MetadataStore | None, *,
                 segments_ttl_s: float = 1.0, transfer_timeout_s: float = 30.0, call_timeout_s: float = 1.0,
                 suspect_s: float = 10.0) -> None:
        """``metadata`` None: a client that only reads and writes under another client's leases
        and reservations (a later pipeline stage's)."""
        super().__init__(metadata, segments_ttl_s=segments_ttl_s, read_handle=RegionHandle.from_dict)
        self._transfer = transfer
        self._timeout_s = transfer_timeout_s
        self._call_timeout_s = min(call_timeout_s, transfer_timeout_s)
        self._suspect_s = suspect_s
        self._suspect_until: dict[str, float] = {}  # segment -> when it is asked again
        self._reading: Counter[str] = Counter()  # objects being read per segment: the load we balance
        self._served: Counter[str] = Counter()  # objects read per segment, to break ties in turn
        # Bytes this client put per segment since the snapshot of the segments it placed them
        # by (``_placed_on``): the published free space lags (a heartbeat), and without this
        # every put of a burst would go to the same segment.
        self._placed: Counter[str] = Counter()
        self._placed_on: dict[str, SegmentInfo] | None = None
        self.counters = dict.fromkeys(CLIENT_COUNTERS, 0)

    def _answering(self, segments: dict[str, SegmentInfo]) -> dict[str, SegmentInfo]:
        """``segments`` less those that did not answer a call lately."""
        now = time.monotonic()
        with self._lock:
            passed = [s for s in segments if self._suspect_until.get(s, 0.0) > now]
            if passed:
                self.counters["segments_passed_over"] += len(passed)
        return {s: info for s, info in segments.items() if s not in passed} if passed else segments

    def _call_segment(self, segment: SegmentInfo, request: PoolRequest, reply: type[R] | None) -> R | None:
        """A lease, a touch or an allocation (``_ask``), bounded by ``call_timeout_s``; a segment
        that does not answer in time (or answers wrongly) is passed over for ``suspect_s``.
        Raises ``TransferError``."""
        try:
            return _ask(self._transfer, segment, request, reply, self._call_timeout_s)
        except TransferError:
            with self._lock:
                self._suspect_until[segment.segment_id] = time.monotonic() + self._suspect_s
                self.counters["segment_timeouts"] += 1
            raise

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to one of ``CLIENT_COUNTERS`` (for this client's user)."""
        with self._lock:
            self.counters[counter] += n

    # -- reading ------------------------------------------------------------------------------------
    def open_read(self, keys: Sequence[str], dst: RegionHandle, offsets: Sequence[int],
                  dst_memory: memoryview, layerwise: bool = True, parts: range | None = None,
                  run: list[list[str]] | None = None, object_size: tuple[int, int] | None = None) -> PoolRead:
        """Start reading the longest available run of ``keys`` into ``dst`` at ``offsets``
        (``dst_memory``: the same region as bytes, for the checksums), layer by layer: every
        part (layer) of every object is requested at once, in layer order, and
        ``PoolRead.wait_part(i)`` returns once part ``i`` of each object is in and verified.
        ``PoolRead.num_objects`` is the run that could be leased (0: nothing to read). Without
        ``layerwise``, every part travels in one transfer (fewer round trips; part 0 waits for all).
        ``parts``: only these parts of each object (a pipeline stage's layers), held contiguous
        at each offset; None: all. ``run``: what ``lookup(keys)`` answered, if the caller asked it
        already (a few more keys than offsets is fine: the run is cut to the offsets).
        ``object_size``: (bytes, bytes per part) of an object of the reader's geometry; a grant of
        another size is a miss, counted in ``foreign_objects`` (an object of another model or KV
        layout under a key that collides, or a segment that lies: read, its checksums would pass
        and its bytes fill the reader's blocks with KV of another shape)."""
        if self._transfer is None:
            raise RuntimeError("this pool client has no transfer engine")
        wanted = len(keys)
        run = (self.lookup(keys) if run is None else run)[: len(offsets)]
        keys = list(keys[: len(run)])
        segments = self._answering(self.segments())
        with self._lock:
            choice = [min((s for s in h if s in segments), key=lambda s: (self._reading[s], self._served[s]),
                          default=None) for h in run]
        cut = next((i for i, s in enumerate(choice) if s is None), len(choice))
        by_segment: dict[str, list[int]] = {}
        for i, s in enumerate(choice[:cut]):
            by_segment.setdefault(s, []).append(i)
        grants: dict[int, tuple[str, Grant]] = {}
        foreign: dict[int, tuple[str, Grant]] = {}
        for s, idx in by_segment.items():
            try:
                reply = self._call_segment(segments[s], LeaseRequest([keys[i] for i in idx]), LeaseReply)
                got = [] if reply is None else reply.grants
            except TransferError as exc:
                log.info("pool: segment %s unreachable: %s", s, exc)
                got = []
            for j, i in enumerate(idx):
                if j < len(got) and got[j] is not None:
                    g = got[j]
                    if object_size is not None and (g.nbytes, g.part_bytes) != object_size:
                        log.warning("pool: object %s on segment %s is %d bytes in parts of %d, not %d in parts of %d; "
                                    "not read", g.key, s, g.nbytes, g.part_bytes, *object_size)
                        foreign[i] = (s, g)
                    else:
                        grants[i] = (s, g)
        if foreign:
            self._release(foreign, segments)
        n = next((i for i in range(cut) if i not in grants), cut)  # the leading run actually leased
        read = PoolRead(self, keys[:n], [grants[i] for i in range(n)], segments, dst, offsets[:n], dst_memory,
                        layerwise, parts)
        for i in range(n, len(keys)):
            if i in grants:  # leased beyond a gap: of no use to a prefix
                self._release({i: grants[i]}, segments)
        with self._lock:
            for s in read.segments_used:
                self._reading[s] += 1
                self._served[s] += 1
            self.counters["misses"] += wanted - n  # not in the index, or its lease refused
            self.counters["foreign_objects"] += len(foreign)
        return read

    def get(self, keys: Sequence[str], dst: RegionHandle, offsets: Sequence[int], dst_memory: memoryview) -> int:
        """Read the longest available run of ``keys`` into ``dst`` at ``offsets``; returns how
        many objects, from the first, now hold verified bytes. Never raises for a missing or
        failed replica: what did not arrive is the caller's to compute."""
        read = self.open_read(keys, dst, offsets, dst_memory, layerwise=False)
        try:
            for part in read.parts:
                read.wait_part(part)
            return read.good
        finally:
            read.close()

    def read_leased(self, leases: dict, dst: RegionHandle, offsets: Sequence[int], dst_memory: memoryview,
                    parts: range) -> PoolRead:
        """Start reading ``parts`` of the objects another client leased (``PoolRead.leases`` of
        its read) into ``dst`` at ``offsets``, all in one transfer per segment. The other
        client holds the leases until this read is closed; closing it releases nothing."""
        if self._transfer is None:
            raise RuntimeError("this pool client has no transfer engine")
        segments = {s: SegmentInfo(s, str(d["address"]), RegionHandle.from_dict(d["handle"]), {})
                    for s, d in leases["segments"].items()}
        grants = [(str(s), Grant.from_dict(g)) for s, g in leases["grants"]]
        return PoolRead(self, [g.key for _, g in grants], grants, segments, dst, offsets, dst_memory,
                        False, parts, owns_leases=False)

    def _finished(self, read: PoolRead, used: bool) -> None:
        with self._lock:
            for s in read.segments_used:
                self._reading[s] -= 1
            self.counters["failed_reads_recomputed"] += read.num_objects - read.good
            if used:
                self.counters["hits"] += read.good
                self.counters["loads"] += 1 if read.good else 0
        self._release(dict(enumerate(read.grants)), read.segments)

    def _release(self, grants: dict[int, tuple[str, Grant]], segments: dict[str, SegmentInfo]) -> None:
        by_segment: dict[str, list[tuple[str, int]]] = {}
        for s, grant in grants.values():
            by_segment.setdefault(s, []).append((grant.key, grant.lease))
        for s, leases in by_segment.items():
            # Not waited for: the reader is done with the bytes, and a release that never
            # arrives only keeps the objects pinned until their leases expire.
            try:
                self._transfer.notify(segments[s].address, ReleaseRequest(leases).to_dict())
            except TransferError:
                pass

    def touch(self, keys: Sequence[str], holders: Sequence[Sequence[str]], retain: int | None = None,
              promote: bool = False) -> int:
        """Tell the segments holding ``keys`` (a prefix, in order; ``holders[i]``: the replicas
        of ``keys[i]``) that it was used now, as a read would (their LRU order); ``retain``: a
        session's, to keep at this priority; ``promote``: bring those on an SSD tier up to DRAM
        (``Segment.touch``). Returns how many came up. Best effort: a segment that does not
        answer misses it."""
        if self._transfer is None:
            raise RuntimeError("this pool client has no transfer engine")
        segments = self._answering(self.segments())
        by_segment: dict[str, list[str]] = {}
        for key, where in zip(keys, holders):
            for s in where:
                by_segment.setdefault(s, []).append(key)
        promoted = 0
        for s, held in by_segment.items():
            try:
                answer = self._call_segment(segments[s], TouchRequest(held, retain, promote), TouchReply)
                promoted += 0 if answer is None else answer.promoted
            except (TransferError, KeyError) as exc:
                log.info("pool: touch on segment %s failed: %s", s, exc)
        return promoted

    # -- writing ------------------------------------------------------------------------------------
    def put(self, key: str, src: RegionHandle, offset: int, nbytes: int, part_bytes: int, checksums: list[int],
            exclude: Sequence[str] = ()) -> str | None:
        """Store one object from ``src``; returns the segment that now holds it, or None when no
        segment took it (full, unreachable, or it is stored there already)."""
        return self.put_many(src, [NewObject(key, offset, nbytes, part_bytes)], [checksums], exclude)[0]

    def put_many(self, src: RegionHandle, objects: Sequence[NewObject], checksums: Sequence[list[int]],
                 exclude: Sequence[str] = ()) -> list[str | None]:
        """Store ``objects`` (their bytes in ``src`` already, ``checksums[i]`` those of object
        ``i``'s parts); for each, the segment that now holds it, or None (no segment took it,
        or it was stored there already). Three round trips per segment, whatever the number of
        objects: ``reserve``, one write, ``PoolWrite.seal``."""
        write = self.reserve(src, objects, exclude)
        write.write()
        return write.seal(checksums)

    def reserve(self, src: RegionHandle, objects: Sequence[NewObject], exclude: Sequence[str] = (),
                parts: range | None = None) -> PoolWrite:
        """Allocate ``objects`` on the segments with the most free DRAM (Mooncake Store's
        ``free_ratio_first``), one ``alloc`` per segment: what one has no room for goes on to the
        next. Each segment allocates, and later seals and publishes, its share in the order
        given (a prefix goes tail first, so readers see its head last). The caller writes the
        bytes into ``src`` (before or between ``PoolWrite.write`` calls), then seals or aborts.
        ``parts``: ``src`` holds only these parts of each object (``PoolWrite``)."""
        if self._transfer is None:
            raise RuntimeError("this pool client has no transfer engine")
        places: list[tuple[SegmentInfo, int] | None] = [None] * len(objects)
        if not objects:
            return PoolWrite(self, src, objects, places, parts)
        snapshot = self.segments()
        segments = self._answering(snapshot)
        largest = max(o.nbytes for o in objects)
        with self._lock:
            if self._placed_on is not snapshot:  # a new snapshot's free space counts what was placed before it
                self._placed.clear()
                self._placed_on = snapshot
            free = {s.segment_id: (s.stats.get("dram_free_bytes", 0) - self._placed[s.segment_id])
                    / max(1, s.stats.get("dram_bytes", 1)) for s in segments.values()}
        candidates = sorted((s for s in segments.values()
                             if s.segment_id not in exclude and s.stats.get("dram_bytes", 0) >= largest),
                            key=lambda s: -free[s.segment_id])
        todo = list(range(len(objects)))
        for seg in candidates:
            if not todo:
                break
            try:
                reply = self._call_segment(seg, AllocRequest([objects[i].size for i in todo]), AllocReply)
            except TransferError as exc:
                log.info("pool: alloc of %d objects on segment %s failed: %s", len(todo), seg.segment_id, exc)
                continue
            if reply is None:
                continue  # full: the next segment may have room
            offsets = reply.offsets  # one per object up to the first that did not fit
            for i, off in zip(todo, offsets):
                if off is not None:  # None: stored there already
                    places[i] = (seg, off)
                    with self._lock:
                        self._placed[seg.segment_id] += objects[i].nbytes
            todo = todo[len(offsets):]
        return PoolWrite(self, src, objects, places, parts)

    def write_reserved(self, reservation: dict, src: RegionHandle, offsets: Sequence[int], parts: range) -> PoolWrite:
        """The objects another client reserved (``PoolWrite.reservation``), for writing
        ``parts`` of each from ``src`` at ``offsets`` (those parts contiguous): ``write(part)``
        then ``settle``; the other client seals or aborts."""
        if self._transfer is None:
            raise RuntimeError("this pool client has no transfer engine")
        objects, places = [], []
        for entry, offset, place in zip(reservation["objects"], offsets, reservation["places"]):
            size = NewObjectSize.from_list(entry)
            objects.append(NewObject(size.key, offset, size.nbytes, size.part_bytes))
            places.append(None if place is None else (
                SegmentInfo(str(place[0]), str(place[1]), RegionHandle.from_dict(place[2]), {}), int(place[3])))
        return PoolWrite(self, src, objects, places, parts)


@dataclass(frozen=True)
class NewObject:
    """An object to put: ``nbytes`` at ``offset`` of the source region, in parts of
    ``part_bytes`` (one per layer)."""

    key: str
    offset: int
    nbytes: int
    part_bytes: int

    @property
    def size(self) -> NewObjectSize:
        """What a segment allocates for it."""
        return NewObjectSize(self.key, self.nbytes, self.part_bytes)


class PoolWrite:
    """Objects allocated on segments (``PoolClient.reserve``), written and then sealed or
    aborted: ``write`` (any number of times, the whole objects or one part at a time, without
    waiting), then exactly one of ``seal`` or ``abort``. An object the pool held already, or had
    no room for, has no place and is skipped throughout."""

    def __init__(self, client: PoolClient, src: RegionHandle, objects: Sequence[NewObject],
                 places: list[tuple[SegmentInfo, int] | None], parts: range | None = None) -> None:
        """``parts``: the parts of each object ``src`` holds, contiguous from the object's
        offset (a pipeline stage's layers); None: all."""
        self._client = client
        self._src = src
        self.objects = list(objects)
        self.places = places
        self.parts = parts
        self._batches: list[tuple[str, Batch]] = []
        self._done = False

    @property
    def num_placed(self) -> int:
        return sum(p is not None for p in self.places)

    def _by_segment(self) -> dict[str, tuple[SegmentInfo, list[int]]]:
        groups: dict[str, tuple[SegmentInfo, list[int]]] = {}
        for i, place in enumerate(self.places):
            if place is not None:
                groups.setdefault(place[0].segment_id, (place[0], []))[1].append(i)
        return groups

    def reservation(self) -> dict:
        """The objects and their places as plain data, for ``PoolClient.write_reserved``."""
        return {"objects": [o.size.to_list() for o in self.objects],
                "places": [None if p is None else [p[0].segment_id, p[0].address, p[0].handle.to_dict(), p[1]]
                           for p in self.places]}

    def write(self, part: int | None = None) -> None:
        """Start writing part ``part`` of every placed object (None: the whole objects), one
        batch per segment; returns at once (safe on the engine thread)."""
        if part is None and self.parts is not None:
            raise ValueError("a write of some parts goes part by part")
        transfer = self._client._transfer
        held = 0 if self.parts is None else self.parts.start
        for seg, idx in self._by_segment().values():
            entries = []
            for i in idx:
                o, off = self.objects[i], self.places[i][1]
                if part is None:
                    entries.append((self._src, o.offset, seg.handle, off, o.nbytes))
                else:
                    entries.append((self._src, o.offset + (part - held) * o.part_bytes, seg.handle,
                                    off + part * o.part_bytes, o.part_bytes))
            self._batches.append((seg.segment_id, transfer.write(seg.address, entries)))

    def seal(self, checksums: Sequence[list[int]]) -> list[str | None]:
        """Wait for the writes, then have each segment check and publish its objects; for each
        object, the segment that now holds it, or None. A segment whose write failed gets its
        objects aborted instead."""
        client, transfer = self._client, self._client._transfer
        self._done = True
        failed = self.settle()
        placed: list[str | None] = [None] * len(self.objects)
        for segment_id, (seg, idx) in self._by_segment().items():
            keys = [self.objects[i].key for i in idx]
            try:
                if segment_id in failed:
                    _ask(transfer, seg, AbortRequest(keys), None)
                    continue
                reply = _ask(transfer, seg, SealRequest([(self.objects[i].key, list(checksums[i])) for i in idx]),
                             SealReply)
            except TransferError as exc:
                log.info("pool: seal on segment %s failed: %s", segment_id, exc)
                continue
            sealed = [] if reply is None else reply.ok
            with client._lock:
                for i, ok in zip(idx, sealed):
                    if ok:
                        placed[i] = segment_id
                        client.counters["stores"] += 1
        return placed

    def abort(self) -> None:
        """Give the allocations back (best effort: a segment reclaims an unsealed put after its
        timeout anyway), once no write reads ``src`` any more."""
        if self._done:
            return
        self._done = True
        self.settle()
        for seg, idx in self._by_segment().values():
            try:
                _ask(self._client._transfer, seg, AbortRequest([self.objects[i].key for i in idx]), None)
            except TransferError as exc:
                log.info("pool: abort on segment %s failed: %s", seg.segment_id, exc)

    def settle(self) -> set[str]:
        """Wait for every write; the segments one failed on."""
        failed = set()
        for segment_id, batch in self._batches:
            try:
                batch.wait(self._client._timeout_s)
            except (TransferError, TimeoutError) as exc:
                log.info("pool: write to segment %s failed: %s", segment_id, exc)
                failed.add(segment_id)
                try:
                    batch.exception(self._client._timeout_s)  # let go of ``src`` before it is reused
                except Exception:  # noqa: BLE001 -- timed out or cancelled: the transport gave up
                    pass
        return failed


class PoolRead:
    """One prefix read in flight: leases held, every part's transfer submitted. ``wait_part``
    in order, then ``close`` (always: it releases the leases and settles the counters)."""

    def __init__(self, client: PoolClient, keys: list[str], grants: list[tuple[str, Grant]],
                 segments: dict[str, SegmentInfo], dst: RegionHandle, offsets: Sequence[int], memory: memoryview,
                 layerwise: bool = True, parts: range | None = None, owns_leases: bool = True) -> None:
        self._client = client
        self.keys = keys
        self.grants = grants
        self.segments = segments
        self._offsets = list(offsets)
        self._memory = memory
        self.segments_used = sorted({s for s, _ in grants})
        total = len(grants[0][1].checksums) if grants else 0
        self.parts = range(total) if parts is None else parts  # the parts read, contiguous at each offset
        if self.parts.stop > total and grants:
            raise ValueError(f"parts {self.parts} of objects of {total} parts")
        self._owns_leases = owns_leases
        self.good = len(grants)  # leading objects intact in every part waited for so far
        self._checked: set[int] = set()
        self._closed = False
        # batches[part - first part]: one batch per segment, so one slow or dead segment fails
        # only its objects. Not layer-wise: the first part's batches carry every part (an
        # object's parts are one contiguous copy), the others none.
        self._batches: list[list[tuple[str, Batch]]] = []
        transfer = client._transfer
        first = self.parts.start
        for part in self.parts:
            per_segment: dict[str, list] = {}
            if layerwise:
                entries = [(i, part, 1) for i in range(len(grants))]
            else:
                entries = [(i, first, len(self.parts)) for i in range(len(grants))] if part == first else []
            for i, p, count in entries:
                s, g = grants[i]
                size = g.part_bytes
                per_segment.setdefault(s, []).append((dst, self._offsets[i] + (p - first) * size, segments[s].handle,
                                                      g.offset + p * size, count * size))
            self._batches.append([(s, transfer.read(segments[s].address, entries)) for s, entries in per_segment.items()])

    @property
    def num_objects(self) -> int:
        return len(self.grants)

    def leases(self) -> dict:
        """The objects read and the leases held on them, as plain data: another client reads
        them with ``PoolClient.read_leased`` while this read stays open."""
        return {"segments": {s: {"address": self.segments[s].address, "handle": self.segments[s].handle.to_dict()}
                             for s in self.segments_used},
                "grants": [[s, g.to_dict()] for s, g in self.grants]}

    def wait_part(self, part: int) -> bool:
        """Wait for part ``part`` (one of ``parts``) of every object and check its checksums
        (once: a part waited for again is not checked again). True when every object's part
        is intact; otherwise ``good`` drops to the objects before the first one that is not (a
        failed transfer fails every object of its segment)."""
        if part not in self.parts:
            raise ValueError(f"part {part} is not among the parts read, {self.parts}")
        if part in self._checked:
            return self.good == self.num_objects
        self._checked.add(part)
        for s, batch in self._batches[part - self.parts.start]:
            try:
                batch.wait(self._client._timeout_s)
                if FAILPOINTS.fire("pool.fail_read"):
                    raise TransferError("the read failed (failpoint pool.fail_read)")
            except (TransferError, TimeoutError) as exc:
                log.warning("pool: read from segment %s failed: %s; recomputing", s, exc)
                self.good = min([self.good] + [i for i, (seg, _) in enumerate(self.grants) if seg == s])
        for i, (s, g) in enumerate(self.grants[: self.good]):
            size = g.part_bytes
            start = self._offsets[i] + (part - self.parts.start) * size
            if xxhash.xxh3_64_intdigest(self._memory[start : start + size]) != g.checksums[part]:
                log.warning("pool: object %s from segment %s failed its checksum; recomputing", self.keys[i], s)
                self.good = i
                break
        return self.good == self.num_objects

    def close(self, used: bool = True) -> None:
        """Release the leases (if this read holds them); call once, after the last
        ``wait_part`` (``used``: the reader took the objects), or instead of it (``used=False``:
        e.g. the request went away)."""
        if self._closed:
            return
        self._closed = True
        # Nobody may reuse the destination while a transfer still writes into it.
        for batches in self._batches:
            for _, batch in batches:
                try:
                    batch.exception(self._client._timeout_s)
                except Exception:  # noqa: BLE001 -- timed out or cancelled: the transport gave up
                    pass
        if self._owns_leases:
            self._client._finished(self, used)
