"""Regression tests for the cluster races fixed in issue 11 §3, without processes.

* the prefix cache reports changes since a version (``BlockPool.changes_since``), and the
  instance's ``CacheMirror`` answers a poller at any version with what, applied by the Registry's
  rule, rebuilds the current key set;
* reservations are leases (``Receiver``): expire unless renewed, die with an older Conductor
  epoch, and an abort that overtakes its reserve (a tombstone) leaves nothing held;
* the Conductor's ledger rolls back every entry of a request (``Booking.close``), and a burst of
  decisions sees each earlier one's booking, so it spreads over the prefill instances instead of
  piling onto the one that last looked idle.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
import random
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

import cluster.conductor.conductor as conductor_module
import cluster.instance.cache_mirror as cache_mirror_module
import paged_kv.block_pool as block_pool_module
from cluster.policies.cost_model import InstanceProfile
from cluster.conductor.conductor import Conductor, ConductorConfig
from cluster.conductor.placement import PlacementConfig
from cluster.conductor.client import InstanceClient
from cluster.conductor.ledger import Ledger
from cluster.conductor.placement import Placement, Placer
from cluster.conductor.registry import InstanceRecord, Registry
from cluster.policies.cost_model import DecodeStepModel, PrefillCostModel
from cluster.instance.cache_mirror import CacheMirror
from cluster.instance.receiver import Receiver
from cluster.protocol import CacheDelta, Fence, InstanceInfo, InstanceState, WrongEpoch
from cluster.policies.snapshot import RequestInfo
from cluster.protocol import output_to_dict
from engine.disaggregation import KVHandoff
from engine.engine_client import EngineOverloaded
from engine.kv_layout import KVLayout
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from paged_kv.block_pool import BlockPool
from tests.decode_side import tiny_decode_side
from tests.signed_answers import signed_transport

SECRET = b"cluster units test secret 0123"


# -- BlockPool.changes_since ---------------------------------------------------------------------------

class _PoolDriver:
    """Random allocations, registrations (some of a key already cached elsewhere), releases and
    evictions on a small pool."""

    def __init__(self, pool: BlockPool, seed: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.live: list[list[int]] = []
        self.next_key = 0

    def _key(self) -> bytes:
        if self.next_key and self.rng.random() < 0.2:  # a duplicate of an earlier key
            return f"key{self.rng.randrange(self.next_key)}".encode()
        self.next_key += 1
        return f"key{self.next_key - 1}".encode()

    def step(self) -> None:
        pool, rng = self.pool, self.rng
        if self.live and (rng.random() < 0.45 or pool.num_free == 0):
            pool.release(self.live.pop(rng.randrange(len(self.live))))
            return
        n = rng.randint(1, min(3, pool.num_free))
        blocks = pool.allocate(n)  # may evict cached blocks
        for b in blocks:
            if rng.random() < 0.8:
                pool.register(b, self._key())
        if rng.random() < 0.3 and self.live:  # a prefix-cache hit on some cached block
            hits = pool.lookup([k for k in list(pool.cached_keys())[:1]])
            pool.acquire(hits)
            blocks = blocks + hits
        self.live.append(blocks)


def _applied(old: set[bytes], changes: tuple[list[bytes], list[bytes]]) -> set[bytes]:
    added, removed = changes
    return (old | set(added)) - set(removed)


def test_changes_since_rebuilds_the_key_set_from_every_earlier_version():
    pool = BlockPool(12)
    driver = _PoolDriver(pool, seed=1)
    snapshots: dict[int, set[bytes]] = {pool.version: set(pool.cached_keys())}
    for _ in range(400):
        driver.step()
        snapshots[pool.version] = set(pool.cached_keys())
        pool.check_integrity()
    assert pool.num_evictions > 20 and len(snapshots) > 100  # evictions and many versions happened
    now = set(pool.cached_keys())
    for version, old in snapshots.items():
        changes = pool.changes_since(version)
        assert changes is not None, version
        assert _applied(old, changes) == now, f"changes since version {version} do not rebuild the set"
    assert pool.changes_since(pool.version) == ([], [])


def test_changes_since_across_a_reset_and_for_versions_that_are_not_ours():
    pool = BlockPool(8)
    driver = _PoolDriver(pool, seed=2)
    for _ in range(60):
        driver.step()
    before = pool.version
    assert pool.cached_keys()
    pool.reset_prefix_cache()
    # Changes from before the reset are not in the journal: the caller must take the whole set.
    assert pool.changes_since(before) is None
    assert pool.changes_since(0) is None
    assert pool.cached_keys() == []
    at_reset = pool.version
    for _ in range(60):
        driver.step()
    old = set()
    assert _applied(old, pool.changes_since(at_reset)) == set(pool.cached_keys())
    assert pool.changes_since(pool.version + 1) is None  # a version we never had
    assert pool.changes_since(-1) is None


def test_changes_since_a_version_older_than_the_journal_is_none(monkeypatch):
    monkeypatch.setattr(block_pool_module, "_JOURNAL_LEN", 16)
    pool = BlockPool(6)
    driver = _PoolDriver(pool, seed=3)
    snapshots = {pool.version: set(pool.cached_keys())}
    for _ in range(200):
        driver.step()
        snapshots[pool.version] = set(pool.cached_keys())
    assert pool.version > 40
    now = set(pool.cached_keys())
    answered = 0
    for version, old in snapshots.items():
        changes = pool.changes_since(version)
        if pool.version - version > 16:
            assert changes is None, f"version {version} is older than the journal reaches"
        else:
            assert changes is not None and _applied(old, changes) == now
            answered += 1
    assert answered >= 5


# -- CacheMirror ---------------------------------------------------------------------------------------

def _cache_report(pool: BlockPool, since: int | None):
    """``KVHandoff.cache_report`` (the real code) over a bare pool instead of a whole engine."""
    handoff = object.__new__(KVHandoff)
    handoff._engine = SimpleNamespace(block_manager=SimpleNamespace(pool=pool))
    return handoff.cache_report(since)


class _Publisher:
    """What the instance's step observer does: after each step, report the changes since the
    version last published into the mirror (a full report first)."""

    def __init__(self, pool: BlockPool, mirror: CacheMirror) -> None:
        self.pool, self.mirror = pool, mirror
        self.seen: int | None = None
        self.published: list[int] = []
        self.publish()

    def publish(self) -> None:
        report = _cache_report(self.pool, self.seen)
        if report.full is None and report.version == self.seen:
            return
        self.seen = report.version
        self.mirror.apply(report)
        self.published.append(report.version)


def _poll(mirror: CacheMirror, rec: InstanceRecord, since: int | None) -> dict:
    """One poll answered by the mirror and applied by the Registry's rule; returns the JSON."""
    state = json.loads(json.dumps(mirror.report(since).to_dict()))
    Registry._apply_cache(rec, CacheDelta.from_dict(state))
    return state


