"""The pool's index, read: which segments hold which objects, where each segment is, its totals.

It lives in the metadata store (etcd, or the Conductor's embedded store), written by the
segments' owners (``service.SegmentService``) under their leases:

* ``pool/segments/<segment>``: the owner's Messenger address, its region's handle and its
  stats (free space, counters), refreshed every heartbeat;
* ``pool/objects/<key>/<segment>``: one entry per object a segment holds, sealed.

``PoolIndex`` only reads it, and moves no bytes: the Conductor holds one to look a prompt's
prefix up and to report the pool's totals, and needs neither the Messenger nor torch for it.
A ``PoolClient`` (``client.py``) is a ``PoolIndex`` that also reads and writes objects.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.metadata import MetadataStore

log = logging.getLogger(__name__)

OBJECTS = "pool/objects/"
SEGMENTS = "pool/segments/"

# What a pool client counts (an instance reports them to the Conductor with its other
# statistics; the Conductor sums them, so they are named here, beside the index it holds).
# ``metadata_unavailable``: pool loads and stores its user gave up because the metadata did not
# answer (in time); their prompts were computed, their blocks not stored.
CLIENT_COUNTERS = ("hits", "misses", "loads", "stores", "failed_reads_recomputed", "foreign_objects",
                   "metadata_unavailable", "segment_timeouts", "segments_passed_over")

# A segment's stats summed over the pool in ``PoolIndex.stats``.
_SUMMED = ("evictions", "demotions", "promotions", "replicas_made", "retained_evictions")


def object_entry(key: str, segment_id: str) -> str:
    return f"{OBJECTS}{key}/{segment_id}"


@dataclass(frozen=True)
class SegmentInfo:
    """A segment as its entry in ``pool/segments/`` describes it."""

    segment_id: str
    address: str  # the owner's Messenger
    handle: Any  # its region, as the index was told to read it (``PoolIndex``'s ``read_handle``)
    stats: dict

    @classmethod
    def from_entry(cls, segment_id: str, value: str,
                   read_handle: Callable[[dict[str, Any]], Any] = dict) -> SegmentInfo:
        """Raises ``ValueError``, ``KeyError`` or ``TypeError`` for an entry that is not a
        segment's (its writer's fault)."""
        data = json.loads(value)
        return cls(segment_id, data["address"], read_handle(data["handle"]), data.get("stats", {}))


class PoolIndex:
    """Thread-safe; blocking calls (run them off the event loop)."""

    def __init__(self, metadata: MetadataStore | None, *, segments_ttl_s: float = 1.0,
                 read_handle: Callable[[dict[str, Any]], Any] = dict) -> None:
        """``metadata`` None: for a ``PoolClient`` that only works under another's leases and
        reservations; every read of the index then raises ``RuntimeError``. ``read_handle``:
        what a segment's region handle (a ``RegionHandle.to_dict()``) is read into; an entry it
        refuses is left out. The plain dict by default: the index alone never transfers."""
        self._metadata = metadata
        self._segments_ttl_s = segments_ttl_s
        self._read_handle = read_handle
        self._lock = threading.Lock()
        self._segments: dict[str, SegmentInfo] = {}
        self._segments_at = float("-inf")

    def _meta(self) -> MetadataStore:
        if self._metadata is None:
            raise RuntimeError("this pool client has no metadata: it only works under another's leases")
        return self._metadata

    def segments(self, refresh: bool = False) -> dict[str, SegmentInfo]:
        """The live segments (those whose owner's lease holds their entry), read at most every
        ``segments_ttl_s`` unless ``refresh``. A new read is a new dict; a cached one is the
        same dict (never changed once returned)."""
        now = time.monotonic()
        with self._lock:
            if not refresh and now - self._segments_at < self._segments_ttl_s:
                return self._segments
        entries = self._meta().get_prefix(SEGMENTS)
        segments = {}
        for name, value in entries.items():
            segment_id = name[len(SEGMENTS):]
            try:
                segments[segment_id] = SegmentInfo.from_entry(segment_id, value, self._read_handle)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("pool: ignoring malformed segment entry %s: %s", segment_id, exc)
        with self._lock:
            self._segments, self._segments_at = segments, now
        return segments

    def replicas(self, key: str) -> list[str]:
        return self.holders([key])[0]

    def holders(self, keys: Sequence[str]) -> list[list[str]]:
        """The segments the index lists for each of ``keys``, in one metadata read."""
        found = self._meta().get_prefixes([f"{OBJECTS}{key}/" for key in keys])
        by_key: dict[str, list[str]] = {}
        for name in found:
            key, _, segment_id = name[len(OBJECTS):].rpartition("/")
            by_key.setdefault(key, []).append(segment_id)
        return [sorted(by_key.get(key, [])) for key in keys]

    def lookup(self, keys: Sequence[str]) -> list[list[str]]:
        """Replica segments of the longest run of ``keys`` (in order) held by live segments."""
        live = self.segments()
        run = []
        for where in self.holders(keys):
            where = [s for s in where if s in live]
            if not where:
                break
            run.append(where)
        return run

    def stats(self) -> dict[str, Any]:
        """What the segments publish: objects, bytes, free space per segment and tier, and the
        owners' counters (the readers' and writers' counters are theirs to report)."""
        segments = self.segments(refresh=True)
        total: dict[str, Any] = {"segments": {}, "objects": 0, "bytes": 0, **dict.fromkeys(_SUMMED, 0)}
        for segment_id, seg in sorted(segments.items()):
            s = seg.stats
            total["objects"] += s.get("objects", 0)
            total["bytes"] += s.get("bytes", 0)
            for name in _SUMMED:
                total[name] += s.get(name, 0)
            total["segments"][segment_id] = {
                "address": seg.address, "objects": s.get("objects", 0),
                "dram_bytes": s.get("dram_bytes", 0), "dram_free_bytes": s.get("dram_free_bytes", 0),
                "ssd_bytes": s.get("ssd_bytes", 0), "ssd_free_bytes": s.get("ssd_free_bytes", 0),
                "leased_objects": s.get("leased_objects", 0), "pending_puts": s.get("pending_puts", 0),
                "retained_objects": s.get("retained_objects", 0),
            }
        return total
