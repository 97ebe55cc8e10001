"""The KVCache pool's pieces in one process: segment, SSD tier, segment service and client.

Real transfer engines on loopback (shared memory between them) and the in-process metadata
store; the processes-and-etcd scenarios are in tests/test_pool_cluster.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from cluster.pool import PoolClient, PoolFull, Segment, SegmentConfig, SegmentService, SsdTier
from cluster.pool.client import NewObject
from cluster.pool.index import SEGMENTS
from cluster.metadata.local import LocalMetadata
from cluster.pool.objects import part_checksums
from cluster.messenger import MessengerConfig, Messenger
from tests.pool_objects import OBJ, PART, leased_bytes, write_object

SECRET = b"pool-unit-test-secret-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine():
    with Messenger(MessengerConfig(secret=SECRET)) as e:
        yield e


def test_write_then_publish_and_checksums(engine):
    seg = Segment(engine, SegmentConfig(dram_bytes=8 * OBJ))
    published = []
    seg.start_publishing(lambda key, present: published.append((key, present)))
    offset = seg.allocate("a", OBJ, PART)
    assert seg.lease(["a"]) == [None]  # written but not sealed: invisible
    assert seg.allocate("a", OBJ, PART) is None  # being stored already
    assert not seg.seal("a", [1, 2, 3, 4])  # bytes do not match: dropped, never published
    assert seg.stats()["corrupt_puts"] == 1 and seg.lease(["a"]) == [None]
    data = write_object(seg, "a", 7)
    grant = seg.lease(["a"])[0]
    assert grant is not None and leased_bytes(seg, grant) == data and grant.checksums == part_checksums(memoryview(data), PART)
    deadline = time.monotonic() + 2
    while ("a", True) not in published and time.monotonic() < deadline:
        time.sleep(0.01)
    assert published == [("a", True)]
    assert offset is not None
    seg.check()


def test_lru_eviction_respects_leases_and_watermark(engine):
    clock = Clock()
    seg = Segment(engine, SegmentConfig(dram_bytes=4 * OBJ, high_watermark=0.75), clock=clock)
    for i, key in enumerate("abc"):
        write_object(seg, key, i)
        clock.now += 1
    held = seg.lease(["a"])[0]  # "a" is the least recently used, but a reader holds it
    seg.lease(["b"])  # "b" becomes the most recently used (its lease is released below)
    seg.release("b", seg.lease(["b"])[0].lease)
    clock.now += 1
    write_object(seg, "d", 3)  # 3 objects fit under 75%: "c", the LRU unleased one, goes
    assert seg.lease(["c"]) == [None]
    assert seg.lease(["a"])[0] is not None and leased_bytes(seg, held) == bytes([0]) * OBJ
    assert seg.stats()["evictions"] == 1
    seg.check()


def test_a_leased_prefix_is_evicted_from_its_end(engine):
    """A reader leases a chain head first; the head must outlive the tail in the LRU, or the
    rest of the chain would stay stored but unreachable."""
    seg = Segment(engine, SegmentConfig(dram_bytes=4 * OBJ, high_watermark=0.75))
    for i, key in enumerate(["head", "mid", "tail"]):
        write_object(seg, key, i)
    for g in seg.lease(["head", "mid", "tail"]):
        seg.release(g.key, g.lease)
    write_object(seg, "other", 9)
    assert [g is not None for g in seg.lease(["head", "mid", "tail"])] == [True, True, False]


def test_a_touched_prefix_outlives_an_untouched_one(engine):
    """A prefix used again from a reader's own cache is touched (no read): the LRU keeps it."""
    seg = Segment(engine, SegmentConfig(dram_bytes=5 * OBJ, high_watermark=0.8))
    for i, key in enumerate(["old", "head", "tail", "stale"]):
        write_object(seg, key, i)
    seg.touch(["head", "tail", "absent"])
    write_object(seg, "new", 9)  # 4 objects fit under 80%: the least recently used goes
    assert sorted(seg.keys()) == ["head", "new", "stale", "tail"]
    write_object(seg, "newer", 10)  # then "stale", untouched, goes before the touched prefix
    assert sorted(seg.keys()) == ["head", "new", "newer", "tail"]


