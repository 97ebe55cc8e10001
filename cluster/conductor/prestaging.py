"""Pre-staging (``session_prestage``): when a hinted session's turn ends, its KV is
brought up from the pool's SSD tiers to DRAM shortly before its next turn is likely to arrive
(``cluster/policies/sessions.py`` ``prestage_delay``, from its recent think times), by the
prefill instance that turn will likely run on. A turn that comes first cancels nothing: the
pre-staging sees the session busy again and does not ask. Bounded: at most ``MAX_PRESTAGING``
wait or run at once, each holding one turn's tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from cluster.conductor.client import InstanceClient
from cluster.conductor.registry import Registry
from cluster.conductor.sessions import SessionTable
from cluster.policies.sessions import prestage_delay
from cluster.protocol import ProtocolError
from engine.session import SessionHint

log = logging.getLogger(__name__)

MAX_PRESTAGING = 1024


class PreStager:
    def __init__(self, sessions: SessionTable, registry: Registry, client: InstanceClient,
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task], enabled: Callable[[], bool]) -> None:
        """``enabled``: whether to pre-stage now (``session_prestage`` set, and a pool to read)."""
        self._sessions = sessions
        self._enabled = enabled
        self._registry = registry
        self._client = client
        self._spawn = spawn
        self._waiting = 0  # pre-stagings waiting or under way

    def turn_ended(self, session: SessionHint, tokens: list[int], salt: str | None) -> None:
        """A session's turn ended with ``tokens`` (its prompt and output, cached under ``salt``):
        noted in the session table, and its pre-staging planned."""
        now = time.monotonic()
        delay = prestage_delay(self._sessions.ended(session.session_id, now))
        if delay is None or not self._enabled() or self._waiting >= MAX_PRESTAGING:
            return
        self._waiting += 1
        self._spawn(self._prestage(session, tokens, salt, now, delay))

    async def _prestage(self, session: SessionHint, tokens: list[int], salt: str | None, ended_at: float,
                        delay: float) -> None:
        try:
            await asyncio.sleep(delay)
            if self._sessions.idle_since(session.session_id) != ended_at:
                return  # its next turn came first
            # The instance its next turn likely prefills on (any that reads the pool can ask).
            up = [r for r in self._registry.up("prefill", "both") if r.info.pool is not None]
            rec = next((r for r in up if r.url == self._sessions.last_prefill(session.session_id)), None) or \
                (up[0] if up else None)
            if rec is None:
                return
            promoted = await self._client.prestage(rec.url, tokens, session, salt)
            self._sessions.prestages += 1
            self._sessions.prestaged_objects += promoted
        except ProtocolError as e:
            log.info("pre-staging session %s failed: %s", session.session_id, e)
        finally:
            self._waiting -= 1
