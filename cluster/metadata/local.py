"""``LocalMetadata``: the metadata contract (``cluster.metadata``) in this process's memory.

Tests use it directly; the Conductor serves one over HTTP (``embedded.MetadataServer``) and
reads it in place for its own lookups.
"""

from __future__ import annotations

import bisect
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster.metadata import LeaseGone, MetadataStore


@dataclass
class _Lease:
    ttl_s: float
    deadline: float
    keys: set[str] = field(default_factory=set)


class LocalMetadata(MetadataStore):
    """A ``MetadataStore`` in this process's memory.

    Leases run on ``clock`` (monotonic seconds; injectable for tests). Expired leases are
    dropped, with their keys, at the start of every operation, under the lock: no thread is needed
    to reap them, and no reader ever sees a key whose lease has run out.

    Invariants (under ``_lock``): ``_values[k] == (v, L)`` with ``L`` not None iff ``k`` is in
    ``_leases[L].keys``; ``_sorted`` holds exactly the keys of ``_values``, sorted.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._values: dict[str, tuple[str, int | None]] = {}
        # Kept sorted so a prefix query is a bisection, not a scan of the whole object index.
        self._sorted: list[str] = []
        self._leases: dict[int, _Lease] = {}
        self._revision = 0  # writes so far (``create``'s answer); it starts anew with the process

    def grant_lease(self, ttl_s: float) -> int:
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"a lease TTL must be positive and finite, got {ttl_s}")
        with self._lock:
            self._expire()
            # Random, not counted: a restarted server must not hand a new holder the id that a
            # holder from before the restart still sends keepalives for.
            lease = 0
            while lease == 0 or lease in self._leases:
                lease = secrets.randbits(63)
            self._leases[lease] = _Lease(ttl_s, self._clock() + ttl_s)
            return lease

    def keepalive(self, lease: int) -> None:
        with self._lock:
            self._expire()
            held = self._leases.get(lease)
            if held is None:
                raise LeaseGone(f"lease {lease:x} expired or was revoked")
            held.deadline = self._clock() + held.ttl_s

    def revoke(self, lease: int) -> None:
        with self._lock:
            self._expire()
            if lease in self._leases:
                self._drop_lease(lease)

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        with self._lock:
            self._expire()
            self._write(key, value, lease)

    def create(self, key: str, value: str, lease: int | None = None) -> int | None:
        with self._lock:
            self._expire()
            if key in self._values:
                return None
            self._write(key, value, lease)
            return self._revision

    def get(self, key: str) -> str | None:
        with self._lock:
            self._expire()
            entry = self._values.get(key)
            return None if entry is None else entry[0]

    def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        with self._lock:
            self._expire()
            return {k: self._values[k][0] for k in keys if k in self._values}

    def get_prefix(self, prefix: str) -> dict[str, str]:
        with self._lock:
            self._expire()
            return {k: self._values[k][0] for k in self._prefixed(prefix)}

    def get_prefixes(self, prefixes: Sequence[str]) -> dict[str, str]:
        with self._lock:
            self._expire()
            return {k: self._values[k][0] for p in prefixes for k in self._prefixed(p)}

    def delete(self, key: str) -> bool:
        with self._lock:
            self._expire()
            return self._remove(key) is not None

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            self._expire()
            keys = self._prefixed(prefix)
            for key in keys:
                self._remove(key)
            return len(keys)

    def close(self) -> None:
        """Nothing to release: the data lives as long as the object."""

    # -- under the lock -----------------------------------------------------------------------------
    def _write(self, key: str, value: str, lease: int | None) -> None:
        if lease is not None and lease not in self._leases:
            raise LeaseGone(f"lease {lease:x} expired or was revoked")
        self._remove(key)  # detaches it from the lease it had, if any
        bisect.insort(self._sorted, key)
        self._values[key] = (value, lease)
        if lease is not None:
            self._leases[lease].keys.add(key)
        self._revision += 1

    def _expire(self) -> None:
        # A scan over leases, not keys: there is one lease per live node, so this stays small.
        now = self._clock()
        for lease in [lease for lease, held in self._leases.items() if held.deadline <= now]:
            self._drop_lease(lease)

    def _drop_lease(self, lease: int) -> None:
        for key in list(self._leases[lease].keys):
            self._remove(key)
        del self._leases[lease]

    def _remove(self, key: str) -> tuple[str, int | None] | None:
        entry = self._values.pop(key, None)
        if entry is not None:
            del self._sorted[bisect.bisect_left(self._sorted, key)]
            if entry[1] is not None:
                self._leases[entry[1]].keys.discard(key)
        return entry

    def _prefixed(self, prefix: str) -> list[str]:
        start = bisect.bisect_left(self._sorted, prefix)
        end = start
        while end < len(self._sorted) and self._sorted[end].startswith(prefix):
            end += 1
        return self._sorted[start:end]
