"""A request's session hint: which conversation or agent run it belongs to.

Chat and agent workloads come in sessions: a turn ends, the user or a tool thinks, and the next
turn resends everything before it plus a little. A hint lets the serving system keep that KV
(soft retention: ``paged_kv.block_pool.Retention``, the pool's segments) and send the next turn
where it is (the Conductor's sticky placement). Hints are hints: a request without one is served
exactly as before, and one with a hint is never refused or delayed for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_SESSION_ID_CHARS = 256
PRIORITY_RANGE = (-1000, 1000)


@dataclass(frozen=True)
class SessionHint:
    """``session_id``: the client's name for the session (1-256 characters); ``priority``: of
    two sessions' retained KV, the lower priority's goes first (0 by default)."""

    session_id: str
    priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not 0 < len(self.session_id) <= MAX_SESSION_ID_CHARS:
            raise ValueError(f"session_id must be a string of 1 to {MAX_SESSION_ID_CHARS} characters")
        lo, hi = PRIORITY_RANGE
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not lo <= self.priority <= hi:
            raise ValueError(f"priority must be an integer in [{lo}, {hi}]")

    def to_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "priority": self.priority}

    @classmethod
    def from_dict(cls, data: Any) -> SessionHint | None:
        """The hint of a message's ``session`` field (None: no hint); raises ValueError."""
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError("session must be an object")
        return cls(data.get("session_id"), data.get("priority", 0))
