"""The pool is a cache (issue 23, section 4, and the pool's part of section 3): whatever fails in
it costs a recompute or a store, never an answer, and a slow part of it slows nobody else.

* The metadata store down or slow: an instance's pool loads and stores give up within a bound,
  counted (``metadata_unavailable``), on the pool's own threads, never the default executor's;
  end to end, a prompt of more than one pool block served while etcd is stopped gets its right
  answer (the ``processes`` test at the end).
* A frozen node costs the prompts that want it about a second, once; then it is passed over.
* A node's lease keepalive does not wait for its hot-object replication.
* The SSD tier's reads and writes run outside the segment lock that every request and the
  owner's ``/poll`` take; a promotion forgets the SSD copy only once the DRAM copy is in place;
  a full disk (``ENOSPC``) stores nothing and the node keeps serving on the same connections.
"""

from __future__ import annotations

import asyncio
import errno
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

import cluster.pool.ssd as ssd_module
from bench.harness import start_etcd, until
from cluster.instance.pool_io import PoolIO, pool_prefix
from cluster.messenger import Messenger, MessengerConfig
from cluster.messenger.staging import StagingArea
from cluster.pool import PoolClient, Segment, SegmentConfig, SegmentService, SsdTier
from cluster.pool.index import OBJECTS, SEGMENTS, object_entry
from cluster.metadata import MetadataUnavailable
from cluster.metadata.local import LocalMetadata
from cluster.pool.objects import PoolGeometry, part_checksums
from engine.kv_layout import KVLayout
from engine.sampling_params import SamplingParams
from tests.pool_objects import OBJ, PART, leased_bytes, write_object

SECRET = b"pool-faults-test-secret-01234567"