def test_cache_mirror_full_then_deltas_and_every_poller_rebuilds_the_current_set():
    pool = BlockPool(12)
    mirror = CacheMirror()
    pub = _Publisher(pool, mirror)
    assert mirror.version == pool.version and mirror.keys == set(pool.cached_keys())
    driver = _PoolDriver(pool, seed=4)
    held: dict[int, set[bytes]] = {pub.published[-1]: set(mirror.keys)}  # what a poller at v holds
    for _ in range(150):
        for _ in range(random.Random(len(held)).randint(1, 3)):  # several changes per step
            driver.step()
        pub.publish()
        assert mirror.keys == set(pool.cached_keys())
        held[mirror.version] = set(mirror.keys)
    current = set(pool.cached_keys())
    assert len(held) > 50

    # A poller at the current version gets empty changes and keeps its set.
    rec = InstanceRecord("http://x")
    rec.cached, rec.cache_version = set(current), mirror.version
    state = _poll(mirror, rec, mirror.version)
    assert "cached_keys" not in state and state["cached_added"] == [] and state["cached_removed"] == []
    assert rec.cached == current and rec.cache_version == mirror.version

    # A poller at any older published version: changes only, which rebuild the current set.
    for version, old in held.items():
        rec = InstanceRecord("http://x")
        rec.cached, rec.cache_version = set(old), version
        state = _poll(mirror, rec, version)
        assert "cached_keys" not in state, f"a poller at {version} should get changes only"
        assert rec.cached == current, f"poller at version {version}"
        assert rec.cache_version == mirror.version

    # A new poller, and one with a version this mirror never published: everything.
    for since in (None, mirror.version + 5, -3):
        rec = InstanceRecord("http://x")
        rec.cached, rec.cache_version = {b"stale"}, since
        state = _poll(mirror, rec, since)
        assert "cached_keys" in state and rec.cached == current, since


