"""The Conductor's view of its instances: who is up and what each caches.

Polling (``/instance/info`` once per incarnation, ``/instance/state`` every ``poll_interval_s``)
brings health, free blocks and the cached prefix keys, as changes since the version the registry
last saw. A Conductor's own load on an instance is not polled: its requests pass through it, and
it keeps an exact record of them (``ledger.py``); the poll brings what the instance reports of the
other Conductors' requests (``InstanceState.work``), which the ledger adds.

An instance that fails a poll, or that a request finds unhealthy (``InstanceUnavailable``,
``cluster/protocol/``; a refused request says nothing against it), is marked down and left out
of scheduling; its
``lost`` event fires, which ends the calls in flight to it. Polling continues, and the first
successful ``/instance/info`` brings it back; a restarted process is a new incarnation, and
``on_new_incarnation`` lets the ledger forget what the old one was doing.

An instance comes up only if it fits the ones already up (``InstanceInfo.misfit``): the same
weights (by digest), precision and quantization, and the same KV layout (dtype, block size,
layers, heads) and pool naming, since KV moves between them as raw pages. One that does not is
kept down with the reason in ``last_error`` (and ``misfit``) and a warning in the log; the first
instance up, while none is, sets what fits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Sequence

from cluster.policies.cost_model import InstanceProfile
from cluster.policies.prefix_index import match_len
from cluster.conductor.client import InstanceClient, OwnResourcesExhausted
from cluster.protocol import CacheDelta, InstanceInfo, InstanceNotReady, InstanceState
from engine.kv_layout import KVLayout

log = logging.getLogger(__name__)


@dataclass(eq=False)  # identity: records are dict keys while requests are in flight
class InstanceRecord:
    url: str
    up: bool = False
    instance_id: str | None = None
    role: str | None = None
    info: InstanceInfo | None = None
    layout: KVLayout | None = None
    profile: InstanceProfile | None = None
    last_error: str | None = None
    failed_to_start: bool = False  # its engine could not load: it will not come up by itself
    misfit: str | None = None  # why it does not fit the instances up (kept down), if it does not
    state: InstanceState | None = None
    state_at: float = 0.0  # monotonic, when ``state`` was answered
    # Elastic roles: the role the instance drains toward (its polled state), and the
    # one this Conductor decided to move it to (set before the instance knows, until it serves
    # it or gave up). Either keeps it out of placement (``Registry.up``).
    switching_to: str | None = None
    moving_to: str | None = None
    cached: set[bytes] = field(default_factory=set)
    cache_version: int | None = None
    # Set while the instance is down: calls in flight to it give up (``InstanceClient``).
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.lost.set()  # not up yet

    # -- PrefixView ------------------------------------------------------------------------------
    def match_len(self, keys: Sequence[bytes]) -> int:
        return match_len(keys, self.cached)

    def describe(self) -> dict[str, Any]:
        stats = self.state.stats if self.state is not None else {}
        return {
            "url": self.url, "up": self.up, "role": self.role, "switching_to": self.switching_to or self.moving_to,
            "instance_id": self.instance_id,
            "pid": self.info.pid if self.info is not None else None, "last_error": self.last_error,
            "misfit": self.misfit,
            # The instance's cache_version this view is at: compare with the instance's own /stats
            # to tell whether the Conductor has seen its latest cached prefixes.
            "cached_blocks": len(self.cached), "cache_version": self.cache_version,
            **{k: stats.get(k) for k in ("num_running", "num_waiting", "num_free_blocks", "num_used_blocks",
                                         "num_blocks", "num_reservations", "role_switches")},
        }


class Registry:
    def __init__(self, client: InstanceClient, poll_interval_s: float = 0.2, poll_timeout_s: float = 5.0,
                 on_new_incarnation: Callable[[InstanceRecord], None] = lambda rec: None) -> None:
        self.records: list[InstanceRecord] = []
        self.client = client
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self._on_new_incarnation = on_new_incarnation
        self._task: asyncio.Task | None = None
        self._probes: dict[str, asyncio.Task] = {}
        self._refresh: asyncio.Future | None = None
        self.suspicions = 0  # calls that timed out on an instance the probe then found up (/stats)

    def add(self, url: str) -> InstanceRecord:
        url = url.rstrip("/")
        for rec in self.records:
            if rec.url == url:
                return rec
        rec = InstanceRecord(url)
        self.records.append(rec)
        log.info("instance %s added", url)
        return rec

    def remove(self, rec: InstanceRecord) -> None:
        """Stop polling ``rec`` and forget it (an instance that left the membership for good)."""
        if rec in self.records:
            self.records.remove(rec)
            self.mark_down(rec, "left the cluster")
            log.info("instance %s removed", rec.url)

    def up(self, *roles: str) -> list[InstanceRecord]:
        """The instances up in one of ``roles`` and not switching role (they take no new work)."""
        return [r for r in self.records if r.up and r.role in roles and r.switching_to is None and r.moving_to is None]

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def mark_down(self, rec: InstanceRecord, reason: str) -> None:
        if rec.up:
            log.warning("instance %s (%s) is down: %s", rec.url, rec.role, reason)
        rec.up = False
        rec.last_error = reason
        rec.lost.set()

    async def refresh(self, since: float) -> None:
        """Poll now every instance up whose state is older than ``since`` (monotonic), at most
        once whatever the number of callers waiting: after a pause of this process, none of
        its decisions should rest on a report from before it."""
        stale = [r for r in self.records if r.up and r.state_at < since]
        if not stale:
            return
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(asyncio.gather(*(self.poll(r) for r in stale)))
        await asyncio.shield(self._refresh)

    def suspect(self, rec: InstanceRecord, reason: str) -> None:
        """A call to ``rec`` timed out. A loaded instance can be slow to answer one call and
        healthy all the same (a decode instance marked down under load, up again 0.2 s
        later), so a timeout alone does not mark it down: a poll now decides, as every poll does
        (``poll``: no state in ``poll_timeout_s`` means down). At most one such probe at a time."""
        if not rec.up or rec.url in self._probes:
            return
        log.info("instance %s (%s): %s; polling it now to tell slow from down", rec.url, rec.role, reason)

        async def probe() -> None:
            try:
                await self.poll(rec)
                if rec.up:
                    self.suspicions += 1
            finally:
                self._probes.pop(rec.url, None)

        self._probes[rec.url] = asyncio.create_task(probe())

    async def _poll_forever(self) -> None:
        # One loop per instance: a frozen instance's slow polls must not delay the others'.
        loops: dict[InstanceRecord, asyncio.Task] = {}
        try:
            while True:
                for rec in self.records:
                    if rec not in loops:
                        loops[rec] = asyncio.create_task(self._poll_one_forever(rec))
                for rec in [rec for rec in loops if rec not in self.records]:  # removed
                    loops.pop(rec).cancel()
                await asyncio.sleep(self.poll_interval_s)
        finally:
            for task in loops.values():
                task.cancel()

    async def _poll_one_forever(self, rec: InstanceRecord) -> None:
        while True:
            await self.poll(rec)
            await asyncio.sleep(self.poll_interval_s)

    async def poll(self, rec: InstanceRecord) -> None:
        try:
            if not rec.up:
                try:
                    info = await self.client.info(rec.url, self.poll_timeout_s)
                except InstanceNotReady as e:
                    rec.last_error, rec.failed_to_start = str(e), e.fatal
                    return
                if info.instance_id != rec.instance_id:
                    # A new incarnation: whatever we thought it was doing or caching is gone.
                    self._on_new_incarnation(rec)
                    rec.cached, rec.cache_version = set(), None
                rec.info, rec.instance_id, rec.role = info, info.instance_id, info.role
                rec.layout = KVLayout.from_dict(info.layout)
                rec.profile = InstanceProfile.from_dict(info.profile)
            state = await self.client.state(rec.url, rec.cache_version, self.poll_timeout_s)
            if state.instance_id != rec.instance_id:
                self.mark_down(rec, "restarted")
                return
            self._apply_cache(rec, state.cache)
            rec.state, rec.state_at = state, time.monotonic()
            if state.role is not None and state.role != rec.role:
                log.info("instance %s serves %s now (was %s)", rec.url, state.role, rec.role)
                rec.role = state.role
            rec.switching_to = state.switching_to
            if not rec.up:
                if (misfit := self._misfit(rec)) is not None:
                    if misfit != rec.misfit:
                        log.warning("instance %s (%s) refused: it does not fit the cluster: %s",
                                    rec.url, rec.role, misfit)
                    rec.misfit, rec.last_error = misfit, f"does not fit the cluster: {misfit}"
                    return
                rec.up, rec.last_error, rec.failed_to_start, rec.misfit = True, None, False, None
                rec.lost = asyncio.Event()
                log.info("instance %s is up (%s)", rec.url, rec.role)
        except OwnResourcesExhausted as e:  # our failure, not the instance's: it stays as it was
            log.warning("could not poll instance %s: %s", rec.url, e)
        except Exception as e:  # noqa: BLE001 -- any other failure to poll means down
            self.mark_down(rec, f"{type(e).__name__}: {e}")

    def _misfit(self, rec: InstanceRecord) -> str | None:
        """Why ``rec`` cannot join the instances up now, or None (also when none is up)."""
        for other in self.records:
            if other is not rec and other.up and other.info is not None and rec.info is not None:
                return rec.info.misfit(other.info)
        return None

    @staticmethod
    def _apply_cache(rec: InstanceRecord, cache: CacheDelta) -> None:
        if cache.full is not None:
            rec.cached = set(cache.full)
        else:
            rec.cached.update(cache.added)
            rec.cached.difference_update(cache.removed)
        rec.cache_version = cache.version