def _within(fn, seconds: float):
    """``fn()`` run on another thread; its result, or AssertionError if it takes longer."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fn)
        try:
            return future.result(seconds)
        except TimeoutError:
            raise AssertionError(f"{fn} blocked for more than {seconds} s") from None


@pytest.fixture
def engine():
    with Messenger(MessengerConfig(secret=SECRET)) as e:
        yield e


# -- a frozen pool node ----------------------------------------------------------------------------


def test_a_frozen_node_met_for_the_first_time_costs_the_call_timeout_not_a_transfer_timeout():
    """Frozen before anyone talked to it (SIGSTOP right after it started): its kernel still
    accepts a connection, and the handshake hangs. A call's timeout bounds the connect and the
    handshake as well as the answer, and a second caller queued behind the same peer's connect
    gives up as soon; the error says the peer did not answer, not that the secret was wrong."""
    import socket

    from cluster.messenger import TransferError

    with socket.socket() as listener, Messenger(MessengerConfig(secret=SECRET, timeout_s=30.0)) as caller:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # never accepted, never answered: as a stopped process
        address = "127.0.0.1:%d" % listener.getsockname()[1]
        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(caller.call, address, {"op": "lease"}, 1.0) for _ in range(2)]
            errors = []
            for call in calls:
                with pytest.raises(TransferError) as e:
                    call.result(60)
                errors.append(str(e.value))
        took = time.monotonic() - t0
    assert took < 2.5, f"two calls to a frozen peer took {took:.1f} s"
    assert not [e for e in errors if "secret" in e], errors


def test_a_frozen_node_costs_a_prompt_about_a_second_once_then_is_passed_over():
    """A node that stops answering (SIGSTOP, a partition: here its lease and alloc handlers hang)
    holds the prompts that want its objects for the call timeout (1 s), not for a transfer
    timeout each; for a while after, it is not asked at all: its objects are misses, and stores
    go to the node that answers."""
    metadata = LocalMetadata()
    with Messenger(MessengerConfig(secret=SECRET)) as frozen_engine, \
            Messenger(MessengerConfig(secret=SECRET)) as healthy_engine, \
            Messenger(MessengerConfig(secret=SECRET)) as reader_engine:
        frozen = SegmentService(Segment(frozen_engine, SegmentConfig(dram_bytes=8 * OBJ)), frozen_engine, metadata,
                                PoolClient(frozen_engine, metadata), "frozen", lease_ttl_s=30.0, heartbeat_s=0.2)
        healthy = SegmentService(Segment(healthy_engine, SegmentConfig(dram_bytes=8 * OBJ)), healthy_engine,
                                 metadata, PoolClient(healthy_engine, metadata), "healthy", lease_ttl_s=30.0,
                                 heartbeat_s=0.2)
        reader = PoolClient(reader_engine, metadata, segments_ttl_s=0.0, transfer_timeout_s=30.0)
        buf = reader_engine.alloc_shared(2 * OBJ)
        handle = reader_engine.register(buf)
        sums = part_checksums(memoryview(buf.numpy())[:OBJ], PART)
        assert reader.put("ns/0", handle, 0, OBJ, PART, sums, exclude=[healthy.segment_id]) == frozen.segment_id
        until(lambda: reader.lookup(["ns/0"]) == [[frozen.segment_id]], 5, "the object in the index")

        thaw = threading.Event()
        for op in ("lease", "alloc"):
            real = getattr(frozen.segment, {"lease": "lease", "alloc": "allocate"}[op])
            setattr(frozen.segment, {"lease": "lease", "alloc": "allocate"}[op],
                    lambda *a, real=real, **k: (thaw.wait(60), real(*a, **k))[1])
        try:
            mem = memoryview(buf.numpy())
            t0 = time.monotonic()
            assert reader.get(["ns/0"], handle, [OBJ], mem) == 0  # a miss ...
            first = time.monotonic() - t0
            assert 0.9 <= first < 3.0, f"the first prompt waited {first:.1f} s"  # ... after about a second
            t0 = time.monotonic()
            for _ in range(5):
                assert reader.get(["ns/0"], handle, [OBJ], mem) == 0
            assert time.monotonic() - t0 < 0.5, "a node that just failed to answer was asked again"
            assert reader.counters["segment_timeouts"] == 1 and reader.counters["segments_passed_over"] >= 5
            # A store goes to the node that answers, at once.
            t0 = time.monotonic()
            assert reader.put("ns/1", handle, 0, OBJ, PART, sums) == healthy.segment_id
            assert time.monotonic() - t0 < 0.5
        finally:
            thaw.set()
            frozen.close()
            healthy.close()


# -- the metadata down or slow, as an instance's PoolIO meets it ------------------------------------


class BrokenMetadata(LocalMetadata):
    """Every read of the index fails (``down``) or waits for ``gate`` (slow); counts the reads."""

    def __init__(self, *, down: bool = False, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.down, self.gate, self.reads = down, gate, 0

    def _read(self) -> None:
        self.reads += 1
        if self.down:
            raise MetadataUnavailable("metadata down (test)")
        if self.gate is not None:
            self.gate.wait(10)

    def get_prefix(self, prefix):
        self._read()
        return super().get_prefix(prefix)

    def get_prefixes(self, prefixes):
        self._read()
        return super().get_prefixes(prefixes)


class FakeEngineClient:
    async def call(self, fn):
        return fn(None)


class FakeHandoff:
    def cached_prefix_blocks(self, token_ids, salt=None) -> int:
        return 0


def _pool_io(engine: Messenger, metadata, **kw) -> PoolIO:
    geometry = PoolGeometry(KVLayout(2, 1, 16, 8, "float32"), 2, "test-model")  # 32-token objects
    client = PoolClient(engine, metadata, segments_ttl_s=0.0, transfer_timeout_s=3.0)
    return PoolIO(FakeEngineClient(), FakeHandoff(), client, geometry, StagingArea(engine, 8 * geometry.nbytes),
                  3.0, **kw)


PROMPT = list(range(300))  # 9 pool objects of 32 tokens


def test_a_metadata_that_is_down_costs_the_store_and_the_load_not_the_prompt(engine):
    metadata = BrokenMetadata(down=True)
    io = _pool_io(engine, metadata)

    async def scenario() -> None:
        assert await io.plan_store("r1", PROMPT) is False  # was: MetadataUnavailable, a 500
        added: list[str] = []
        async with pool_prefix(io, "r1", PROMPT, SamplingParams(max_tokens=1)) as start:
            start(SimpleNamespace(add_request=lambda *args, request_id, session: added.append(request_id)))
        assert added == ["r1"], "nothing to load: the prompt enters the engine plainly"
        io.store_later(PROMPT, len(PROMPT))  # in the background, quietly
        await asyncio.gather(*io._stores)

    asyncio.run(scenario())
    assert io.pool.counters["metadata_unavailable"] >= 2
    assert metadata.reads == 1, "within the back-off the metadata is not asked again"


def test_a_slow_metadata_bounds_the_wait_and_leaves_the_default_executor_alone(engine):
    gate = threading.Event()
    metadata = BrokenMetadata(gate=gate)
    io = _pool_io(engine, metadata, metadata_timeout_s=0.3, metadata_backoff_s=0.0)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(2))  # as small as on a 2-core machine
        started = time.monotonic()
        stores = [asyncio.create_task(io.plan_store(f"r{i}", [i, *PROMPT])) for i in range(4)]
        await asyncio.sleep(0.05)
        # Unrelated work on the default executor is not held up by the hung pool calls.
        assert await asyncio.wait_for(loop.run_in_executor(None, lambda: 42), 0.5) == 42
        assert await asyncio.gather(*stores) == [False] * 4
        assert time.monotonic() - started < 2.0, "the wait for the metadata is bounded"

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
    assert io.pool.counters["metadata_unavailable"] == 4


# -- a pool node's lease and its replication ---------------------------------------------------------


def test_a_replication_longer_than_the_lease_keeps_the_lease():
    metadata = LocalMetadata()
    with Messenger(MessengerConfig(secret=SECRET)) as e1, Messenger(MessengerConfig(secret=SECRET)) as reader_engine:
        client = PoolClient(e1, metadata, segments_ttl_s=0.0)
        node = SegmentService(Segment(e1, SegmentConfig(dram_bytes=8 * OBJ)), e1, metadata, client, "a",
                              lease_ttl_s=1.0, heartbeat_s=0.2, hot_reads=1)
        copying = threading.Event()

        def slow_put(*args, **kw):  # a copy to a slow segment: longer than the lease
            copying.set()
            time.sleep(2.5)

        client.put = slow_put
        reader = PoolClient(reader_engine, metadata, segments_ttl_s=0.0)
        buf = reader_engine.alloc_shared(OBJ)
        handle = reader_engine.register(buf)
        buf[:] = 5
        assert reader.put("ns/hot", handle, 0, OBJ, PART, part_checksums(memoryview(buf.numpy()), PART))
        until(lambda: reader.lookup(["ns/hot"]), 5.0, "the hot object to be listed")
        lease = node._lease
        assert reader.get(["ns/hot"], handle, [0], memoryview(buf.numpy())) == 1  # hot now
        assert copying.wait(5), "the hot object was not replicated"
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the copy is running all this time
            assert metadata.get(SEGMENTS + node.segment_id) is not None, "the node lost its lease mid-copy"
            assert metadata.get(object_entry("ns/hot", node.segment_id)) is not None
            time.sleep(0.1)
        assert node._lease == lease
        node.close()


# -- the SSD tier and the segment lock -----------------------------------------------------------------


class GatedSsd(SsdTier):
    """An SSD whose reads or writes wait for a gate (a slow disk); records the order of calls."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.read_gate = threading.Event()
        self.write_gate = threading.Event()
        self.read_gate.set()
        self.write_gate.set()
        self.reading = threading.Event()
        self.writing = threading.Event()
        self.on_delete = None

    def read_into(self, key, out):
        self.reading.set()
        self.read_gate.wait(10)
        return super().read_into(key, out)

    def put(self, key, data):
        self.writing.set()
        self.write_gate.wait(10)
        return super().put(key, data)

    def delete(self, key):
        if self.on_delete is not None:
            self.on_delete(key)
        return super().delete(key)