def test_cache_mirror_answers_too_old_pollers_and_a_pool_reset_with_the_whole_set(monkeypatch):
    monkeypatch.setattr(cache_mirror_module, "_HISTORY", 8)
    pool = BlockPool(10)
    mirror = CacheMirror()
    pub = _Publisher(pool, mirror)
    driver = _PoolDriver(pool, seed=5)
    held: dict[int, set[bytes]] = {mirror.version: set(mirror.keys)}
    for _ in range(40):
        driver.step()
        pub.publish()
        held[mirror.version] = set(mirror.keys)
    versions = sorted(held)
    too_old, recent = versions[0], versions[-3]
    for since, whole in ((too_old, True), (recent, False)):
        rec = InstanceRecord("http://x")
        rec.cached, rec.cache_version = set(held[since]), since
        state = _poll(mirror, rec, since)
        assert ("cached_keys" in state) == whole, since
        assert rec.cached == set(pool.cached_keys())

    # The engine's cache is reset: the next report is a full one; every older poller is answered
    # with the whole (now smaller) set, so no key survives on the Conductor's side.
    before = mirror.version
    pool.reset_prefix_cache()
    pub.publish()
    assert mirror.keys == set() and mirror.version > before
    for since in (before, recent):
        rec = InstanceRecord("http://x")
        rec.cached, rec.cache_version = set(held[since]), since
        state = _poll(mirror, rec, since)
        assert "cached_keys" in state and rec.cached == set()
    # After the reset, deltas again: a poller at the reset's version gets changes only.
    at_reset = mirror.version
    for _ in range(10):
        driver.step()
    pub.publish()
    rec = InstanceRecord("http://x")
    rec.cached, rec.cache_version = set(), at_reset
    state = _poll(mirror, rec, at_reset)
    assert "cached_keys" not in state and rec.cached == set(pool.cached_keys())


# -- Receiver: leases, epochs, tombstones ----------------------------------------------------------------

@pytest.fixture(scope="module")
def decode_engine(tmp_path_factory):
    with tiny_decode_side(tmp_path_factory.mktemp("tiny"), SECRET, "shm") as d:
        yield d


def _receiver(d, lease_s: float, transfer_timeout_s: float = 0.2) -> Receiver:
    return Receiver(d.client, d.handoff, d.staging, d.transfer.address, lease_s, transfer_timeout_s)


async def _engine_holds(d) -> tuple[int, list[str]]:
    """Blocks in use and sequences in the engine (read on the engine thread)."""
    return await d.client.call(lambda e: (e.block_manager.pool.num_in_use, list(e.seqs)))


