"""The Conductor's view of its instances: who is up, what each caches, what it is busy with.

Two sources feed it. Polling (``/instance/info`` once per incarnation, ``/instance/state`` every
``poll_interval_s``) brings health, free blocks and the cached prefix keys (only when the
instance's key set changed). The Conductor's own bookkeeping brings load: every request passes
through it, so it knows exactly what each prefill instance has queued (with predicted times) and
which requests each decode instance runs (with their contexts, counted as tokens stream back).
From both it builds the plain snapshots the policies read (``cluster/instance_state.py``).

An instance that fails a poll or a request is marked down and left out of scheduling; polling
continues, and the first successful ``/instance/info`` brings it back (a restarted process is a
new incarnation: its bookkeeping starts empty).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx

from cluster.calibration import InstanceProfile
from cluster.instance_state import DecodeInstanceState, PrefillInstanceState
from cluster.kv_stream import KVLayout

log = logging.getLogger(__name__)


@dataclass
class RunningDecode:
    start_s: float
    prompt_tokens: int
    generated: int = 1  # the first token came from the prefill


@dataclass(eq=False)  # identity: records are dict keys while requests are in flight
class InstanceRecord:
    url: str
    up: bool = False
    instance_id: str | None = None
    role: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    layout: KVLayout | None = None
    profile: InstanceProfile | None = None
    last_error: str | None = None
    failed_to_start: bool = False  # its engine could not load: it will not come up by itself
    state: dict[str, Any] = field(default_factory=dict)
    cached: frozenset[bytes] = frozenset()
    cache_version: int | None = None
    # Bookkeeping by the Conductor: request id -> (start, predicted prefill seconds)
    prefilling: dict[str, tuple[float, float]] = field(default_factory=dict)
    # request id -> running decode; request id -> (predicted KV arrival, prompt tokens)
    running: dict[str, RunningDecode] = field(default_factory=dict)
    incoming: dict[str, tuple[float, int]] = field(default_factory=dict)

    # -- PrefixView ------------------------------------------------------------------------------
    def match_len(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self.cached:
                break
            n += 1
        return n

    # -- snapshots for the policies ---------------------------------------------------------------
    def prefill_state(self, index: int, now: float) -> PrefillInstanceState:
        # Queued work drains in order; the oldest request has been running for a while already.
        queue = sum(predicted for _, predicted in self.prefilling.values())
        if self.prefilling:
            oldest_start, oldest = min(self.prefilling.values())
            queue -= min(oldest, max(now - oldest_start, 0.0))
        return PrefillInstanceState(index, max(queue, 0.0), self)

    def decode_state(self, index: int) -> DecodeInstanceState:
        running = list(self.running.values())
        incoming = list(self.incoming.values())
        return DecodeInstanceState(
            index=index,
            running_start_s=[r.start_s for r in running],
            running_prompt=[r.prompt_tokens for r in running],
            context_tokens=sum(r.prompt_tokens + r.generated for r in running),
            incoming_ready_s=[t for t, _ in incoming],
            incoming_prompt=[n for _, n in incoming],
        )

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url, "up": self.up, "role": self.role, "instance_id": self.instance_id,
            "pid": self.info.get("pid"),
            "last_error": self.last_error, "prefilling": len(self.prefilling),
            "running": len(self.running), "incoming": len(self.incoming),
            "cached_blocks": len(self.cached), **{k: self.state.get(k) for k in
            ("num_running", "num_waiting", "num_free_blocks", "num_used_blocks", "num_blocks",
             "num_reservations")},
        }


class Registry:
    def __init__(self, headers: dict[str, str], poll_interval_s: float = 0.2, timeout_s: float = 5.0) -> None:
        self.records: list[InstanceRecord] = []
        self.poll_interval_s = poll_interval_s
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, read=None))
        self._timeout_s = timeout_s
        self._task: asyncio.Task | None = None

    def add(self, url: str) -> InstanceRecord:
        url = url.rstrip("/")
        for rec in self.records:
            if rec.url == url:
                return rec
        rec = InstanceRecord(url)
        self.records.append(rec)
        log.info("instance %s added", url)
        return rec

    def up(self, *roles: str) -> list[InstanceRecord]:
        return [r for r in self.records if r.up and r.role in roles]

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.http.aclose()

    def mark_down(self, rec: InstanceRecord, reason: str) -> None:
        if rec.up:
            log.warning("instance %s (%s) is down: %s", rec.url, rec.role, reason)
        rec.up = False
        rec.last_error = reason

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(r) for r in list(self.records)))
            await asyncio.sleep(self.poll_interval_s)

    async def poll(self, rec: InstanceRecord) -> None:
        try:
            if not rec.up:
                r = await self.http.get(rec.url + "/instance/info", timeout=self._timeout_s)
                if r.status_code != 200:
                    try:
                        body = r.json()
                    except ValueError:
                        body = {}
                    rec.last_error = body.get("error") or f"info: HTTP {r.status_code}"
                    rec.failed_to_start = body.get("fatal") is True
                    return
                info = r.json()
                if info["instance_id"] != rec.instance_id:
                    # A new incarnation: whatever we thought it was doing is gone.
                    rec.prefilling.clear(), rec.running.clear(), rec.incoming.clear()
                    rec.cached, rec.cache_version = frozenset(), None
                rec.info, rec.instance_id, rec.role = info, info["instance_id"], info["role"]
                rec.layout = KVLayout.from_dict(info["layout"])
                rec.profile = InstanceProfile.from_dict(info["profile"])
            since = "" if rec.cache_version is None else f"?since={rec.cache_version}"
            r = await self.http.get(rec.url + "/instance/state" + since, timeout=self._timeout_s)
            if r.status_code != 200:
                raise httpx.HTTPStatusError(f"state: HTTP {r.status_code}", request=r.request, response=r)
            state = r.json()
            if state["instance_id"] != rec.instance_id:
                self.mark_down(rec, "restarted")
                return
            keys = state.pop("cached_keys")
            if keys is not None:
                rec.cached = frozenset(bytes.fromhex(k) for k in keys)
            rec.cache_version = state["cache_version"]
            rec.state = state
            if not rec.up:
                rec.up, rec.last_error, rec.failed_to_start = True, None, False
                log.info("instance %s is up (%s)", rec.url, rec.role)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            self.mark_down(rec, f"{type(e).__name__}: {e}")