def _ssd_segment(engine, tmp_path, dram_objects: int = 2, ssd_objects: int = 4) -> tuple[Segment, GatedSsd]:
    ssd = GatedSsd(tmp_path / "ssd", ssd_objects * OBJ)
    return Segment(engine, SegmentConfig(dram_bytes=dram_objects * OBJ, high_watermark=1.0), ssd), ssd


def test_a_slow_ssd_read_does_not_hold_the_segment_lock(engine, tmp_path):
    seg, ssd = _ssd_segment(engine, tmp_path)
    data = {key: write_object(seg, key, 10 + i) for i, key in enumerate("abc")}  # a is on the SSD
    assert seg.stats()["objects_ssd"] == 1
    ssd.read_gate.clear()
    with ThreadPoolExecutor(1) as pool:
        promoting = pool.submit(seg.lease, ["a"])
        assert ssd.reading.wait(5)
        stats = _within(seg.stats, 1.0)  # what an instance's /poll asks, while the disk is slow
        assert stats["objects"] == 3
        _within(lambda: seg.lease(["c"]), 1.0)  # a read of a DRAM object goes on too
        ssd.read_gate.set()
        (grant,) = promoting.result(5)
    assert grant is not None and leased_bytes(seg, grant) == data["a"]
    seg.check()


