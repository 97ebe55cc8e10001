"""The Conductor's upkeep: the loops that run beside the requests (``conductor.py`` is the
request path). Each keeps one thing current and never ends by itself (an error is logged,
counted where ``/stats`` shows it, and retried):

* ``renew_forever``: the leases of the reservations this Conductor's requests hold on instances
  (they lapse by themselves when it dies or forgets them); a renewal that answers some are gone
  stops those requests' prefills at once (``RequestFlow.reservations_gone``);
* ``watch_members``: with etcd, the instances announced there (``cluster.metadata.membership``),
  added to the registry, and forgotten a while after they left it;
* ``watch_pool``: with a KVCache pool, its totals for ``/stats``;
* ``watch_pauses``: gaps in this process's own event loop (SIGSTOP, a long GC, a starved VM):
  ``paused_between`` tells whether one fell inside an interval, so that a request's TTFT that
  includes our own pause is not taken as the instances' speed.

The registry's polls (``registry.py``) and elastic roles (``elastic.py``) keep loops of their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any

from cluster.conductor.client import InstanceClient, InstanceUnavailable
from cluster.conductor.flow import RequestFlow
from cluster.conductor.ledger import Ledger
from cluster.conductor.registry import InstanceRecord, Registry
from cluster.pool.index import PoolIndex
from cluster.metadata import MetadataStore
from cluster.metadata.membership import list_instances
from cluster.protocol import TimedOut

log = logging.getLogger(__name__)

FORGET_AFTER_S = 60.0  # an instance down and no longer announced is forgotten after this long
TICK_S, PAUSE_S = 0.1, 1.0  # watch_pauses: a tick, and the gap between ticks taken for a pause
REFUSALS_LOG_EVERY_S = 60.0  # refused membership records: one log line at most this often


class Upkeep:
    def __init__(self, config: Any, client: InstanceClient, registry: Registry, ledger: Ledger, flow: RequestFlow,
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task], threads: Executor,
                 pool: PoolIndex | None = None, members: MetadataStore | None = None,
                 members_key: bytes = b"") -> None:
        """``config``: the Conductor's (``ConductorConfig``); ``threads``: where store calls run
        (each bounded: one that outlives its wait must not take the default executor's threads);
        ``members``, ``members_key``: the membership store and the key its records are signed with."""
        self._config, self._client, self._registry, self._ledger, self._flow = config, client, registry, ledger, flow
        self._spawn, self._threads = spawn, threads
        self._pool, self._members, self._key = pool, members, members_key
        self.pool_stats: dict[str, Any] | None = None  # the pool's totals, last read
        self.members_error: str | None = None  # why etcd did not answer the last listing
        # Membership records whose MAC failed in the latest listing (each logged when first seen):
        # an instance announced without the cluster secret is never polled nor sent a request.
        self.members_refused: list[str] = []
        self.pauses: deque[tuple[float, float]] = deque(maxlen=64)  # (start, end), monotonic: the latest
        self.paused_s = 0.0  # all of them together (/stats)
        self._tick = time.monotonic()  # watch_pauses' latest tick

    def tasks(self) -> list[asyncio.Task]:
        """Start the loops this Conductor needs."""
        tasks = [asyncio.create_task(self.renew_forever()), asyncio.create_task(self.watch_pauses())]
        if self._pool is not None:
            tasks.append(asyncio.create_task(self.watch_pool()))
        if self._members is not None:
            tasks.append(asyncio.create_task(self.watch_members()))
        return tasks

    async def watch_pauses(self) -> None:
        """Note every gap of over ``PAUSE_S`` between ticks of ``TICK_S``: this process did not run."""
        self._tick = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now, last = time.monotonic(), self._tick
            if now - last > PAUSE_S:
                self.pauses.append((last, now))
                self.paused_s += now - last - TICK_S
                log.warning("this Conductor did not run for %.1f s (paused, or starved of CPU); first tokens timed "
                            "across the gap do not teach the TTFT prediction", now - last)
            self._tick = now

    def last_pause_end(self) -> float | None:
        """When the latest gap ended (now, for one ``now`` is still in), or None without one."""
        now = time.monotonic()
        if now - self._tick > PAUSE_S:
            return now
        return self.pauses[-1][1] if self.pauses else None

    def paused_between(self, start: float, end: float) -> bool:
        """Whether a gap overlaps ``[start, end]`` (monotonic seconds): one noted, or one that
        ``end`` is still in (the watch has not ticked since: right after a resume, a request's
        task may run before the watch's)."""
        return end - self._tick > PAUSE_S or any(a < end and b > start for a, b in self.pauses)

    async def watch_pool(self) -> None:
        """Read the pool's totals every second (``pool_stats``)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.pool_stats = await loop.run_in_executor(self._threads, self._pool.stats)
            except Exception as exc:  # noqa: BLE001 -- reported, retried; the watch must not end
                log.warning("pool metadata unavailable: %s", exc)
            await asyncio.sleep(1.0)

    async def watch_members(self) -> None:
        """Poll every instance announced in the membership; forget one that left it, once it has
        been down (and held no request of this Conductor) for ``FORGET_AFTER_S``: till then
        /stats shows it down, and it comes back by itself if it was only cut off. Instances named
        by hand stay."""
        loop = asyncio.get_running_loop()
        announced: set[str] = set()
        gone_since: dict[str, float] = {}
        verdicts: dict = {}  # list_instances' memory of the records it checked
        refusals_logged_at = -REFUSALS_LOG_EVERY_S
        while True:
            try:
                listing = await asyncio.wait_for(
                    loop.run_in_executor(self._threads, list_instances, self._members, self._key, verdicts), 5.0)
            except Exception as exc:  # noqa: BLE001 -- the instances known stay polled; retried
                if self.members_error is None:
                    log.warning("membership unavailable (the instances known are still polled): %s", exc)
                self.members_error = f"{type(exc).__name__}: {exc}"
            else:
                if self.members_error is not None:
                    log.info("membership available again")
                self.members_error = None
                new = set(listing.refused) - set(self.members_refused)
                now = time.monotonic()
                if new and now - refusals_logged_at >= REFUSALS_LOG_EVERY_S:
                    # One line for any number (20,000 records written without the secret made 20,000 lines).
                    refusals_logged_at = now
                    shown = sorted(new)[:3]
                    log.warning("ignoring %d new membership record(s) (%d in all), e.g. %s: not signed with the "
                                "cluster's membership key (written by someone without the cluster secret, or "
                                "altered); logged at most every %g s, /stats membership_refused counts them",
                                len(new), len(listing.refused), ", ".join(shown), REFUSALS_LOG_EVERY_S)
                self.members_refused = listing.refused
                listed = {m.url.rstrip("/") for m in listing.members}
                for url in sorted(listed - announced):
                    self._registry.add(url)
                announced |= listed
                for rec in list(self._registry.records):
                    if (rec.url not in announced or rec.url in listed or rec.up
                            or rec.url in self._config.instances or self._ledger.holds(rec)):
                        gone_since.pop(rec.url, None)
                    elif now - gone_since.setdefault(rec.url, now) >= FORGET_AFTER_S:
                        self._registry.remove(rec)
                        self._ledger.forget(rec)
                        announced.discard(rec.url)
                        del gone_since[rec.url]
            await asyncio.sleep(self._config.members_interval_s)

    async def renew_forever(self) -> None:
        """Keep the leases of the reservations requests hold on instances (they expire by
        themselves when this Conductor dies or forgets them). Each instance is renewed by a call
        of its own, bounded by ``renew_timeout_s``: one that stalls delays only its own leases,
        and while its call is unanswered the next round skips it rather than piling calls up."""
        in_flight: dict[InstanceRecord, asyncio.Task] = {}
        while True:
            await asyncio.sleep(self._config.renew_interval_s)
            in_flight = {rec: task for rec, task in in_flight.items() if not task.done()}
            for rec, rids in self._ledger.reservations().items():
                if rec.up and rec not in in_flight:
                    in_flight[rec] = self._spawn(self._renew_on(rec, rids))

    async def _renew_on(self, rec: InstanceRecord, rids: list[str]) -> None:
        try:
            # wait_for as well as the HTTP timeout: the bound holds however the call hangs.
            timeout = self._config.renew_timeout_s
            asked_at = time.monotonic()
            gone = await asyncio.wait_for(self._client.renew(rec.url, rids, timeout), timeout)
            if gone and (stopped := self._flow.reservations_gone(gone, asked_at)):
                # Lapsed there (the instance stalled past the lease): their prefills stop now
                # rather than compute KV nobody will take, and the requests move.
                log.warning("%d reservation(s) on %s lapsed: moving their requests", stopped, rec.url)
        except (TimedOut, TimeoutError) as e:
            # Slow, not necessarily down: the polls judge its health; the lease has two more rounds.
            log.warning("renewing %d lease(s) on %s timed out: %s", len(rids), rec.url, e)
        except InstanceUnavailable as e:
            self._registry.mark_down(rec, f"renew: {e}")
        except Exception as e:  # noqa: BLE001 -- a refused renewal ends no request by itself
            log.warning("renewing leases on %s failed: %s", rec.url, e)
