"""Where each hinted session's last turn ran, for sticky placement (issue 42).

The Conductor notes, per ``session_id`` a request carried (``engine.session.SessionHint``), the
instances its turn was placed on and when it ended; the next turn's placement reads them as an
``Affinity`` (``cluster/policies/sessions.py``). An instance that is down is not in the lists a
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


class SessionTable:
    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self.turns = 0  # placements of hinted requests
        self.followed = 0  # of which a later turn, whose last instance was still up
        self.kept = 0  # of those, placed where the last turn ran

    def affinity(self, session_id: str, prefills: Sequence[InstanceRecord],
                 decodes: Sequence[InstanceRecord]) -> Affinity:
        s = self._sessions.get(session_id)
        if s is None:
            return Affinity()
        return Affinity(_index(prefills, s.prefill), _index(decodes, s.decode))

    def placed(self, session_id: str, affinity: Affinity, prefill: InstanceRecord,
               decode: InstanceRecord | None) -> None:
        """A turn of ``session_id`` was placed (``affinity``: what it was placed with)."""
        self.turns += 1
        s = self._sessions.pop(session_id, None)
        if s is not None and affinity.prefill is not None:
            self.followed += 1
            self.kept += s.prefill == prefill.url
        self._sessions[session_id] = _Session(prefill.url, None if decode is None else decode.url)
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)

    def describe(self) -> dict[str, Any]:
        return {"sessions": len(self._sessions), "session_turns": self.turns,
                "session_turns_followed": self.followed, "session_turns_kept": self.kept}


def _index(records: Sequence[InstanceRecord], url: str | None) -> int | None:
    for i, r in enumerate(records):
        if r.url == url:
            return i
    return None
