"""One request through the cluster, with a compensation on every exit path.

``disaggregated``: reserve the KV on a decode instance (in the planned order; one that is full
is skipped for the next), pull a hot prefix to the prefill instance if the placement says so,
have the prefill instance compute the prompt and stream its KV into the reservation, yield the
first token, then relay the decode instance's stream. ``colocated``: relay one ``both``
instance's stream, or a decode instance's for a request it prefills itself (local prefill).

The placement was booked in the ledger before this runs (``Booking``). Before each call that
makes an instance hold something (a reservation, a prefill, a decode), the booking notes it, so
whatever way the request ends (finished, failed, refused, or the client gone: cancellation),
``Booking.close`` in the ``finally`` tells which instances to abort it on. The aborts run as
tasks of their own, so the cancellation that ended the request cannot cancel them; an abort is
idempotent on the instance.

A request cannot go on where it was placed when that instance is lost (it stopped answering
polls, a call found it unreachable or failing) or drops the request's reservation (it lapsed while
the instance stalled): that is ``RequestMoved``, not a failure of the request, and the Conductor
places it again (``Conductor.generate``). Only an unhealthy instance is marked down; a request's
own fault (``BadRequest``) ends it with a 400 wherever it runs.
"""

from __future__ import annotations

import asyncio

import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any

from cluster.conductor.client import InstanceClient
from cluster.conductor.registry import InstanceRecord, Registry
from cluster.protocol import (BadRequest, GenerateRequest, InstanceBusy, InstanceUnavailable, KVWriteFailed, NoKVRoom,
                              Prefilled, ProtocolError, RequestError, RequestFailed, ReserveReply, TimedOut,
                              UnknownReservation)
from engine.engine_client import EngineOverloaded
from engine.engine_client import RequestFailed as EngineRequestFailed
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.session import SessionHint

log = logging.getLogger(__name__)


@dataclass
class RunningDecode:
    start_s: float
    prompt_tokens: int
    generated: int = 1  # the first token came from the prefill


