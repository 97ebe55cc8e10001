"""Which epoch of a Conductor an instance takes (``cluster.instance.epochs``, issue 40 item 3): the
one its claim in the membership store carries, signed; a made-up epoch, however large, is refused;
a store rebuilt or restored from a snapshot keeps a running Conductor's epoch and takes a
restarted one's lower epoch. On ``LocalMetadata`` with short TTLs; ``Rebuildable`` stands for an
etcd replaced under the same address."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from cluster.instance.epochs import Epochs
from cluster.metadata import MetadataUnavailable
from cluster.metadata.local import LocalMetadata
from cluster.metadata.membership import CONDUCTORS, claim_conductor, conductor_epoch
from cluster.protocol import MEMBERSHIP, Fence, WrongEpoch, derive_key

TTL_S = 0.3
KEY = derive_key(b"s" * 32, MEMBERSHIP)


class Rebuildable:
    """A store whose backing can be replaced, as an etcd rebuilt empty or restored from a snapshot
    behind the same URL; ``down`` makes every call fail as an unreachable store's."""

    def __init__(self) -> None:
        self.now, self.down, self.reads = LocalMetadata(), False, 0

    def __getattr__(self, name: str):
        if self.down:
            raise MetadataUnavailable("the store does not answer")
        if name == "get":
            self.reads += 1
        return getattr(self.now, name)


def _until(condition, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _writes(store, n: int) -> None:
    for k in range(n):  # revisions go by
        store.put(f"filler/{k}", "x")


def test_a_claim_carries_its_epoch_signed_and_a_forged_one_says_nothing():
    store = LocalMetadata()
    _writes(store, 5)
    claim, epoch = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S)
    try:
        assert epoch == 6 and conductor_epoch(store, KEY, "c1") == 6
        assert conductor_epoch(store, KEY, "c2") is None  # unclaimed
        assert conductor_epoch(store, derive_key(b"t" * 32, MEMBERSHIP), "c1") is None  # another cluster's key
        record = json.loads(store.get(CONDUCTORS + "c1"))
        for forged in ({**record, "epoch": 2**62}, {"url": record["url"], "epoch": 7}, {**record, "epoch": "6"}):
            store.put(CONDUCTORS + "c1", json.dumps(forged))
            assert conductor_epoch(store, KEY, "c1") is None, forged
        store.put(CONDUCTORS + "c1", "not json")
        assert conductor_epoch(store, KEY, "c1") is None
    finally:
        claim.close()


def test_an_instance_takes_only_the_epoch_the_claim_carries():
    store = Rebuildable()
    _writes(store, 40)
    claim, epoch = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S)
    epochs = Epochs(store, KEY, refresh_s=0.2)

    async def run() -> None:
        assert await epochs.check(Fence("c1", epoch)) is True
        reads = store.reads
        for _ in range(5):  # confirmed: the store is not read again
            assert await epochs.check(Fence("c1", epoch))
        assert store.reads == reads
        # The issue's lock-out: any holder of the Conductors' key naming c1 with a huge epoch.
        for made_up in (2**62, epoch + 1, epoch - 1):
            with pytest.raises(WrongEpoch, match="claim carries"):
                await epochs.check(Fence("c1", made_up))
        assert epochs.refused == 3
        assert store.reads == reads  # within refresh_s of the last read, made-up epochs cost none
        await asyncio.sleep(0.25)
        with pytest.raises(WrongEpoch):
            await epochs.check(Fence("c1", 2**62))
        assert store.reads == reads + 1
        # An id nobody claimed: ordered by the receiver, but never ahead of this host's clock.
        assert await epochs.check(Fence("c9", time.time_ns())) is False
        with pytest.raises(WrongEpoch, match="ahead of this host's clock"):
            await epochs.check(Fence("c9", 2**62))
        # The store unreachable: a confirmed epoch goes on; a new one is ordered by the receiver.
        store.down = True
        assert await epochs.check(Fence("c1", epoch)) is True
        await asyncio.sleep(0.25)
        assert await epochs.check(Fence("c1", epoch + 5)) is False
        store.down = False

    try:
        asyncio.run(run())
    finally:
        claim.close()


def test_a_rebuilt_store_keeps_a_running_conductors_epoch_and_takes_a_restarted_ones_lower(caplog):
    store = Rebuildable()
    _writes(store, 40)
    claim, epoch = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S)
    epochs = Epochs(store, KEY, refresh_s=0.0)
    try:
        assert asyncio.run(epochs.check(Fence("c1", epoch)))
        # etcd rebuilt empty: the claim's keeper finds its lease gone and writes the record again,
        # epoch and all, though the new store's revisions are far below it.
        store.now = LocalMetadata()
        _until(lambda: conductor_epoch(store, KEY, "c1") == epoch, 10 * TTL_S)
        assert not claim.lost.is_set()
        assert asyncio.run(epochs.check(Fence("c1", epoch)))
        # The Conductor restarts on it: its new claim is at a lower revision, and is taken.
        claim.close()
        restarted, lower = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S)
        try:
            assert lower < epoch
            assert asyncio.run(epochs.check(Fence("c1", lower))) is True
            with pytest.raises(WrongEpoch):  # the incarnation before it, paused and resumed
                asyncio.run(epochs.check(Fence("c1", epoch)))
        finally:
            restarted.close()
    finally:
        claim.close()


def test_a_claim_restored_under_a_predecessors_record_is_written_once_that_lapses(caplog):
    store = Rebuildable()
    claim, epoch = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S)
    try:
        # Restored from a snapshot taken before this claim: a predecessor's record, whose lease
        # nobody renews any more, holds the key for a while.
        snapshot = LocalMetadata()
        lapsing = snapshot.grant_lease(4 * TTL_S)
        snapshot.put(CONDUCTORS + "c1", '{"url": "http://h:8000", "epoch": 1, "mac": "00"}', lapsing)
        with caplog.at_level(logging.ERROR, logger="cluster.metadata.membership"):
            store.now = snapshot
            _until(lambda: conductor_epoch(store, KEY, "c1") == epoch, 2 * TTL_S + 1 + 10 * TTL_S)
        assert not claim.lost.is_set() and "giving it up" not in caplog.text
    finally:
        claim.close()
