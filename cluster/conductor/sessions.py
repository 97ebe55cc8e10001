"""Where each hinted session's last turn ran, for sticky placement, and how long it thinks,
for pre-staging.

The Conductor notes, per ``session_id`` a request carried (``engine.session.SessionHint``), the
instances its turn was placed on, when it ended and its last few think times; the next turn's
placement reads the instances as an ``Affinity`` (``cluster/policies/sessions.py``), and
pre-staging waits by the think times (``prestage_delay``). An instance that is down is not in the lists a
placement sees, so a session whose instance died has no affinity and is placed like any request
(its KV comes from the pool where it is there). Bounded: the least recently used sessions are
forgotten beyond ``capacity``. Each Conductor keeps its own table: behind a balancer that does
not keep a session on one Conductor, the prefix caches' reports still steer the next turn
(Algorithm 1); stickiness then only adds less.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.conductor.registry import InstanceRecord
from cluster.policies.sessions import Affinity


@dataclass
class _Session:
    prefill: str  # instance URLs
    decode: str | None
    thinks: tuple[float, ...] = ()  # its last few think times (from a turn's end to the next's arrival)
    ended_at: float | None = None  # monotonic, when its last turn ended


THINKS_KEPT = 4


class SessionTable:
    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self.turns = 0  # placements of hinted requests
        self.followed = 0  # of which a later turn, whose last instance was still up
        self.kept = 0  # of those, placed where the last turn ran
        self.prestages = 0  # pre-stagings asked of an instance
        self.prestaged_objects = 0  # pool objects they brought up from an SSD tier

    def affinity(self, session_id: str, prefills: Sequence[InstanceRecord],
                 decodes: Sequence[InstanceRecord]) -> Affinity:
        s = self._sessions.get(session_id)
        if s is None:
            return Affinity()
        return Affinity(_index(prefills, s.prefill), _index(decodes, s.decode))

    def placed(self, session_id: str, affinity: Affinity, prefill: InstanceRecord,
               decode: InstanceRecord | None, now: float) -> None:
        """A turn of ``session_id`` was placed (``affinity``: what it was placed with)."""
        self.turns += 1
        s = self._sessions.pop(session_id, None)
        if s is not None and affinity.prefill is not None:
            self.followed += 1
            self.kept += s.prefill == prefill.url
        thinks = () if s is None else s.thinks
        if s is not None and s.ended_at is not None:
            thinks = (*thinks, now - s.ended_at)[-THINKS_KEPT:]
        self._sessions[session_id] = _Session(prefill.url, None if decode is None else decode.url, thinks)
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)

    def ended(self, session_id: str, now: float) -> tuple[float, ...]:
        """A turn of ``session_id`` ended: its recent think times (none: forgotten, or it never
        thought yet)."""
        s = self._sessions.get(session_id)
        if s is None:
            return ()
        s.ended_at = now
        return s.thinks

    def idle_since(self, session_id: str) -> float | None:
        """When its last turn ended, if no turn of it has been placed since."""
        s = self._sessions.get(session_id)
        return None if s is None else s.ended_at

    def last_prefill(self, session_id: str) -> str | None:
        s = self._sessions.get(session_id)
        return None if s is None else s.prefill

    def describe(self) -> dict[str, Any]:
        return {"sessions": len(self._sessions), "session_turns": self.turns,
                "session_turns_followed": self.followed, "session_turns_kept": self.kept,
                "session_prestages": self.prestages, "session_prestaged_objects": self.prestaged_objects}


def _index(records: Sequence[InstanceRecord], url: str | None) -> int | None:
    for i, r in enumerate(records):
        if r.url == url:
            return i
    return None
