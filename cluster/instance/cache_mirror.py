"""The instance's copy of its engine's cached prefix keys, for the Conductor's polls.

The engine thread publishes what changed after each step (``KVHandoff.cache_report``); the
event loop applies it here. A poll that says which version it has gets only the changes since
(``report``), so neither the engine thread nor a poll ever encodes the whole key set unless the
poller is new or too far behind.
"""

from __future__ import annotations

from collections import deque

from cluster.protocol import CacheDelta
from engine.disaggregation import CacheReport

_HISTORY = 4096  # published reports kept to answer "changes since version v"


class CacheMirror:
    def __init__(self) -> None:
        self.version: int | None = None
        self.keys: set[bytes] = set()
        # (version before, version after, added, removed) per applied report, oldest first
        self._history: deque[tuple[int, int, list[bytes], list[bytes]]] = deque(maxlen=_HISTORY)

    def apply(self, report: CacheReport) -> None:
        if report.full is not None:
            self.keys = set(report.full)
            self._history.clear()  # versions before a full report cannot be answered with changes
        else:
            self.keys.update(report.added)
            self.keys.difference_update(report.removed)
            self._history.append((self.version, report.version, report.added, report.removed))
        self.version = report.version

    def report(self, since: int | None) -> CacheDelta:
        """What a poller that has ``since`` needs: every key, or the changes since ``since``."""
        if since is not None and since == self.version:
            return CacheDelta(self.version)
        # A poller only ever holds versions we published, so one at or after the oldest kept
        # report's starting version can be answered with the changes after it.
        if since is not None and self._history and self._history[0][0] <= since < self.version:
            net: dict[bytes, bool] = {}
            for _, after, added, removed in self._history:
                if after > since:
                    net.update((k, True) for k in added)
                    net.update((k, False) for k in removed)
            return CacheDelta(self.version, None, [k for k, a in net.items() if a],
                              [k for k, a in net.items() if not a])
        return CacheDelta(self.version, list(self.keys))