async def _assert_nothing_held(d, r: Receiver, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        used, seqs = await _engine_holds(d)
        state = (len(r), used, seqs, d.staging.num_allocated)
        if state == (0, 0, [], 0):
            d.staging.check()
            return
        assert time.monotonic() < deadline, f"still held (leases, blocks, seqs, staging ranges): {state}"
        await asyncio.sleep(0.02)


PROMPT = list(range(10, 10 + 40))  # 3 blocks of 16: 2 full and a partial one


def _a(epoch: int) -> Fence:
    """Conductor "a" at ``epoch``."""
    return Fence("a", epoch)
PARAMS = SamplingParams(max_tokens=4)


def test_an_unrenewed_lease_is_released_with_its_blocks_and_staging(decode_engine):
    d = decode_engine

    async def scenario():
        r = _receiver(d, lease_s=0.5)
        expiry = asyncio.create_task(r.expire_forever())
        try:
            start = time.monotonic()
            dest = await r.reserve("lease-1", PROMPT, PARAMS, _a(1))
            assert dest.num_blocks == 3 and "lease-1" in r and d.staging.num_allocated == 1
            assert (await _engine_holds(d))[0] == 3
            while "lease-1" in r:
                assert time.monotonic() - start < 0.5 + 1.0, "an unrenewed lease outlived lease_s"
                await asyncio.sleep(0.02)
            assert time.monotonic() - start >= 0.45, "released before its lease ran out"
            # Blocks at once; staging after the transfer timeout (a late write may still land).
            await _assert_nothing_held(d, r, within_s=0.2 + 1.0)
        finally:
            expiry.cancel()

    asyncio.run(scenario())


def test_renewing_keeps_a_lease_and_only_for_its_own_epoch(decode_engine):
    d = decode_engine

    async def scenario():
        r = _receiver(d, lease_s=0.4)
        expiry = asyncio.create_task(r.expire_forever())
        try:
            await r.reserve("lease-2", PROMPT, PARAMS, _a(1))
            until = time.monotonic() + 1.5  # almost four leases
            while time.monotonic() < until:
                assert r.renew(["lease-2", "unknown"], _a(1)) == ["unknown"]
                await asyncio.sleep(0.1)
            assert "lease-2" in r and (await _engine_holds(d))[0] == 3
            # A renewal under another epoch does not extend it, and says it is not held for that one.
            assert r.renew(["lease-2"], _a(2)) == ["lease-2"]
            start = time.monotonic()
            while "lease-2" in r:
                assert time.monotonic() - start < 0.4 + 1.0
                await asyncio.sleep(0.02)
            assert r.renew(["lease-2"], _a(1)) == ["lease-2"]  # gone now
            await _assert_nothing_held(d, r)
        finally:
            expiry.cancel()

    asyncio.run(scenario())


def test_a_newer_epoch_releases_that_conductors_older_reservations_only(decode_engine):
    d = decode_engine

    async def scenario():
        r = _receiver(d, lease_s=30.0)  # no expiry here: only the epoch can release them
        await r.reserve("old-a", PROMPT, PARAMS, _a(5))
        await r.reserve("old-b", PROMPT[:20], PARAMS, _a(5))
        assert len(r) == 2
        await r.reserve("other-conductor", PROMPT[:20], PARAMS, Fence("b", 3))
        assert len(r) == 3
        await r.observe(_a(6))  # any call from a newer incarnation of Conductor "a"
        # Only a's: b's reservation and its renewals stand, and b's epoch is b's own.
        assert len(r) == 1 and "other-conductor" in r and r.epochs == {"a": 6, "b": 3}
        assert r.renew(["other-conductor"], Fence("b", 3)) == []
        assert r.renew(["other-conductor"], _a(6)) == ["other-conductor"]  # not a's to renew
        with pytest.raises(WrongEpoch):
            await r.reserve("b-old", PROMPT, PARAMS, Fence("b", 2))
        assert await r.release("other-conductor", settled=True) is True
        await _assert_nothing_held(d, r)
        with pytest.raises(WrongEpoch):
            await r.reserve("old-c", PROMPT, PARAMS, _a(5))
        await _assert_nothing_held(d, r)
        # The newer Conductor reserves; a reserve from a still newer one releases it on arrival.
        await r.reserve("new-d", PROMPT, PARAMS, _a(6))
        await r.observe(_a(6))  # the same epoch again changes nothing
        assert "new-d" in r
        await r.reserve("newer-e", PROMPT, PARAMS, _a(7))
        assert "new-d" not in r and "newer-e" in r
        # Ordered, a lower epoch changes nothing; confirmed by the Conductor's claim in etcd (a
        # rebuilt etcd gave the restarted Conductor a lower revision) it replaces the higher one.
        await r.observe(_a(2))
        assert "newer-e" in r and r.epochs["a"] == 7
        await r.observe(_a(2), confirmed=True)
        assert "newer-e" not in r and r.epochs["a"] == 2
        with pytest.raises(WrongEpoch):  # (the route refuses it before: its claim carries 2)
            r.check_current(_a(7))
        await r.reserve("from-2", PROMPT, PARAMS, _a(2))
        assert await r.release("from-2", settled=True) is True
        await _assert_nothing_held(d, r)

    asyncio.run(scenario())


def test_an_abort_before_its_reserve_leaves_a_tombstone(decode_engine):
    d = decode_engine

    async def scenario():
        r = _receiver(d, lease_s=30.0)
        assert await r.release("early", settled=True) is False  # nothing to release yet
        with pytest.raises(LookupError):
            await r.reserve("early", PROMPT, PARAMS, _a(1))
        await _assert_nothing_held(d, r)

    asyncio.run(scenario())


def _hold_engine_thread(d) -> tuple[threading.Event, asyncio.Future]:
    """Keep the engine thread busy in a call until the event is set (a long engine step)."""
    gate = threading.Event()
    busy = asyncio.ensure_future(d.client.call(lambda e: gate.wait(10)))
    return gate, busy


def test_an_abort_while_its_reserve_is_on_the_engine_thread_leaves_nothing(decode_engine):
    d = decode_engine

    async def scenario():
        r = _receiver(d, lease_s=30.0)
        gate, busy = _hold_engine_thread(d)
        reserve = asyncio.create_task(r.reserve("racing", PROMPT, PARAMS, _a(1)))
        # One turn of the loop runs the reserve up to its engine call, queued behind the busy thread.
        await asyncio.sleep(0)
        assert not reserve.done()
        assert await r.release("racing", settled=False) is False  # overtakes it: a tombstone
        gate.set()
        await busy
        with pytest.raises(LookupError):
            await reserve
        assert "racing" not in r
        await _assert_nothing_held(d, r)

    asyncio.run(scenario())


def test_a_reserve_in_flight_when_a_newer_epoch_arrives_is_not_granted_to_the_old_one(decode_engine):
    """The older Conductor's reserve was on the engine thread when the newer Conductor's first
    call came in: once it completes, it must not leave a reservation of the older epoch behind
    (the doc: "the older one's reservations are released at once")."""
    d = decode_engine

    async def scenario():
        r = _receiver(d, lease_s=30.0)
        gate, busy = _hold_engine_thread(d)
        reserve = asyncio.create_task(r.reserve("in-flight", PROMPT, PARAMS, _a(8)))
        await asyncio.sleep(0)  # one turn of the loop: the reserve is queued behind the busy thread
        await r.observe(_a(9))
        gate.set()
        await busy
        try:
            await reserve
            granted = True
        except WrongEpoch:
            granted = False
        held = "in-flight" in r
        renewable_by_old = r.renew(["in-flight"], _a(8)) == []
        await r.release("in-flight", settled=True)  # clean up either way
        await _assert_nothing_held(d, r)
        assert not held and not granted, (
            f"a reservation for epoch 8 was granted after epoch 9 had been seen (granted={granted}, held={held}, "
            f"the older Conductor can renew it: {renewable_by_old}); it stays until its lease runs out")

    asyncio.run(scenario())


# -- Ledger / Booking -----------------------------------------------------------------------------------

def test_booking_close_undoes_every_entry_and_names_the_holds_to_abort():
    ledger = Ledger()
    prefill, other, decode = InstanceRecord("http://p0"), InstanceRecord("http://p1"), InstanceRecord("http://d0")
    b = ledger.book("r")
    b.placed(prefill, 0.0, 1.0)
    b.kv_headed(decode, 1.0, 40)
    b.reserving(decode)    # before the reserve call
    b.reserving(other, "r:migrate")
    b.writable(other, "r:migrate")  # a push may be writing into it
    b.writable(decode)   # the prefill may be streaming KV into it
    b.decoding(decode, 40)
    assert ledger.reservations() == {decode: ["r"], other: ["r:migrate"]}

    holds = b.close()
    # The decode reservation may still receive KV: aborted with writes_done False, even though a
    # decode entry for the same id would be "done".
    assert holds == {(prefill, "r"): True, (decode, "r"): False, (other, "r:migrate"): False}
    for rec in (prefill, other, decode):
        load = ledger.load(rec)
        assert not (load.prefilling or load.running or load.incoming or load.reserved), rec.url
    assert ledger.reservations() == {} and ledger.total_running() == 0
    assert b.close() == {}  # idempotent

    # Entries already removed (done there) are not aborted; what the prefill answered is settled.
    b = ledger.book("s")
    b.placed(prefill, 0.0, 1.0)
    b.kv_headed(decode, 1.0, 40)
    b.writable(decode)
    b.prefilled(decode)
    assert b.close() == {(decode, "s"): True}
    # A decode that finished by itself: nothing to abort there.
    b = ledger.book("f")
    b.writable(decode)
    b.prefilled(decode)
    b.decoding(decode, 40)
    b.finished()
    assert b.close() == {}
    # Only incoming: nothing to abort anywhere.
    b = ledger.book("t")
    b.kv_headed(decode, 1.0, 40)
    assert b.close() == {}
    assert not ledger.load(decode).incoming


# -- the burst: each decision sees the previous one's booking --------------------------------------------

PROFILE = InstanceProfile(PrefillCostModel(1e-7, 2e-7, 1e-3, 0.05), DecodeStepModel(0.05, 0.002, 1e-5, 4096))
LAYOUT = KVLayout(2, 2, 16, 8, "float32")


def _up_record(url: str, role: str) -> InstanceRecord:
    rec = InstanceRecord(url)
    rec.up, rec.role, rec.layout, rec.profile = True, role, LAYOUT, PROFILE
    rec.info = InstanceInfo(url, role, 1, 4096, LAYOUT.to_dict(), PROFILE.to_dict())
    rec.lost = asyncio.Event()
    return rec


def _distinct_prompts(n: int, length: int = 200) -> list[list[int]]:
    return [[(i * 977 + j * 13) % 900 + 10 for j in range(length)] for i in range(n)]


def test_placer_and_ledger_spread_a_back_to_back_burst():
    """As ``Conductor._place`` then ``generate``: decide on the ledger's snapshots, book, next."""
    prefills = [_up_record("http://p0", "prefill"), _up_record("http://p1", "prefill")]
    decodes = [_up_record("http://d0", "decode"), _up_record("http://d1", "decode")]
    ledger = Ledger()
    placer = Placer(PlacementConfig(), PROFILE.prefill, PROFILE.decode, 16, LAYOUT.nbytes(1) // 16)
    chosen, decode_first = [], []
    for i, ids in enumerate(_distinct_prompts(8)):
        now = time.monotonic()
        loads = [ledger.load(r) for r in prefills]
        result = placer.place(now, RequestInfo(i, len(ids), []),
                              [load.prefill_state(k, now, r) for k, (r, load) in enumerate(zip(prefills, loads))],
                              [len(load.prefilling) for load in loads],
                              [ledger.load(r).decode_state(k, now, r) for k, r in enumerate(decodes)])
        assert isinstance(result, Placement)
        b = ledger.book(f"r{i}")
        b.placed(prefills[result.plan.instance], now, result.plan.prefill_s)
        b.kv_headed(decodes[result.decode_order[0]], now + result.plan.ttft_s, len(ids))
        chosen.append(result.plan.instance)
        decode_first.append(result.decode_order[0])
    assert sorted(chosen.count(k) for k in (0, 1)) == [4, 4], chosen
    assert sorted(decode_first.count(k) for k in (0, 1)) == [4, 4], decode_first


def test_by_default_a_burst_is_refused_once_its_ttft_would_pass_10x_the_unloaded_one():
    """Issue 41 item 2: with no SLOs configured, admission still predicts and refuses early; only
    ``admission="none"`` leaves the queue bound alone to refuse."""
    prefills, decodes = [_up_record("http://p0", "prefill")], [_up_record("http://d0", "decode")]
    ids = _distinct_prompts(1)[0]
    alone = PROFILE.prefill.seconds(len(ids))  # 0.254 s: default TTFT SLO 2.54 s
    admitted = {}
    for admission in ("predictive", "none"):
        ledger = Ledger()
        placer = Placer(PlacementConfig(admission=admission), PROFILE.prefill, PROFILE.decode, 16,
                        LAYOUT.nbytes(1) // 16)
        for i in range(40):
            now = time.monotonic()
            result = placer.place(now, RequestInfo(i, len(ids), []), [ledger.prefill_state(prefills[0], 0, now)],
                                  [ledger.queued(prefills[0])], [ledger.decode_state(decodes[0], 0, now)])
            if not isinstance(result, Placement):
                break
            ledger.book(f"r{i}").placed(prefills[0], now, result.plan.prefill_s)
        admitted[admission] = i
        if admission == "predictive":
            assert "predicted prefill load" in result.reason and result.retry_after_s > 2.0
    # Request i waits for i prefills: the first refused is the one whose TTFT, i + 1 prefills,
    # would pass 10x its own (the oldest has run a moment already, hence the ~10).
    assert admitted["predictive"] == 10, (admitted, alone)
    assert admitted["none"] == PlacementConfig().max_queued_prefills


def test_conductor_burst_spreads_over_both_prefill_instances_and_leaves_the_ledger_empty(monkeypatch):
    """The real Conductor and RequestFlow; the instances are an ``httpx.MockTransport`` whose
    prefills wait until all 8 requests have been placed (every one is still in flight when the
    next is decided: exactly the burst that used to pile onto one instance)."""
    prefill_urls, decode_urls = ["http://p0:1", "http://p1:1"], ["http://d0:1", "http://d1:1"]
    roles = {**{u: "prefill" for u in prefill_urls}, **{u: "decode" for u in decode_urls}}
    prefilled_on: dict[str, str] = {}
    aborts: list[tuple[str, str]] = []

    class Instances:
        def __init__(self) -> None:
            self.gate: asyncio.Event | None = None

        async def __call__(self, request: httpx.Request) -> httpx.Response:
            url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
            path = request.url.path
            body = {} if request.method == "GET" else json.loads(request.content)
            if path == "/instance/info":
                info = InstanceInfo(url, roles[url], 1, 4096, LAYOUT.to_dict(), PROFILE.to_dict())
                return httpx.Response(200, json=info.to_dict())
            if path == "/instance/state":
                return httpx.Response(200, json=InstanceState(url, CacheDelta(0, [])).to_dict())
            if path == "/instance/reserve":
                n = -(-len(body["prompt_token_ids"]) // 16)
                return httpx.Response(200, json={"dest": {"skip_blocks": 0, "num_blocks": n}})
            if path == "/instance/renew":
                return httpx.Response(200, json={"gone": []})
            if path == "/instance/prefill":
                prefilled_on[body["request_id"]] = url
                await self.gate.wait()
                out = RequestOutput(body["request_id"], [7], "x", True, "length", len(body["prompt_token_ids"]), 1, 0)
                return httpx.Response(200, json={"output": output_to_dict(out)})
            if path == "/instance/abort":
                aborts.append((url, body["request_id"]))
                return httpx.Response(200, json={"aborted": body["request_id"]})
            return httpx.Response(404, json={"error": f"unexpected {path}"})

    instances = Instances()
    transport = signed_transport(instances, SECRET)
    monkeypatch.setattr(conductor_module, "InstanceClient",
                        lambda *a, **k: InstanceClient(*a, **k, transport=transport))

    async def scenario():
        instances.gate = asyncio.Event()
        c = Conductor(ConductorConfig(secret=SECRET, instances=tuple(prefill_urls + decode_urls), epoch=3))
        c._tokenizer, c._vocab_size = object(), 1000  # token-id prompts only: no tokenizer needed
        for rec in c.registry.records:
            await c.registry.poll(rec)
        assert c.is_ready and c._serving_mode() == "disaggregated"

        async def one(i: int, ids: list[int]) -> list[RequestOutput]:
            return [o async for o in c.generate(f"burst-{i}", ids, SamplingParams(max_tokens=1))]

        tasks = [asyncio.create_task(one(i, ids)) for i, ids in enumerate(_distinct_prompts(8))]
        deadline = time.monotonic() + 10
        while len(prefilled_on) < 8:
            assert time.monotonic() < deadline, f"only {len(prefilled_on)} prefills started"
            await asyncio.sleep(0.01)
        # All 8 are in flight at once: the ledger shows each where it was booked.
        p0, p1 = (c.registry.records[k] for k in (0, 1))
        queued = [len(c.ledger.load(p0).prefilling), len(c.ledger.load(p1).prefilling)]
        instances.gate.set()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(o[-1].finished for o in outs)
        counts = [list(prefilled_on.values()).count(u) for u in prefill_urls]
        assert sorted(counts) == [4, 4], f"the burst piled up: {dict(zip(prefill_urls, counts))}"
        assert sorted(queued) == [4, 4], queued
        # Every entry rolled back; each finished-at-first-token request released its reservation.
        for rec in c.registry.records:
            load = c.ledger.load(rec)
            assert not (load.prefilling or load.running or load.incoming or load.reserved), rec.url
        decode_aborts = lambda: sorted(rid for url, rid in aborts if url in decode_urls)  # noqa: E731
        for _ in range(200):  # the aborts run as tasks of their own
            if len(decode_aborts()) >= 8:
                break
            await asyncio.sleep(0.01)
        assert decode_aborts() == sorted(f"burst-{i}" for i in range(8))
        assert c.stats()["requests_accepted"] == 8
        await c.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("slo_s, rate", [(1e-4, 0.0), (1.0, 1.0)])
def test_a_share_of_refused_requests_is_admitted_to_measure_the_false_reject_rate(monkeypatch, slo_s, rate):
    """Issue 41 item 3, live: with a prefill model that predicts 2 s for these prompts every
    request is refused; every 4th refusal (``probe_share`` 0.25) is admitted all the same and
    timed. Against a 100 us SLO nothing could have met it (rate 0); the instances answer at once,
    so against 1 s every probe did: those refusals were wrong (rate 1)."""
    slow = InstanceProfile(PrefillCostModel(0.0, 0.0, 0.01), PROFILE.decode)
    urls = {"http://p0:1": "prefill", "http://d0:1": "decode"}

    async def instances(request: httpx.Request) -> httpx.Response:
        url, path = f"{request.url.scheme}://{request.url.host}:{request.url.port}", request.url.path
        body = {} if request.method == "GET" else json.loads(request.content)
        if path == "/instance/info":
            return httpx.Response(200, json=InstanceInfo(url, urls[url], 1, 4096, LAYOUT.to_dict(),
                                                         slow.to_dict()).to_dict())
        if path == "/instance/state":
            return httpx.Response(200, json=InstanceState(url, CacheDelta(0, [])).to_dict())
        if path == "/instance/reserve":
            return httpx.Response(200, json={"dest": {"skip_blocks": 0, "num_blocks": 13}})
        if path == "/instance/prefill":
            out = RequestOutput(body["request_id"], [7], "x", True, "length", len(body["prompt_token_ids"]), 1, 0)
            return httpx.Response(200, json={"output": output_to_dict(out)})
        return httpx.Response(200, json={"request_id": body.get("request_id"), "gone": []})

    transport = signed_transport(instances, SECRET)
    monkeypatch.setattr(conductor_module, "InstanceClient",
                        lambda *a, **k: InstanceClient(*a, **k, transport=transport))

    async def scenario() -> dict:
        placement = PlacementConfig(slo_ttft_s=slo_s, slo_tbt_s=slo_s, probe_share=0.25)
        c = Conductor(ConductorConfig(secret=SECRET, instances=tuple(urls), epoch=3, placement=placement))
        c._tokenizer, c._vocab_size = object(), 1000
        for rec in c.registry.records:
            await c.registry.poll(rec)
        refused = 0
        for i, ids in enumerate(_distinct_prompts(8)):
            try:
                # As the server reads a stream: up to its finished output, then closed.
                async with aclosing(c.generate(f"r{i}", ids, SamplingParams(max_tokens=1))) as outs:
                    async for out in outs:
                        if out.finished:
                            break
                assert out.finished and i % 4 == 3, i  # only the probes get through
            except EngineOverloaded:
                refused += 1
        assert refused == 6
        stats = c.stats()
        await c.shutdown()
        return stats

    stats = asyncio.run(scenario())
    assert stats["admission_probes"] == 2 and stats["requests_rejected"] == 6
    assert stats["false_reject_rate"] == rate and stats["admission_probes_met_slo"] == 2 * rate