class Booking:
    """Where one request stands on each instance, booked step by step as it walks through the
    cluster: the methods below, in the order a disaggregated request takes them, each called
    before the call that makes an instance hold something. The ledger (``ledger.py``) adds up
    every open booking into each instance's load; ``close``, on whatever path the request leaves,
    says what the instances may still hold of it, to abort. A step that ends by itself there
    (``prefilled``, ``finished``) leaves nothing to abort. ``key``: a second id of the request's
    own on an instance (a hot-prefix migration's), by default the request's. ``moved``: an
    attempt after a move (the request was admitted, and counted, on its first)."""

    def __init__(self, request_id: str, moved: bool = False) -> None:
        self.request_id = request_id
        self.moved = moved
        self.prefill: tuple[InstanceRecord, float, float] | None = None  # (instance, start, predicted s)
        self.kv: tuple[InstanceRecord, float, int] | None = None  # headed to (decode, predicted arrival, prompt)
        self.reserved: dict[tuple[InstanceRecord, str], bool] = {}  # held: -> no KV write can be in flight
        self.decode: tuple[InstanceRecord, RunningDecode] | None = None  # decoding there
        self.closed = False

    def placed(self, rec: InstanceRecord, start: float, predicted_s: float) -> None:
        """Its prefill is placed on ``rec`` (a prefill instance, or the instance that runs the
        whole request), predicted to take ``predicted_s``."""
        self.prefill = (rec, start, predicted_s)

    def kv_headed(self, decode: InstanceRecord, arrives_at: float, prompt_tokens: int) -> None:
        """Its KV is headed for ``decode``, predicted to land at ``arrives_at``."""
        self.kv = (decode, arrives_at, prompt_tokens)

    def reserving(self, rec: InstanceRecord, key: str | None = None) -> None:
        """A reservation is asked for on ``rec``: from now on it may hold one (a call that
        times out may have been granted), though nothing writes into it yet."""
        self.reserved[rec, key or self.request_id] = True

    def no_room(self, rec: InstanceRecord) -> None:
        """``rec`` refused the reservation: it holds nothing."""
        self.reserved.pop((rec, self.request_id), None)

    def kv_moved(self, decode: InstanceRecord, prompt_tokens: int) -> None:
        """The reservation was granted on ``decode``, not on the planned one (full)."""
        self.kv = (decode, time.monotonic(), prompt_tokens)

    def writable(self, rec: InstanceRecord, key: str | None = None) -> None:
        """From now on KV may be in flight into the reservation on ``rec``: its abort must say so."""
        self.reserved[rec, key or self.request_id] = False

    def released(self, rec: InstanceRecord, key: str | None = None) -> None:
        """The reservation on ``rec`` is over there (adopted or dropped)."""
        self.reserved.pop((rec, key or self.request_id), None)

    def prefilled(self, decode: InstanceRecord) -> None:
        """The prefill answered: it left its instance's queue, its KV landed on ``decode``, and no
        write is in flight into the reservation any more."""
        self.prefill = self.kv = None
        self.reserved[decode, self.request_id] = True

    def decoding(self, rec: InstanceRecord, prompt_tokens: int, generated: int = 1) -> RunningDecode:
        """It decodes on ``rec`` (``generated``: tokens it has already, from a prefill
        elsewhere); the entry counts the tokens that stream back."""
        entry = RunningDecode(time.monotonic(), prompt_tokens, generated)
        self.decode = (rec, entry)
        return entry

    def first_token(self) -> None:
        """The instance that runs the whole request sent its first token: its prefill is over."""
        self.prefill = None

    def finished(self) -> None:
        """It ended where it decoded, by itself: nothing there to abort."""
        if self.decode is not None:
            self.reserved.pop((self.decode[0], self.request_id), None)
        self.decode = None

    def forget(self, rec: InstanceRecord) -> None:
        """``rec`` restarted: whatever it held of the request is gone with it."""
        if self.prefill is not None and self.prefill[0] is rec:
            self.prefill = None
        if self.kv is not None and self.kv[0] is rec:
            self.kv = None
        if self.decode is not None and self.decode[0] is rec:
            self.decode = None
        self.reserved = {(at, key): done for (at, key), done in self.reserved.items() if at is not rec}

    def close(self) -> dict[tuple[InstanceRecord, str], bool]:
        """End every step. Returns what instances may still hold of the request (a
        reservation, a queued prefill, a running decode) as {(instance, id): writes done}, to
        abort there; ``writes done`` is False for a reservation whose KV may still be arriving."""
        holds = dict(self.reserved)
        for step in (self.prefill, self.decode):
            if step is not None:
                holds.setdefault((step[0], self.request_id), True)
        self.prefill = self.kv = self.decode = None
        self.reserved = {}
        self.closed = True
        return holds


class RequestMoved(Exception):
    """The request cannot go on where it runs, through no fault of its own: the Conductor places
    it again (with the tokens already streamed as part of its prompt). ``role``: the role of the
    instance it lost, to name in the client's error once it cannot move any more."""

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(reason)
        self.role = role


@dataclass
class Counters:
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    migrations: int = 0
    migrated_blocks: int = 0
    decode_retries: int = 0  # a decode instance was full (507) and the next one was tried
    moved: int = 0  # requests placed again after they lost their instance or reservation
    moved_waits: int = 0  # tries of a moved request that found no room (it waited and tried again)
    local_prefills: int = 0  # requests prefilled on their decode instance (PlacementConfig.local_prefill)
    per_reason: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def reject(reason: str, retry_after_s: float) -> EngineOverloaded:
        """The refusal for ``reason``; counted once it reaches the client (``refused``): a moved
        request waits instead (``Conductor.generate``)."""
        return EngineOverloaded(reason, retry_after=max(1.0, retry_after_s))

    def refused(self, e: EngineOverloaded) -> None:
        self.rejected += 1
        kind = str(e).split(":")[0]  # "overloaded", not every predicted load figure
        self.per_reason[kind] = self.per_reason.get(kind, 0) + 1