def test_everything_leased_means_full_not_a_stolen_slot(engine):
    seg = Segment(engine, SegmentConfig(dram_bytes=2 * OBJ, lease_ttl_s=10))
    write_object(seg, "a", 1)
    write_object(seg, "b", 2)
    seg.lease(["a", "b"])
    with pytest.raises(PoolFull):
        seg.allocate("c", OBJ, PART)
    seg.check()


def test_lease_expiry_makes_an_object_evictable(engine):
    clock = Clock()
    seg = Segment(engine, SegmentConfig(dram_bytes=2 * OBJ, lease_ttl_s=5), clock=clock)
    write_object(seg, "a", 1)
    write_object(seg, "b", 2)
    seg.lease(["a", "b"])
    clock.now += 6
    assert seg.allocate("c", OBJ, PART) is not None


def test_abandoned_put_is_reclaimed(engine):
    clock = Clock()
    seg = Segment(engine, SegmentConfig(dram_bytes=OBJ, put_timeout_s=30), clock=clock)
    seg.allocate("a", OBJ, PART)  # the writer died before sealing
    with pytest.raises(PoolFull):
        seg.allocate("b", OBJ, PART)
    clock.now += 31
    assert seg.allocate("b", OBJ, PART) is not None
    assert seg.stats()["aborted_puts"] == 1
    seg.check()


def test_puts_being_written_leave_room_for_readers(engine, tmp_path):
    # Half the DRAM at most is held by unsealed puts: a writer that allocated a long prompt's
    # objects before its prefill does not block a reader's promotion from SSD meanwhile.
    seg = Segment(engine, SegmentConfig(dram_bytes=8 * OBJ, max_pending_fraction=0.5), SsdTier(tmp_path, 8 * OBJ))
    data = write_object(seg, "cold", 9)
    for i in range(6):
        write_object(seg, f"filler{i}", i)
    for i in range(4):
        assert seg.allocate(f"new{i}", OBJ, PART) is not None  # "cold" goes down to SSD to make room
    assert seg.stats()["demotions"] >= 1
    with pytest.raises(PoolFull, match="being written"):
        seg.allocate("new4", OBJ, PART)
    grant = seg.lease(["cold"])[0]  # promoted: sealed objects could be demoted for it
    assert grant is not None and leased_bytes(seg, grant) == data
    seg.abort("new0")
    assert seg.allocate("new4", OBJ, PART) is not None  # one fewer being written
    seg.check()


def test_ssd_tier_demotes_and_promotes_bit_exact(engine, tmp_path):
    clock = Clock()
    ssd = SsdTier(tmp_path / "ssd", 3 * OBJ)
    seg = Segment(engine, SegmentConfig(dram_bytes=2 * OBJ, high_watermark=1.0), ssd, clock=clock)
    originals = {}
    for i, key in enumerate("abcd"):
        originals[key] = write_object(seg, key, 10 + i)
        clock.now += 1
    s = seg.stats()
    assert s["demotions"] == 2 and s["objects_ssd"] == 2 and s["objects_dram"] == 2 and s["evictions"] == 0
    grant = seg.lease(["a"])[0]  # on SSD: comes back up, pushing the LRU DRAM object down
    assert grant is not None and leased_bytes(seg, grant) == originals["a"]
    assert seg.stats()["promotions"] == 1
    seg.release("a", grant.lease)
    for key in "abcd":
        g = seg.lease([key])[0]
        assert g is not None and leased_bytes(seg, g) == originals[key]
        seg.release(key, g.lease)
    # 4 objects, 2 in DRAM + 3 on SSD of room: nothing lost yet; a 6th overflows the SSD tier.
    for key in "ef":
        originals[key] = write_object(seg, key, 20)
    assert seg.stats()["evictions"] == 1 and seg.stats()["objects"] == 5
    seg.check()


def test_ssd_dir_is_cleared_at_start(tmp_path):
    (tmp_path / "stale.kv").write_bytes(b"x")
    SsdTier(tmp_path, 1024)
    assert not list(tmp_path.glob("*.kv"))