def test_a_corrupt_ssd_copy_is_dropped_not_promoted(engine, tmp_path):
    """Issue 31: an object read back from SSD is checked before it is promoted; a copy whose bytes
    changed on disk is dropped (a miss, and unpublished), the others come back intact."""
    seg, _ = _ssd_segment(engine, tmp_path)
    originals = {key: write_object(seg, key, 30 + i) for i, key in enumerate("abcd")}
    assert seg.stats()["objects_ssd"] == 2  # "a" and "b" went down
    (victim,) = [p for p in (tmp_path / "ssd").glob("*.kv") if p.stat().st_size == OBJ and p.read_bytes()
                 == originals["a"]]
    raw = bytearray(victim.read_bytes())
    raw[OBJ // 2] ^= 0xFF  # one flipped byte in the middle of a part
    victim.write_bytes(bytes(raw))
    assert seg.lease(["a"]) == [None]
    s = seg.stats()
    assert s["corrupt_ssd_reads"] == 1 and s["promotions"] == 0 and s["objects"] == 3
    assert seg.lease(["a"]) == [None]  # gone for good, not read again
    grant = seg.lease(["b"])[0]  # an intact copy still comes back
    assert grant is not None and leased_bytes(seg, grant) == originals["b"]
    seg.check()


def test_a_slow_ssd_write_does_not_hold_the_segment_lock(engine, tmp_path):
    seg, ssd = _ssd_segment(engine, tmp_path)
    data = {key: write_object(seg, key, 10 + i) for i, key in enumerate("ab")}
    ssd.write_gate.clear()
    with ThreadPoolExecutor(1) as pool:
        allocating = pool.submit(write_object, seg, "c", 12)  # pushes a down to the SSD
        assert ssd.writing.wait(5)
        assert _within(seg.stats, 1.0)["demotions"] == 1
        # On its way to the SSD, a is still readable (from the bytes being written).
        seg.release("b", _within(lambda: seg.lease(["b"]), 1.0)[0].lease)
        ssd.write_gate.set()
        data["c"] = allocating.result(5)
    for key in "abc":
        (g,) = seg.lease([key])
        assert g is not None and leased_bytes(seg, g) == data[key]
        seg.release(key, g.lease)
    seg.check()


def test_a_promotion_without_room_keeps_the_ssd_copy(engine, tmp_path):
    seg, ssd = _ssd_segment(engine, tmp_path)
    data = {key: write_object(seg, key, 10 + i) for i, key in enumerate("abc")}  # a is on the SSD
    held = seg.lease(["b", "c"])  # every DRAM object leased: no room to bring a up
    assert seg.lease(["a"]) == [None]
    assert seg.stats()["objects_ssd"] == 1 and "a" in ssd, "a promotion that found no room lost the object"
    assert seg.stats()["evictions"] == 0
    seg.check()
    seg.release("b", held[0].lease)
    in_dram_when_deleted = []
    ssd.on_delete = lambda key: in_dram_when_deleted.append(
        (key, seg._objects.get(key) is not None and seg._objects[key].range is not None))
    (grant,) = seg.lease(["a"])
    assert grant is not None and leased_bytes(seg, grant) == data["a"]
    assert ("a", True) in in_dram_when_deleted and ("a", False) not in in_dram_when_deleted
    seg.check()


def test_a_full_disk_stores_nothing_and_the_node_keeps_serving(tmp_path, monkeypatch):
    real_open = open

    class FullDisk:
        def __init__(self, path, mode):
            self._f = real_open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def write(self, data):
            self._f.write(bytes(data[: len(data) // 2]))  # half of it, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

    def fake_open(path, mode="r", *args, **kw):
        return FullDisk(path, mode) if "w" in mode else real_open(path, mode, *args, **kw)

    monkeypatch.setattr(ssd_module, "open", fake_open, raising=False)
    metadata = LocalMetadata()
    with Messenger(MessengerConfig(secret=SECRET)) as e1, Messenger(MessengerConfig(secret=SECRET)) as writer_engine:
        ssd = SsdTier(tmp_path / "ssd", 8 * OBJ)
        node = SegmentService(Segment(e1, SegmentConfig(dram_bytes=2 * OBJ, high_watermark=1.0), ssd), e1, metadata,
                              PoolClient(e1, metadata, segments_ttl_s=0.0), "a", lease_ttl_s=2.0, heartbeat_s=0.2)
        writer = PoolClient(writer_engine, metadata, segments_ttl_s=0.0)
        buf = writer_engine.alloc_shared(OBJ)
        handle = writer_engine.register(buf)
        for i in range(4):  # every put past the second pushes one down: the disk refuses it
            buf[:] = i
            sums = part_checksums(memoryview(buf.numpy()), PART)
            assert writer.put(f"ns/{i}", handle, 0, OBJ, PART, sums) == node.segment_id
        s = node.segment.stats()
        assert s["ssd_errors"] == 2 and s["objects"] == 2 and s["objects_ssd"] == 0 and s["evictions"] == 2
        assert ssd.used_bytes == 0 and not list((tmp_path / "ssd").iterdir()), "a failed write left a file"
        node.segment.check()
        until(lambda: sorted(metadata.get_prefix(OBJECTS)) == [object_entry(f"ns/{i}", node.segment_id)
                                                                for i in (2, 3)], 5.0, "only the stored objects to be listed")
        # The same connection still serves: reads, and writes once the disk has room again.
        assert writer.get(["ns/3"], handle, [0], memoryview(buf.numpy())) == 1
        assert int(buf[0]) == 3
        monkeypatch.undo()
        buf[:] = 9
        assert writer.put("ns/9", handle, 0, OBJ, PART, part_checksums(memoryview(buf.numpy()), PART))
        assert node.segment.stats()["objects_ssd"] == 1
        node.close()


# -- end to end: a cluster on etcd, etcd stopped -------------------------------------------------------


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """An etcd of this test's own (the session's is shared: this one gets stopped): its URL and its
    process, which the test SIGSTOPs and kills (``stop`` resumes it first, and passes over a dead one)."""
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    etcd = start_etcd(tmp_path / "etcd", name="faults")
    try:
        yield etcd.url, etcd.proc
    finally:
        etcd.stop()


@pytest.mark.processes
def test_a_long_prompt_while_etcd_is_stopped_is_answered_and_counted(private_etcd, tmp_path, colocated):
    from clusters import Cluster, words

    url, etcd = private_etcd
    greedy = {"temperature": 0, "max_tokens": 8}
    prompt = words("etcdstopped", 100) + " And so?"  # ~600 tokens: two full 256-token pool blocks
    want = colocated.generate([prompt], SamplingParams(**greedy))[0].text
    cluster = Cluster(["--prefill-instances", "1", "--decode-instances", "1", "--pool-dram-gib", "0.05",
                       "--etcd", url], 2, tmp_path)
    try:
        cluster.complete(words("etcdwarm", 100), **greedy)  # the pool works
        etcd.send_signal(signal.SIGSTOP)  # slow: nothing answers, every call times out
        started = time.monotonic()
        r = cluster.http.post("/v1/completions", json={"prompt": prompt, **greedy})
        assert r.status_code == 200, r.text  # was 500: MetadataUnavailable from planning the store
        assert r.json()["choices"][0]["text"] == want
        assert time.monotonic() - started < 30
        until(lambda: cluster.stats()["pool"].get("metadata_unavailable", 0) > 0, 30,
              "the Conductor to count the pool calls given up")
        etcd.send_signal(signal.SIGCONT)
        etcd.kill()  # down: refused at once
        etcd.wait()
        r = cluster.http.post("/v1/completions", json={"prompt": prompt + " Again?", **greedy})
        assert r.status_code == 200, r.text
        cluster.assert_clean()
    finally:
        cluster.close()