class RequestFlow:
    def __init__(self, client: InstanceClient, registry: Registry, counters: Counters,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self._client = client
        self._registry = registry
        self._counters = counters
        self._spawn = spawn
        # The reservations granted for requests on their way to decode, each with when it was
        # granted and the event set when its renewal says it is gone (``reservations_gone``).
        self._granted: dict[str, tuple[float, asyncio.Event]] = {}

    def reservations_gone(self, rids: list[str], asked_at: float) -> int:
        """A renewal sent at ``asked_at`` (monotonic) answered that the instance no longer holds
        these reservations: each request whose reservation was granted before that (one granted
        since may not have reached the renewal) stops its prefill at once and moves. Returns how
        many it stopped."""
        stopped = 0
        for rid in rids:
            granted = self._granted.get(rid)
            if granted is not None and granted[0] < asked_at and not granted[1].is_set():
                granted[1].set()
                stopped += 1
        return stopped

    # -- the disaggregated path ----------------------------------------------------------------------
    async def disaggregated(self, rid: str, ids: list[int], params: SamplingParams, session: SessionHint | None,
                            booking: Booking, prefill: InstanceRecord, source: InstanceRecord | None,
                            prefix_tokens: int, decodes: list[InstanceRecord]) -> AsyncIterator[RequestOutput]:
        """``decodes``: in order of preference; ``source``: the holder of a prefix to pull first;
        ``session``: the client's hint, which every instance the request runs on retains by."""
        with self._settled(rid, booking):
            decode, dest = await self._reserve(rid, ids, params, session, decodes, booking)
            self._counters.accepted += not booking.moved
            if source is not None and source is not prefill:
                await self._migrate(rid, ids, params.cache_salt, prefix_tokens, source, prefill, booking)
            booking.writable(decode)
            # Noted after the grant: a renewal sent before now may not have seen it.
            lapsed = asyncio.Event()
            self._granted[rid] = (time.monotonic(), lapsed)
            try:
                first = await self._client.prefill(prefill.url, rid, ids, params, session, dest, prefill.lost,
                                                   decode.lost, lapsed)
            except (UnknownReservation, KVWriteFailed) as e:
                # The decode side lost the reservation (it lapsed while that instance stalled, and
                # its renewal said so) or could not be written: the prefill instance is fine, the
                # request moves.
                raise RequestMoved("decode", f"prefill on {prefill.url}: {e}") from None
            except ProtocolError as e:
                raise self._failed(prefill, "prefill", e) from None
            finally:
                self._granted.pop(rid, None)
            booking.prefilled(decode)
            handoff = first.finish_reason == "handoff"
            if handoff:
                first.finished, first.finish_reason = False, None
            # else: done at its first token; closing the booking releases the reservation
            sampler_state, first.sampler_state = first.sampler_state, None
            yield first
            if not handoff:
                return
            body = GenerateRequest(rid, ids, params,
                                   Prefilled(first.new_token_ids[0], first.num_cached_tokens, sampler_state), session)
            entry = booking.decoding(decode, len(ids))
            async for out in self._relay(decode, body, entry):
                yield out
            booking.finished()

    async def _reserve(self, rid: str, ids: list[int], params: SamplingParams, session: SessionHint | None,
                       decodes: list[InstanceRecord], booking: Booking) -> tuple[InstanceRecord, ReserveReply]:
        full = []
        for rec in decodes:
            # Noted before the call: if it times out, the instance may still have granted it.
            booking.reserving(rec)
            try:
                dest = await self._client.reserve(rec.url, rid, ids, params, session)
            except NoKVRoom:
                booking.no_room(rec)
                full.append(rec)
                self._counters.decode_retries += 1
                continue
            except InstanceUnavailable as e:
                self._unavailable(rec, "reserve", e)
                continue
            except BadRequest:
                raise  # the same request is bad on every instance
            except RequestError as e:
                log.info("reserve on %s refused: %s", rec.url, e)
                continue
            # The KV is headed here, not to the planned instance, if that one was full.
            if rec is not decodes[0]:
                booking.kv_moved(rec, len(ids))
            return rec, dest
        if full:
            raise self._counters.reject(f"no decode instance has room for the KV ({len(full)} full)", 1.0)
        raise RequestMoved("decode", "no decode instance answered a reservation")

    async def _migrate(self, rid: str, ids: list[int], salt: str | None, prefix_tokens: int, source: InstanceRecord,
                       target: InstanceRecord, booking: Booking) -> None:
        """Hot-spot replication: copy the prefix blocks (cached under ``salt``) the placement pulls
        from ``source`` into ``target``'s cache over the Messenger before the prefill there. A failure only costs
        recomputing that prefix."""
        block_size = target.layout.block_size
        prefix = ids[: prefix_tokens // block_size * block_size]
        if not prefix:
            return
        mid = f"{rid}:migrate"
        booking.reserving(target, mid)
        try:
            dest = await self._client.reserve(target.url, mid, prefix, SamplingParams(max_tokens=1, cache_salt=salt))
            booking.writable(target, mid)  # the push may write into it
            ok = True
            try:
                await self._client.push(source.url, mid, prefix, dest, salt)
            except ProtocolError as e:
                log.info("migration from %s to %s failed: %s", source.url, target.url, e)
                ok = False
            adopted = await self._client.adopt(target.url, mid, ok)
            booking.released(target, mid)  # adopted or dropped there
            if ok:
                self._counters.migrations += 1
                self._counters.migrated_blocks += adopted and dest.num_blocks
        except ProtocolError as e:
            log.info("migration to %s skipped: %s", target.url, e)

    # -- the colocated path ---------------------------------------------------------------------------
    async def colocated(self, rid: str, ids: list[int], params: SamplingParams, session: SessionHint | None,
                        booking: Booking, rec: InstanceRecord) -> AsyncIterator[RequestOutput]:
        self._counters.accepted += not booking.moved
        body = GenerateRequest(rid, ids, params, session=session)
        entry = booking.decoding(rec, len(ids), generated=0)
        with self._settled(rid, booking):
            async for out in self._relay(rec, body, entry):
                booking.first_token()
                yield out
            booking.finished()

    # -- shared ---------------------------------------------------------------------------------------
    async def _relay(self, rec: InstanceRecord, body: GenerateRequest, entry: RunningDecode) -> AsyncIterator[RequestOutput]:
        async with aclosing(self._client.generate(rec.url, body, rec.lost)) as stream:
            while True:
                try:
                    out = await anext(stream)
                except StopAsyncIteration:
                    return
                except ProtocolError as e:
                    raise self._failed(rec, "decode", e) from None
                entry.generated += len(out.new_token_ids)
                yield out

    def _failed(self, rec: InstanceRecord, what: str, e: ProtocolError) -> Exception:
        """What becomes of the request for ``e``: a bad request ends (400), one that failed
        inside the engine alone ends (500), a busy instance refuses it (429); anything else moves
        it (``RequestMoved``), and only an unhealthy instance is marked down on the way."""
        if isinstance(e, BadRequest):
            return e
        if isinstance(e, RequestFailed):
            # Its own fault, found by the engine stepping without it: moved, it would fail there too.
            self._counters.failed += 1
            return EngineRequestFailed(f"the request failed on the {rec.role} instance: {e}")
        if isinstance(e, InstanceBusy):
            return self._counters.reject(f"overloaded: the {rec.role} instance has too much waiting", e.retry_after)
        if isinstance(e, InstanceUnavailable):
            self._unavailable(rec, what, e)
        # The server's log keeps the cause: e.g. that a prefill group lost a pipeline stage.
        log.warning("%s on %s failed, moving the request: %s", what, rec.url, e)
        return RequestMoved(rec.role or "instance", f"{what} on {rec.url}: {e}")

    def _unavailable(self, rec: InstanceRecord, what: str, e: InstanceUnavailable) -> None:
        """No answer (or a wrong one) from ``rec``: down, unless the call only timed out; then a
        poll decides (``Registry.suspect``), for a busy instance is slow, not dead."""
        if isinstance(e, TimedOut):
            self._registry.suspect(rec, f"{what}: {e}")
        else:
            self._registry.mark_down(rec, f"{what}: {e}")

    @contextmanager
    def _settled(self, rid: str, booking: Booking) -> Iterator[None]:
        """However the request ends here (cancellation and moves included), abort what
        instances may still hold of it, each abort a task of its own."""
        try:
            yield
        finally:
            for (rec, key), writes_done in booking.close().items():
                self._spawn(self.abort_on(rec, key, writes_done))

    async def abort_on(self, rec: InstanceRecord, key: str, writes_done: bool = True) -> None:
        try:
            await self._client.abort(rec.url, key, writes_done)
        except BadRequest as e:
            log.warning("abort of %s on %s refused: %s", key, rec.url, e)
        except ProtocolError as e:
            # Unanswered: the instance's lease on the reservation runs out by itself.
            log.info("abort of %s on %s failed: %s", key, rec.url, e)