def _node(engine: Messenger, metadata: LocalMetadata, name: str, dram: int, **kw) -> SegmentService:
    client = PoolClient(engine, metadata, segments_ttl_s=0.0)
    return SegmentService(Segment(engine, SegmentConfig(dram_bytes=dram)), engine, metadata, client, name,
                          lease_ttl_s=2.0, heartbeat_s=0.2, **kw)


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def test_client_put_get_corruption_and_departure():
    metadata = LocalMetadata()
    with Messenger(MessengerConfig(secret=SECRET)) as node_engine, \
            Messenger(MessengerConfig(secret=SECRET)) as reader_engine:
        node = _node(node_engine, metadata, "node", 16 * OBJ)
        reader = PoolClient(reader_engine, metadata, segments_ttl_s=0.0)
        src = reader_engine.alloc_shared(4 * OBJ)
        src_handle = reader_engine.register(src)
        src[:] = torch.randint(0, 256, (4 * OBJ,), dtype=torch.uint8)
        mem = memoryview(src.numpy())
        keys = [f"ns/{i}" for i in range(3)]
        for i, key in enumerate(keys):
            sums = part_checksums(mem[i * OBJ : (i + 1) * OBJ], PART)
            assert reader.put(key, src_handle, i * OBJ, OBJ, PART, sums) == node.segment_id
        _wait(lambda: len(reader.lookup(keys)) == 3)
        assert reader.lookup(keys + ["ns/absent"]) == [[node.segment_id]] * 3

        dst = reader_engine.alloc_shared(4 * OBJ)
        dst_handle = reader_engine.register(dst)
        offsets = [0, OBJ, 2 * OBJ]
        assert reader.get(keys, dst_handle, offsets, memoryview(dst.numpy())) == 3
        assert torch.equal(dst[: 3 * OBJ], src[: 3 * OBJ])
        _wait(lambda: node.segment.stats()["leased_objects"] == 0)  # released after the read, not waited for

        # Flip bytes of the second object inside the node's segment: a miss from there on.
        grant = node.segment.lease([keys[1]])[0]
        node.segment.release(keys[1], grant.lease)
        node.segment.area.buffer[grant.offset + 5] ^= 0xFF
        dst.zero_()
        assert reader.get(keys, dst_handle, offsets, memoryview(dst.numpy())) == 1
        assert reader.counters["failed_reads_recomputed"] == 2

        node.close()  # its lease is revoked: its objects leave the index at once
        assert reader.lookup(keys) == [] and not metadata.get_prefix(SEGMENTS)


