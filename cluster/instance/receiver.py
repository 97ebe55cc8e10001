"""Reservations: the blocks and receive staging an instance holds for KV another instance sends.

A decode instance reserves for a prompt's KV before its prefill starts (a prefill instance, for
a hot prefix pulled from another one). A reservation is a **lease**: the Conductor that made it
renews it while the request is in flight (``renew``); one that is neither taken over nor renewed
within ``lease_s`` is released, so a Conductor that died or lost track cannot leak blocks. Each
reservation carries the fence of the Conductor that made it (``cluster.protocol.Fence``: its id
and epoch); several Conductors reserve here side by side, and when one of them shows up with a
newer epoch (it restarted, ``observe``; or one its claim in etcd carries,
``cluster.instance.epochs``), that id's older reservations are released at once, the others'
untouched.

The record of a reservation is kept until its take-over has run on the engine thread
(``take_over``): a failure before that (the stream never started, the engine refused) leaves it
to ``release`` or expiry, never leaked. Receive staging that a sender may still be writing into
(anything not known to be ``settled``) is reused only after twice the transfer timeout.

A late write cannot corrupt: the receive staging is guarded, each reservation's
range is opened under a fresh generation (``KVDestination.generation``) and closed the moment the
reservation ends (released, expired, or taken over), so the Messenger refuses a write for it from
then on; the range also holds a checksum per layer (written by the sender), verified before the
blocks are admitted (``take_over``): a mismatch refuses the request (``KVWriteFailed``) and its
blocks never reach the prefix cache. Ids released before they were reserved (an abort that
overtook its request) are remembered for ``lease_s`` (``aborted``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from cluster.failpoints import FAILPOINTS, LAPSE_AFTER_S
from cluster.kv_stream import KVDestination, sums_bytes, verify_layers
from cluster.protocol import BadRequest, Fence, KVWriteFailed, NotOwner, UnknownReservation, WrongEpoch
from cluster.messenger.staging import StagingArea, StagingFull, StagingRange
from engine.async_engine import AsyncLLMEngine
from engine.disaggregation import KVCapacityError, KVHandoff
from engine.kv_layout import KVLayout
from engine.sampling_params import SamplingParams
from engine.session import SessionHint

log = logging.getLogger(__name__)

T = TypeVar("T")

REPLACED = "replaced its earlier epoch"  # in the log line of a Conductor's restart (bench.chaos counts them)


@dataclass
class _Lease:
    staging: StagingRange | None
    num_blocks: int  # blocks the sender writes
    fence: Fence
    expires: float
    prompt: list[int]
    salt: str | None  # the cache salt its KV is keyed under (``SamplingParams.cache_salt``)


def _owned(request_id: str, lease: _Lease | None, fence: Fence | None) -> None:
    """``NotOwner`` unless the reservation (if any) is ``fence``'s Conductor's (None: anyone's)."""
    if lease is not None and fence is not None and lease.fence.conductor != fence.conductor:
        raise NotOwner(f"the reservation for {request_id!r} is Conductor {lease.fence.conductor!r}'s, "
                       f"not {fence.conductor!r}'s")


class Receiver:
    def __init__(self, client: AsyncLLMEngine, handoff: KVHandoff, staging: StagingArea, address: str,
                 lease_s: float, transfer_timeout_s: float) -> None:
        self._client = client
        self._handoff = handoff
        self.staging = staging
        staging.guard()  # writes only into a current reservation's range, naming its generation
        self._address = address
        self._layout: KVLayout = handoff.layout
        self.lease_s = lease_s
        self._transfer_timeout_s = transfer_timeout_s
        self.epochs: dict[str, int] = {}  # the epoch of each Conductor id taken here (``observe``)
        # Touched from the event loop and (take-over) the engine thread.
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        # Ids released recently, with the Conductor id that released them (None: this instance,
        # at expiry): an abort can overtake the reserve it answers (the Conductor gave up waiting
        # for it), and that late reserve must not be granted to nobody. Another Conductor's
        # abort of an id does not refuse its owner's reserve.
        self._released: dict[str, tuple[float, str | None]] = {}
        self._lapsing: set[asyncio.Task] = set()  # releases the ``reserve.lapse`` failpoint started

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def incoming(self) -> dict[str, list[int]]:
        """The reservations held here (their KV not taken over yet), as their prompts' lengths
        by the id of the Conductor that made them."""
        with self._lock:
            prompts: dict[str, list[int]] = {}
            for lease in self._leases.values():
                prompts.setdefault(lease.fence.conductor, []).append(len(lease.prompt))
            return prompts

    def aborted(self, request_id: str) -> bool:
        """Whether ``request_id`` was released (aborted) lately, perhaps before this instance had
        seen it: a prefill or push for it that arrives now comes too late."""
        with self._lock:
            released = self._released.get(request_id)
            return released is not None and time.monotonic() - released[0] <= self.lease_s

    def check_owner(self, request_id: str, fence: Fence) -> None:
        """``NotOwner`` when ``request_id``'s reservation here was made by another Conductor than
        ``fence``'s: only its owner aborts, releases, adopts or continues it. (Its owner never
        changes: a request id is its Conductor's.)"""
        with self._lock:
            _owned(request_id, self._leases.get(request_id), fence)

    def _aborted_by(self, request_id: str, fence: Fence) -> bool:
        released = self._released.get(request_id)
        return released is not None and released[1] in (None, fence.conductor)

    def _nbytes(self, num_blocks: int) -> int:
        """A reservation's receive range: its KV, then a checksum per layer."""
        return self._layout.nbytes(num_blocks) + sums_bytes(self._layout.num_layers)

    def prompt(self, request_id: str) -> tuple[list[int], str | None] | None:
        """The prompt a reservation holds blocks for and its cache salt (None without a reservation)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return None if lease is None else (lease.prompt, lease.salt)

    # -- making and keeping -------------------------------------------------------------------------
    async def reserve(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      fence: Fence, session: SessionHint | None = None) -> KVDestination:
        """Hold blocks and a staging range; raises ``KVCapacityError`` (no room now),
        ``ValueError`` (never servable, or the id is taken: ``BadRequest``), ``UnknownReservation``
        (aborted meanwhile) or ``WrongEpoch``."""
        await self.observe(fence)
        self.check_current(fence)
        if request_id in self._leases:
            raise BadRequest(f"request {request_id!r} already holds a reservation")
        if self._aborted_by(request_id, fence):
            raise UnknownReservation(f"request {request_id!r} was aborted")
        res = await self._client.call(lambda e: self._handoff.reserve(request_id, token_ids, params, session))
        n = res.num_sent_blocks
        staging = None
        if n:
            try:
                staging = self.staging.allocate(self._nbytes(n), owner=request_id)
            except (StagingFull, ValueError) as e:
                await self._drop(request_id)
                raise KVCapacityError(f"receive staging: {e}") from None
        with self._lock:
            # While the engine thread was reserving, the request may have been aborted or a newer
            # Conductor may have released this one's reservations: then nobody would take it over.
            aborted = self._aborted_by(request_id, fence)
            stale = fence.epoch != self.epochs[fence.conductor]
            if not (aborted or stale):
                self._leases[request_id] = _Lease(staging, n, fence, time.monotonic() + self.lease_s, token_ids,
                                                  params.cache_salt)
        if aborted or stale:
            try:
                await self._drop(request_id)
            finally:
                if staging is not None:
                    self.staging.release(staging)  # nothing was told where it is: nobody writes there
            if stale:
                raise WrongEpoch(f"Conductor {fence.conductor!r}'s epoch {fence.epoch} was replaced by "
                                 f"{self.epochs[fence.conductor]} while reserving")
            raise UnknownReservation(f"request {request_id!r} was aborted")
        if FAILPOINTS.fire("reserve.lapse"):
            asyncio.get_running_loop().call_later(LAPSE_AFTER_S, self._lapse, request_id)
        return KVDestination(self._address, self.staging.handle, staging.offset if staging else 0,
                             res.cached_blocks, n, staging.generation if staging else None, sums=True)

    def renew(self, request_ids: list[str], fence: Fence) -> list[str]:
        """Extend the leases of ``request_ids`` that ``fence``'s Conductor holds; returns the
        others (not held here, or by another Conductor or incarnation)."""
        until = time.monotonic() + self.lease_s
        gone = []
        with self._lock:
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is None or lease.fence != fence:
                    gone.append(rid)
                else:
                    lease.expires = until
        return gone

    async def observe(self, fence: Fence, confirmed: bool = False) -> None:
        """Note a call's fence: a Conductor seen with another epoch restarted, and what its
        earlier incarnation reserved will never be taken over. Epochs are ordered (an older one
        changes nothing, and ``check_current`` refuses it) unless ``confirmed``: the Conductor's
        claim in the membership store carries this one (``cluster.instance.epochs``), which then
        replaces the one seen before even when it is lower (the store was rebuilt)."""
        old = self.epochs.get(fence.conductor)
        if old is not None and (fence.epoch == old or (fence.epoch < old and not confirmed)):
            return
        self.epochs[fence.conductor] = fence.epoch
        with self._lock:
            stale = [rid for rid, lease in self._leases.items()
                     if lease.fence.conductor == fence.conductor and lease.fence.epoch != fence.epoch]
        if stale:
            log.warning("Conductor %r's epoch %d %s %d: releasing its %d reservation(s)", fence.conductor,
                        fence.epoch, REPLACED, old, len(stale))
        for rid in stale:
            await self.release(rid, settled=False)

    def check_current(self, fence: Fence) -> None:
        """``WrongEpoch`` unless ``fence`` is its Conductor's incarnation taken here (after
        ``observe``)."""
        current = self.epochs[fence.conductor]
        if fence.epoch != current:
            raise WrongEpoch(f"Conductor {fence.conductor!r}'s epoch {fence.epoch} was replaced by {current}: "
                             "it was restarted since")

    # -- ending -------------------------------------------------------------------------------------
    def take_over(self, engine_side: Callable[[KVHandoff, torch.Tensor | None], T], request_id: str) -> Callable[[object], T]:
        """A function to run on the engine thread (``AsyncLLMEngine.call`` or ``stream``): it
        claims the reservation and gives ``engine_side`` the handoff and the received KV (a view
        of the staging; None when every block was cached here). The staging is freed afterwards;
        the handoff releases the blocks itself if ``engine_side`` fails."""

        def run(_engine: object) -> T:
            with self._lock:
                lease = self._leases.pop(request_id, None)
            if lease is None:
                raise UnknownReservation(f"no KV reservation for {request_id!r} (released or expired)")
            try:
                kv = None
                if lease.staging is not None:
                    # No write for this reservation lands from now on; what did is checked.
                    self.staging.revoke(lease.staging)
                    kv = self._received(request_id, lease)
                return engine_side(self._handoff, kv)
            except KVWriteFailed:
                self._handoff.drop(request_id)
                raise
            finally:
                if lease.staging is not None:
                    self.staging.release(lease.staging)

        return run

    def _received(self, request_id: str, lease: _Lease) -> torch.Tensor:
        """The reservation's KV, once each layer matched its checksum (raises ``KVWriteFailed``)."""
        n, layout = lease.num_blocks, self._layout
        kv_range = StagingRange(lease.staging.offset, layout.nbytes(n))
        kv = self.staging.view(kv_range, layout.torch_dtype, layout.shape(n))
        sums = self.staging.view(StagingRange(kv_range.offset + kv_range.nbytes, sums_bytes(layout.num_layers)),
                                 torch.uint8, (sums_bytes(layout.num_layers),))
        bad = verify_layers(kv, sums, lease.staging.generation)
        if bad is not None:
            log.warning("refusing the KV of %s: layer %d does not match its checksum", request_id, bad)
            raise KVWriteFailed(f"the KV received for {request_id!r} is corrupt (layer {bad} does not match its checksum)")
        return kv

    async def release(self, request_id: str, settled: bool, fence: Fence | None = None) -> bool:
        """Release a reservation not taken over (idempotent; False if there was none). Its
        staging is reused at once only when ``settled`` (the sender is done writing). ``fence``:
        the Conductor that asks (``NotOwner`` if the reservation is another's); None: this
        instance itself (an expiry)."""
        now = time.monotonic()
        with self._lock:
            _owned(request_id, self._leases.get(request_id), fence)
            lease = self._leases.pop(request_id, None)
            self._released[request_id] = (now, None if fence is None else fence.conductor)
            for rid in [r for r, (t, _) in self._released.items() if now - t > self.lease_s]:
                del self._released[rid]
        if lease is None:
            return False
        if lease.staging is not None:
            self.staging.revoke(lease.staging)  # a write for it still on its way is refused
        try:
            await self._drop(request_id)
        finally:
            # Popped, the lease is this call's alone to free, even if the call is cancelled.
            if lease.staging is not None and settled:
                self.staging.release(lease.staging)
            elif lease.staging is not None:
                # A prefill that was cut off (but maybe not dead) could still be writing into it: a
                # sender starts no write later than one transfer timeout after it was told where
                # (``KVSender.write_window_s``), and a write fails after one more.
                asyncio.get_running_loop().call_later(2 * self._transfer_timeout_s, self.staging.release, lease.staging)
        return True

    async def _drop(self, request_id: str) -> None:
        """Let go of the request's blocks on the engine thread. Shielded: a cancelled caller must
        not leave them reserved (the engine thread skips a call whose caller gave up)."""
        await asyncio.shield(self._client.call(lambda _: self._handoff.drop(request_id)))

    async def expire_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.lease_s / 4))
            now = time.monotonic()
            with self._lock:
                expired = [rid for rid, lease in self._leases.items() if lease.expires < now]
            for rid in expired:
                await self._expire(rid)

    async def _expire(self, request_id: str) -> None:
        log.warning("releasing reservation %s: its lease was not renewed for %.1f s", request_id, self.lease_s)
        try:
            await self.release(request_id, settled=False)
        except Exception:  # noqa: BLE001 -- the engine stopped; nothing left to free
            log.exception("releasing reservation %s failed", request_id)

    def _lapse(self, request_id: str) -> None:
        """The ``reserve.lapse`` failpoint: the lease runs out now, as if nobody had renewed it."""
        if request_id in self._leases:
            task = asyncio.get_running_loop().create_task(self._expire(request_id))
            self._lapsing.add(task)  # held until done: the loop keeps only a weak reference
            task.add_done_callback(self._lapsing.discard)
