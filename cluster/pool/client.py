"""The pool as its users see it: find a prefix, read it into a registered buffer, store objects.

Every instance holds a ``PoolClient`` (a standalone pool node holds one to replicate hot
objects; the Conductor one to look prefixes up and read the pool's counters). Metadata says
which segments hold which objects (``pool/objects/<key>/<segment>``, tied to the segment
owner's lease) and where each segment is (``pool/segments/<segment>``, with its free space
and counters, refreshed every heartbeat). The bytes never pass through the metadata store:

* ``get``: the longest run of consecutive keys present; for each object the least-loaded
  replica; one lease request per segment (``SegmentService``), then one-sided Messenger reads
  straight into the caller's buffer, then every part's checksum. A replica that vanished,
  failed its read or its checksum ends the run there: the caller computes the rest.
* ``put``: write-then-publish on the segment with the most free DRAM (Mooncake Store's
  ``free_ratio_first``): allocate, write, seal (the owner checks the checksums and publishes).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from cluster.pool.metadata import MetadataStore
from cluster.transfer import RegionHandle, TransferEngine, TransferError
from cluster.transfer.protocol import Status

log = logging.getLogger(__name__)

OBJECTS = "pool/objects/"
SEGMENTS = "pool/segments/"

# What the client counts; the segment service publishes them beside its segment's own counters.
CLIENT_COUNTERS = ("hits", "misses", "loads", "stores", "failed_reads_recomputed", "replicas_made")


def object_entry(key: str, segment_id: str) -> str:
    return f"{OBJECTS}{key}/{segment_id}"


@dataclass(frozen=True)
class SegmentInfo:
    segment_id: str
    address: str  # the owner's Messenger
    handle: RegionHandle
    stats: dict

    @property
    def free_ratio(self) -> float:
        return self.stats.get("dram_free_bytes", 0) / max(1, self.stats.get("dram_bytes", 1))

    @classmethod
    def from_entry(cls, segment_id: str, value: str) -> SegmentInfo:
        data = json.loads(value)
        return cls(segment_id, data["address"], RegionHandle.from_dict(data["handle"]), data.get("stats", {}))


class PoolClient:
    """Thread-safe; blocking calls (run them off the event loop)."""

    def __init__(self, transfer: TransferEngine | None, metadata: MetadataStore, *, segments_ttl_s: float = 1.0,
                 transfer_timeout_s: float = 30.0) -> None:
        self._transfer = transfer
        self._metadata = metadata
        self._segments_ttl_s = segments_ttl_s
        self._timeout_s = transfer_timeout_s
        self._lock = threading.Lock()
        self._segments: dict[str, SegmentInfo] = {}
        self._segments_at = float("-inf")
        self._reading: Counter[str] = Counter()  # objects being read per segment: the load we balance
        self._served: Counter[str] = Counter()  # objects read per segment, to break ties in turn
        self.counters = dict.fromkeys(CLIENT_COUNTERS, 0)

    # -- index --------------------------------------------------------------------------------------
    def segments(self, refresh: bool = False) -> dict[str, SegmentInfo]:
        now = time.monotonic()
        with self._lock:
            if not refresh and now - self._segments_at < self._segments_ttl_s:
                return self._segments
        entries = self._metadata.get_prefix(SEGMENTS)
        segments = {}
        for name, value in entries.items():
            segment_id = name[len(SEGMENTS):]
            try:
                segments[segment_id] = SegmentInfo.from_entry(segment_id, value)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("pool: ignoring malformed segment entry %s: %s", segment_id, exc)
        with self._lock:
            self._segments, self._segments_at = segments, now
        return segments

    def replicas(self, key: str) -> list[str]:
        prefix = f"{OBJECTS}{key}/"
        return [name[len(prefix):] for name in self._metadata.get_prefix(prefix)]

    def lookup(self, keys: Sequence[str]) -> list[list[str]]:
        """Replica segments of the longest run of ``keys`` (in order) held by live segments."""
        live = self.segments()
        run = []
        for key in keys:
            holders = [s for s in self.replicas(key) if s in live]
            if not holders:
                break
            run.append(holders)
        return run

    def geometry(self) -> tuple[str, int] | None:
        """(namespace, engine blocks per object) as an instance's segment publishes them: what
        the Conductor needs to name a prompt's objects. None until an instance has joined."""
        for seg in self.segments().values():
            if "namespace" in seg.stats and "blocks_per_object" in seg.stats:
                return str(seg.stats["namespace"]), int(seg.stats["blocks_per_object"])
        return None

    def stats(self) -> dict:
        """The pool's totals: objects, bytes, free space per segment and tier, counters."""
        segments = self.segments(refresh=True)
        total: dict = {"segments": {}, "objects": 0, "bytes": 0}
        summed = ("hits", "misses", "loads", "stores", "evictions", "demotions", "promotions",
                  "replicas_made", "failed_reads_recomputed")
        for name in summed:
            total[name] = 0
        for segment_id, seg in sorted(segments.items()):
            s = seg.stats
            total["objects"] += s.get("objects", 0)
            total["bytes"] += s.get("bytes", 0)
            for name in summed:
                total[name] += s.get(name, 0)
            total["segments"][segment_id] = {
                "address": seg.address, "objects": s.get("objects", 0),
                "dram_bytes": s.get("dram_bytes", 0), "dram_free_bytes": s.get("dram_free_bytes", 0),
                "ssd_bytes": s.get("ssd_bytes", 0), "ssd_free_bytes": s.get("ssd_free_bytes", 0),
            }
        return total

    # -- reading ------------------------------------------------------------------------------------
    def get(self, keys: Sequence[str], dst: RegionHandle, offsets: Sequence[int], dst_memory: memoryview) -> int:
        """Read the longest available run of ``keys`` into ``dst`` at ``offsets`` (``dst_memory``
        is the same region as bytes, for the checksum check); returns how many objects, from the
        first, now hold verified bytes. Never raises for a missing or failed replica."""
        if self._transfer is None:
            raise RuntimeError("this pool client has no transfer engine")
        run = self.lookup(keys)
        loaded = self._read_run(list(keys[: len(run)]), run, dst, offsets, dst_memory)
        with self._lock:
            self.counters["hits"] += loaded
            self.counters["misses"] += len(keys) - loaded
            self.counters["loads"] += 1 if loaded else 0
        return loaded

    def _read_run(self, keys: list[str], holders: list[list[str]], dst: RegionHandle, offsets: Sequence[int],
                  memory: memoryview) -> int:
        segments = self.segments()
        with self._lock:
            choice = [min((s for s in h if s in segments), key=lambda s: (self._reading[s], self._served[s]),
                          default=None) for h in holders]
            for s in choice:
                if s is not None:
                    self._served[s] += 1
        cut = next((i for i, s in enumerate(choice) if s is None), len(choice))
        keys, choice = keys[:cut], choice[:cut]
        by_segment: dict[str, list[int]] = {}
        for i, s in enumerate(choice):
            by_segment.setdefault(s, []).append(i)
        with self._lock:
            for s, idx in by_segment.items():
                self._reading[s] += len(idx)
        grants: dict[int, tuple[str, dict]] = {}
        failed = len(keys)  # index of the first object that did not arrive intact
        try:
            batches = []
            for s, idx in by_segment.items():
                seg = segments[s]
                try:
                    status, answer = self._transfer.call(seg.address, {"op": "lease", "keys": [keys[i] for i in idx]})
                    got = answer.get("grants", []) if status == Status.OK else []
                except TransferError as exc:
                    log.info("pool: segment %s unreachable: %s", s, exc)
                    got = []
                entries = []
                for j, i in enumerate(idx):
                    grant = got[j] if j < len(got) else None
                    if grant is None:
                        failed = min(failed, i)
                        continue
                    grants[i] = (s, grant)
                    entries.append((dst, offsets[i], seg.handle, grant["offset"], grant["nbytes"]))
                if entries:
                    batches.append((s, [i for i in idx if i in grants], self._transfer.read(seg.address, entries)))
            for s, idx, batch in batches:
                try:
                    batch.wait(self._timeout_s)
                except (TransferError, TimeoutError) as exc:
                    log.info("pool: read from segment %s failed: %s", s, exc)
                    failed = min(failed, *idx)
            for i in range(min(failed, len(keys))):
                grant = grants[i][1]
                part = grant["part_bytes"]
                data = memory[offsets[i] : offsets[i] + grant["nbytes"]]
                sums = [xxhash.xxh3_64_intdigest(data[p : p + part]) for p in range(0, len(data), part)]
                if sums != grant["checksums"]:
                    log.warning("pool: object %s from segment %s failed its checksum; recomputing", keys[i], grants[i][0])
                    failed = i
                    break
        finally:
            with self._lock:
                for s, idx in by_segment.items():
                    self._reading[s] -= len(idx)
            self._release(grants, segments)
        if failed < len(keys):
            with self._lock:
                self.counters["failed_reads_recomputed"] += len(keys) - failed
        return failed

    def _release(self, grants: dict[int, tuple[str, dict]], segments: dict[str, SegmentInfo]) -> None:
        by_segment: dict[str, list] = {}
        for s, grant in grants.values():
            by_segment.setdefault(s, []).append([grant["key"], grant["lease"]])
        for s, leases in by_segment.items():
            try:
                self._transfer.call(segments[s].address, {"op": "release", "leases": leases})
            except TransferError:
                pass  # the leases expire by themselves

    # -- writing ------------------------------------------------------------------------------------
    def put(self, key: str, src: RegionHandle, offset: int, nbytes: int, part_bytes: int, checksums: list[int],
            exclude: Sequence[str] = ()) -> str | None:
        """Store one object from ``src``; returns the segment that now holds it, or None when no
        segment took it (full, unreachable, or it is stored there already)."""
        if self._transfer is None:
            raise RuntimeError("this pool client has no transfer engine")
        candidates = sorted((s for s in self.segments().values()
                             if s.segment_id not in exclude and s.stats.get("dram_bytes", 0) >= nbytes),
                            key=lambda s: -s.free_ratio)
        for seg in candidates:
            try:
                status, answer = self._transfer.call(seg.address, {"op": "alloc", "key": key, "nbytes": nbytes,
                                                                   "part_bytes": part_bytes})
                if status != Status.OK:
                    continue  # full: the next segment may have room
                if answer.get("offset") is None:
                    return None  # already stored there
                try:
                    self._transfer.write_sync(seg.address, [(src, offset, seg.handle, answer["offset"], nbytes)],
                                              timeout=self._timeout_s)
                except (TransferError, TimeoutError):
                    self._transfer.call(seg.address, {"op": "abort", "key": key})
                    raise
                status, answer = self._transfer.call(seg.address, {"op": "seal", "key": key, "checksums": checksums})
                if status == Status.OK and answer.get("ok"):
                    with self._lock:
                        self.counters["stores"] += 1
                    return seg.segment_id
            except (TransferError, TimeoutError) as exc:
                log.info("pool: put of %s on segment %s failed: %s", key, seg.segment_id, exc)
        return None
