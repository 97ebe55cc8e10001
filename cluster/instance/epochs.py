"""Which epoch of each Conductor an instance takes: the one its claim in etcd carries.

Every control call names its Conductor and that Conductor's epoch (``cluster.protocol.Fence``),
signed with the Conductors' key. Any holder of that key could name *another* Conductor's id with
an epoch far ahead (one such call used to lock that Conductor out of the instance until the
instance restarted), and a Conductor restarted on an etcd rebuilt or restored from a snapshot
got an epoch lower than its last one (the instances answered 409 and it marked them all down).

So an instance that has the membership store (``--etcd``) takes an epoch only from the identity
it belongs to, as the store says: the epoch in ``members/conductors/<id>``, whose record is signed
with the membership key (``cluster.metadata.membership.conductor_epoch``). An id with a claim
is held to it: another epoch is refused (``WrongEpoch``) however large, and the claim's epoch is
taken even when it is lower than one seen before (the store was rebuilt, the claim is the truth:
the earlier incarnation's reservations are released as on any restart). The store is read only
when a call brings an epoch other than the one last confirmed for its id, once per id at a time,
and not more than once per ``refresh_s`` per id (a caller sending made-up epochs costs the store
little).

Where no claim says anything (an instance without the store, a Conductor without etcd, a claim
record not yet written or failing its MAC, or the store unreachable, which is logged), epochs are
ordered as before (``Receiver.observe``: a newer one replaces, an older one is refused), and an
epoch ahead of this host's clock in nanoseconds by more than ``max_ahead_s`` is refused: a start
time cannot be in the future, and a revision is far below any clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from cluster.metadata import MetadataStore, MetadataUnavailable
from cluster.metadata.membership import conductor_epoch
from cluster.protocol import Fence, WrongEpoch

log = logging.getLogger(__name__)


class Epochs:
    def __init__(self, store: MetadataStore | None, key: bytes, refresh_s: float = 1.0, max_ahead_s: float = 60.0,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        """``store``: the membership store (None: no claims to check); ``key``: the membership key."""
        self._store, self._key = store, key
        self.refresh_s, self.max_ahead_s = refresh_s, max_ahead_s
        self._clock_ns = clock_ns
        self._confirmed: dict[str, int] = {}  # the epoch each id's claim carried when last read
        self._read: dict[str, tuple[float, int | None]] = {}  # when each id's claim was read, and its epoch
        self._reading: dict[str, asyncio.Lock] = {}
        self.refused = 0  # calls refused: an epoch their Conductor's claim does not carry, or in the future
        self._store_down_logged = False

    async def check(self, fence: Fence) -> bool:
        """Whether ``fence``'s epoch is the one its Conductor's claim carries (True), or no claim
        says anything (False: ``Receiver.observe`` orders it); ``WrongEpoch`` when a claim carries
        another, or the epoch is ahead of this host's clock."""
        if self._confirmed.get(fence.conductor) == fence.epoch:
            return True
        claimed = await self._claimed(fence.conductor)
        if claimed is None:
            if fence.epoch > self._clock_ns() + int(self.max_ahead_s * 1e9):
                self.refused += 1
                raise WrongEpoch(f"Conductor {fence.conductor!r}'s epoch {fence.epoch} is ahead of this host's "
                                 f"clock, and no claim in the membership store carries it")
            return False
        if claimed != fence.epoch:
            self.refused += 1
            raise WrongEpoch(f"Conductor {fence.conductor!r}'s claim carries epoch {claimed}, not {fence.epoch} "
                             "(an earlier incarnation, or an epoch made up)")
        self._confirmed[fence.conductor] = claimed
        return True

    async def _claimed(self, conductor: str) -> int | None:
        if self._store is None:
            return None
        lock = self._reading.setdefault(conductor, asyncio.Lock())
        async with lock:  # one read per id at a time; those waiting take its answer
            read = self._read.get(conductor)
            if read is not None and time.monotonic() - read[0] < self.refresh_s:
                return read[1]
            loop = asyncio.get_running_loop()
            try:
                claimed = await loop.run_in_executor(None, conductor_epoch, self._store, self._key, conductor)
            except MetadataUnavailable as e:
                if not self._store_down_logged:
                    log.warning("cannot read Conductor %r's claim (%s): its epochs are taken by their order "
                                "until the store answers", conductor, e)
                    self._store_down_logged = True
                return None
            self._store_down_logged = False
            self._read[conductor] = (time.monotonic(), claimed)
            return claimed