def test_two_clients_split_objects_by_parts_as_a_pipeline_group_does():
    """The first client reserves and leases; the other writes and reads only its parts, under
    them; the seal takes both clients' checksums; the bytes are the objects'."""
    metadata = LocalMetadata()
    with Messenger(MessengerConfig(secret=SECRET)) as node_engine, \
            Messenger(MessengerConfig(secret=SECRET)) as first_engine, \
            Messenger(MessengerConfig(secret=SECRET)) as later_engine:
        node = _node(node_engine, metadata, "node", 16 * OBJ)
        first = PoolClient(first_engine, metadata, segments_ttl_s=0.0)
        later = PoolClient(later_engine, None)  # no metadata: it works under the first one's
        mine, theirs = range(0, 1), range(1, 4)  # parts of each object
        objects = torch.randint(0, 256, (2, OBJ), dtype=torch.uint8)
        bufs = []
        for engine, parts in ((first_engine, mine), (later_engine, theirs)):
            buf = engine.alloc_shared(2 * OBJ)
            buf[: 2 * len(parts) * PART].view(2, -1).copy_(objects[:, parts.start * PART : parts.stop * PART])
            bufs.append((buf, engine.register(buf)))
        (src0, h0), (src1, h1) = bufs
        keys = ["ns/a", "ns/b"]
        write = first.reserve(h0, [NewObject(k, i * PART, OBJ, PART) for i, k in enumerate(keys)], parts=mine)
        assert write.num_placed == 2
        their_write = later.write_reserved(write.reservation(), h1, [0, 3 * PART], theirs)
        for part in range(4):
            (write if part in mine else their_write).write(part)
        assert their_write.settle() == set()
        # Each client's checksums of its own parts, from its own buffer, in part order.
        sums = [part_checksums(memoryview(src0.numpy())[i * PART : (i + 1) * PART], PART)
                + part_checksums(memoryview(src1.numpy())[i * 3 * PART : (i + 1) * 3 * PART], PART) for i in range(2)]
        assert sums == [part_checksums(memoryview(o.numpy()), PART) for o in objects]
        assert write.seal(sums) == [node.segment_id] * 2
        _wait(lambda: len(first.lookup(keys)) == 2)

        dst0, dst1 = first_engine.alloc_shared(2 * PART), later_engine.alloc_shared(6 * PART)
        read = first.open_read(keys, first_engine.register(dst0), [0, PART], memoryview(dst0.numpy()), parts=mine)
        theirs_read = later.read_leased(read.leases(), later_engine.register(dst1), [0, 3 * PART],
                                        memoryview(dst1.numpy()), theirs)
        assert all(theirs_read.wait_part(p) for p in theirs) and read.wait_part(0)
        theirs_read.close()
        assert node.segment.stats()["leased_objects"] == 2  # the other client released nothing
        read.close()
        _wait(lambda: node.segment.stats()["leased_objects"] == 0)
        assert torch.equal(dst0.view(2, PART), objects[:, :PART])
        assert torch.equal(dst1.view(2, 3 * PART), objects[:, PART:])
        with pytest.raises(ValueError):
            read.wait_part(1)  # not among its parts
        node.close()


def test_a_burst_of_puts_spreads_over_equally_free_segments_and_misses_count():
    """The free space a client sees is a snapshot (refreshed about once a second); puts between
    two snapshots must not all land on the one segment that looked freest."""
    metadata = LocalMetadata()
    with Messenger(MessengerConfig(secret=SECRET)) as e1, Messenger(MessengerConfig(secret=SECRET)) as e2, \
            Messenger(MessengerConfig(secret=SECRET)) as writer_engine:
        a = _node(e1, metadata, "a", 8 * OBJ)
        b = _node(e2, metadata, "b", 8 * OBJ)
        writer = PoolClient(writer_engine, metadata, segments_ttl_s=60.0)
        buf = writer_engine.alloc_shared(OBJ)
        handle = writer_engine.register(buf)
        sums = part_checksums(memoryview(buf.numpy()), PART)
        holders = [writer.put(f"ns/{i}", handle, 0, OBJ, PART, sums) for i in range(6)]
        assert sorted(holders.count(s) for s in {a.segment_id, b.segment_id}) == [3, 3]
        _wait(lambda: len(writer.lookup([f"ns/{i}" for i in range(6)])) == 6)
        # Two objects past the stored run: misses, though the index never held them.
        got = writer.get([f"ns/{i}" for i in range(8)], handle, [0] * 8, memoryview(buf.numpy()))
        assert got == 6 and writer.counters["misses"] == 2
        a.close()
        b.close()


def test_hot_objects_get_more_replicas_and_reads_spread():
    metadata = LocalMetadata()
    with Messenger(MessengerConfig(secret=SECRET)) as e1, Messenger(MessengerConfig(secret=SECRET)) as e2, \
            Messenger(MessengerConfig(secret=SECRET)) as reader_engine:
        a = _node(e1, metadata, "a", 8 * OBJ, hot_reads=3, max_replicas=2)
        b = _node(e2, metadata, "b", 4 * OBJ, hot_reads=3, max_replicas=2)
        reader = PoolClient(reader_engine, metadata, segments_ttl_s=0.0)
        buf = reader_engine.alloc_shared(OBJ)
        handle = reader_engine.register(buf)
        buf[:] = 3
        sums = part_checksums(memoryview(buf.numpy()), PART)
        holder = reader.put("ns/hot", handle, 0, OBJ, PART, sums)  # most free: node a
        assert holder == a.segment_id
        _wait(lambda: reader.lookup(["ns/hot"]))  # sealed; its index entry follows asynchronously
        for _ in range(4):
            assert reader.get(["ns/hot"], handle, [0], memoryview(buf.numpy())) == 1
        _wait(lambda: len(reader.replicas("ns/hot")) == 2)
        assert a.segment.stats()["stores"] + b.segment.stats()["stores"] == 2
        assert a.replicas_made == 1
        for _ in range(6):
            reader.get(["ns/hot"], handle, [0], memoryview(buf.numpy()))
        assert b.segment.stats()["leases"] > 0  # the second replica serves reads too
        a.close()
        b.close()


# -- soft retention of sessions' objects (issue 42) -------------------------------------------------------
def test_a_sessions_objects_outlive_colder_ones_until_their_retention_ends(engine):
    clock = Clock()
    seg = Segment(engine, SegmentConfig(dram_bytes=5 * OBJ, high_watermark=0.8, session_retention_s=60),
                  clock=clock)
    for i, key in enumerate(["turn-head", "turn-tail", "cold-1", "cold-2"]):
        write_object(seg, key, i)
    seg.touch(["turn-head", "turn-tail"], retain=0)
    seg.touch(["cold-1", "cold-2"])  # used more recently than the session: plain LRU would keep them
    write_object(seg, "new", 9)
    write_object(seg, "newer", 10)
    assert sorted(seg.keys()) == ["new", "newer", "turn-head", "turn-tail"]
    clock.now += 61  # the retention is over: the session's objects are as cold as their last use
    write_object(seg, "newest", 11)
    assert "turn-tail" not in seg.keys() and seg.stats()["retained_evictions"] == 0
    seg.check()


def test_retained_objects_never_pin_and_never_pass_their_share(engine):
    clock = Clock()
    seg = Segment(engine, SegmentConfig(dram_bytes=5 * OBJ, high_watermark=0.8, retained_share=0.4),
                  clock=clock)
    for i, key in enumerate("abcd"):
        write_object(seg, key, i)
    seg.touch(["a", "b", "c"], retain=1)  # 3 objects, 60% of DRAM: the share is 40%
    assert sum(o.retain is not None for o in seg._objects.values()) == 2
    seg.touch(["d"], retain=0)  # a lower priority than what is retained: it is the one left out
    assert sorted(k for k, o in seg._objects.items() if o.retain is not None) == ["a", "b"]
    write_object(seg, "e", 20)
    write_object(seg, "f", 21)  # the cold "c" and "d" went
    assert sorted(seg.keys()) == ["a", "b", "e", "f"]
    seg.lease(["e", "f"])  # held by a reader: only the retained ones are left to evict
    write_object(seg, "g", 22)
    assert sorted(seg.keys()) == ["a", "e", "f", "g"]  # "b", the tail, ranked lowest
    assert seg.stats()["retained_evictions"] == 1
    seg.check()


def test_a_promoting_touch_brings_a_sessions_objects_up_from_ssd(engine, tmp_path):
    """Issue 42 item 4, a pre-staging's effect on a node: its objects on the SSD tier come up to
    DRAM bit-exact (as a read would bring them) and are retained there again."""
    seg = Segment(engine, SegmentConfig(dram_bytes=3 * OBJ, high_watermark=1.0, retained_share=1.0),
                  SsdTier(tmp_path / "ssd", 8 * OBJ))
    data = {key: write_object(seg, key, i) for i, key in enumerate(["turn-head", "turn-tail", "x", "y", "z"])}
    until = time.monotonic() + 5
    while seg.stats()["objects_ssd"] < 2 and time.monotonic() < until:
        time.sleep(0.01)  # demoted as x, y, z came (the SSD writes run after the lock)
    assert seg.stats()["objects_ssd"] == 2
    assert seg.touch(["turn-head", "turn-tail"], retain=0, promote=True) == 2
    stats = seg.stats()
    assert stats["promotions"] == 2 and stats["retained_objects"] == 2 and stats["objects_dram"] == 3
    for key in ("turn-head", "turn-tail"):
        assert leased_bytes(seg, seg.lease([key])[0]) == data[key]
    assert seg.touch(["turn-head"], promote=True) == 0  # in DRAM already
    seg.check()
