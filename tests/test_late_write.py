"""A late write cannot corrupt (issue 23 §5), and the engine thread's KV writes hold no lock the
event loop takes (issue 23 §3), without processes.

* a guarded range refuses a write naming an ended use of it (its generation), over TCP and
  shared memory, and the range's new owner keeps its bytes (``RegionTable.guard``);
* the same through a reservation: a sender that writes after the reservation was released and
  its range reused is refused (``StaleWrite``), and the new reservation's bytes are intact;
* a layer whose bytes changed after they were written fails its checksum: the reservation's
  take-over refuses it (``KVWriteFailed``) and none of its blocks join the prefix cache;
* an abort that arrives before its prefill is remembered: the prefill is refused
  (``UnknownReservation``), not run;
* ``KVSender.expect`` / ``finish`` return at once while a ``layer_done`` write is stuck (a
  reconnect to a dead peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from cluster.kv_stream import KVDestination, KVSender, layer_checksums
from cluster.instance.prefill import Prefiller
from cluster.instance.receiver import Receiver
from cluster.messenger import Messenger, MessengerConfig, StaleWrite
from cluster.messenger.staging import StagingArea
from cluster.protocol import Fence, KVWriteFailed, NotOwner, UnknownReservation
from engine.hooks import PromptChunk
from engine.kv_layout import KVLayout
from engine.sampling_params import SamplingParams
from tests.decode_side import tiny_decode_side

SECRET = b"late write test cluster secret"
PROMPT = list(range(10, 10 + 40))  # 3 blocks of 16
PARAMS = SamplingParams(max_tokens=4)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_write_for_an_ended_use_of_a_range_is_refused(transport):
    owner = Messenger(MessengerConfig(secret=SECRET, transport=transport))
    writer = Messenger(MessengerConfig(secret=SECRET, transport=transport))
    try:
        recv, send = StagingArea(owner, 1 << 16), StagingArea(writer, 1 << 16)
        recv.guard()
        src = send.allocate(4096)

        def write(dst, value: int, generation):
            send.buffer[src.offset : src.offset + 4096] = value
            writer.write(owner.address, [(send.handle, src.offset, recv.handle, dst.offset, 4096)],
                         generation=generation).wait(10)

        old = recv.allocate(4096)
        write(old, 1, old.generation)  # the range's first use
        recv.release(old)
        new = recv.allocate(4096)
        assert new.offset == old.offset and new.generation != old.generation
        write(new, 2, new.generation)
        with pytest.raises(StaleWrite):
            write(new, 3, old.generation)  # the first use's sender, late
        with pytest.raises(StaleWrite):
            write(new, 4, None)  # a write into a guarded area must name its use
        beyond = SimpleNamespace(offset=new.offset + 2048)
        with pytest.raises(StaleWrite):
            write(beyond, 5, new.generation)  # past the end of the range it names
        assert bool((recv.buffer[new.offset : new.offset + 4096] == 2).all()), "the new owner's bytes changed"
        recv.revoke(new)
        with pytest.raises(StaleWrite):
            write(new, 6, new.generation)  # ended, not yet freed
        recv.release(new)
        # An unguarded area takes writes as before.
        plain = StagingArea(owner, 1 << 12)
        writer.write(owner.address, [(send.handle, src.offset, plain.handle, 0, 4096)]).wait(10)
    finally:
        writer.close(), owner.close()


# -- through reservations -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    with tiny_decode_side(tmp_path_factory.mktemp("tiny"), SECRET, "tcp", peer=True) as d:
        yield d


def _receiver(d, lease_s: float = 30.0, transfer_timeout_s: float = 0.1) -> Receiver:
    return Receiver(d.client, d.handoff, d.staging, d.transfer.address, lease_s, transfer_timeout_s)


def _send_all(d, dest: KVDestination, fill: torch.Tensor | None = None) -> torch.Tensor:
    """Act as the prefill instance: write a whole KV (random, or ``fill``) and its checksums into
    ``dest`` with one write naming the destination's generation; returns the KV written."""
    layout, n = d.layout, dest.num_blocks
    kv = torch.randn(layout.shape(n)).to(layout.torch_dtype) if fill is None else fill
    trailer = layer_checksums(kv, dest.generation)
    nbytes = layout.nbytes(n) + len(trailer)
    src = d.send.allocate(nbytes)
    try:
        d.send.buffer[src.offset : src.offset + layout.nbytes(n)] = kv.reshape(-1).view(torch.uint8)
        d.send.buffer[src.offset + layout.nbytes(n) : src.offset + nbytes] = torch.frombuffer(bytearray(trailer),
                                                                                             dtype=torch.uint8)
        d.peer.write(dest.address, [(d.send.handle, src.offset, dest.region, dest.offset, nbytes)],
                     generation=dest.generation).wait(10)
    finally:
        d.send.release(src)
    return kv


def _received(d, dest: KVDestination) -> torch.Tensor:
    n = d.layout.nbytes(dest.num_blocks)
    return d.staging.buffer[dest.offset : dest.offset + n].view(d.layout.torch_dtype).view(d.layout.shape(dest.num_blocks))


async def _nothing_held(d, r: Receiver, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        used = await d.client.call(lambda e: (e.block_manager.pool.num_in_use, list(e.seqs)))
        state = (len(r), *used, d.staging.num_allocated)
        if state == (0, 0, [], 0):
            d.staging.check()
            return
        assert time.monotonic() < deadline, f"still held (leases, blocks, seqs, staging ranges): {state}"
        await asyncio.sleep(0.02)


def test_a_late_write_after_release_and_reuse_is_refused(decode):
    d = decode

    async def scenario():
        r = _receiver(d)
        first = await r.reserve("late-1", PROMPT, PARAMS, Fence("c", 1))
        assert first.generation is not None and first.sums
        # Released while its prefill still runs (the Conductor gave up): the range is reused
        # after twice the transfer timeout.
        await r.release("late-1", settled=False)
        await asyncio.sleep(0.3)
        second = await r.reserve("late-2", PROMPT, PARAMS, Fence("c", 1))
        assert second.offset == first.offset, "the test wants the range reused"
        kv = await asyncio.to_thread(_send_all, d, second)
        with pytest.raises(StaleWrite):
            await asyncio.to_thread(_send_all, d, first)  # the first prefill, late
        assert torch.equal(_received(d, second), kv), "a late write changed the new reservation's KV"
        cached = await d.client.call(r.take_over(lambda h, got: h.adopt("late-2", got), "late-2"))
        assert cached == 2  # the two full blocks
        await _nothing_held(d, r)

    asyncio.run(scenario())


def test_a_corrupted_layer_is_refused_and_its_blocks_are_not_cached(decode):
    d = decode
    prompt = list(range(100, 140))

    async def scenario():
        r = _receiver(d)
        dest = await r.reserve("corrupt-1", prompt, PARAMS, Fence("c", 1))
        await asyncio.to_thread(_send_all, d, dest)
        before = await d.client.call(lambda e: len(e.block_manager.pool.cached_keys()))
        # One byte of layer 1 changes after it landed (a write that slipped past the check).
        at = dest.offset + d.layout.layer_bytes(dest.num_blocks) + 123
        d.staging.buffer[at] = d.staging.buffer[at] ^ 0xFF
        with pytest.raises(KVWriteFailed, match="layer 1"):
            await d.client.call(r.take_over(lambda h, kv: h.adopt("corrupt-1", kv), "corrupt-1"))
        after = await d.client.call(lambda e: len(e.block_manager.pool.cached_keys()))
        assert after == before, "blocks of a corrupt KV joined the prefix cache"
        await _nothing_held(d, r)
        # The same prompt, intact, is taken.
        dest = await r.reserve("corrupt-2", prompt, PARAMS, Fence("c", 1))
        await asyncio.to_thread(_send_all, d, dest)
        assert await d.client.call(r.take_over(lambda h, kv: h.adopt("corrupt-2", kv), "corrupt-2")) == 2
        await _nothing_held(d, r)

    asyncio.run(scenario())


def test_a_layer_never_written_into_a_reused_range_is_refused_not_taken_from_the_last_use(decode):
    """The range of a finished request is reused by one of the same length; the new sender never
    writes layer 2 (neither its KV nor its checksum): the range still holds the first request's
    layer 2 and its checksum, consistent with each other. The checksums are keyed by the range's
    use, so this is refused (bench.faults' kv-layer-never-sent row answered another prompt's
    tokens before)."""
    d = decode
    layout = d.layout

    async def scenario():
        r = _receiver(d)
        first = await r.reserve("reuse-1", list(range(150, 190)), PARAMS, Fence("c", 1))
        await asyncio.to_thread(_send_all, d, first)
        assert await d.client.call(r.take_over(lambda h, kv: h.adopt("reuse-1", kv), "reuse-1")) == 2
        left = d.staging.buffer[first.offset : first.offset + layout.nbytes(first.num_blocks) + 8 * layout.num_layers].clone()
        second = await r.reserve("reuse-2", list(range(200, 240)), PARAMS, Fence("c", 1))
        assert (second.offset, second.num_blocks) == (first.offset, first.num_blocks), "the test wants the range reused"
        await asyncio.to_thread(_send_all, d, second)
        # Layer 2 and its checksum as the first use left them: the writes of layer 2 never came.
        lb, base = layout.layer_bytes(second.num_blocks), second.offset
        for lo, hi in ((2 * lb, 3 * lb), (layout.nbytes(second.num_blocks) + 16, layout.nbytes(second.num_blocks) + 24)):
            d.staging.buffer[base + lo : base + hi] = left[lo:hi]
        with pytest.raises(KVWriteFailed, match="layer 2"):
            await d.client.call(r.take_over(lambda h, kv: h.adopt("reuse-2", kv), "reuse-2"))
        await _nothing_held(d, r)

    asyncio.run(scenario())


def test_only_the_conductor_that_made_a_reservation_releases_adopts_or_continues_it(decode):
    """Issue 40 item 3: aborts and releases are checked against the reservation's owner. Another
    Conductor's release is refused (``NotOwner``) and the reservation stays; its early abort of
    an id does not refuse the owner's reserve of it; the owner's release works."""
    d = decode

    async def scenario():
        r = _receiver(d)
        owner, other = Fence("conductor-a", 1), Fence("conductor-b", 7)
        await r.reserve("owned-1", PROMPT, PARAMS, owner)
        with pytest.raises(NotOwner):
            await r.release("owned-1", settled=True, fence=other)
        with pytest.raises(NotOwner):
            r.check_owner("owned-1", other)
        r.check_owner("owned-1", owner)
        assert "owned-1" in r
        # Another Conductor's abort of an id it does not hold: remembered as its own only.
        assert await r.release("owned-2", settled=True, fence=other) is False
        await r.reserve("owned-2", PROMPT, PARAMS, owner)
        assert await r.release("owned-2", settled=True, fence=owner) is True
        with pytest.raises(UnknownReservation):  # the owner's own early abort still refuses it
            await r.reserve("owned-2", PROMPT, PARAMS, owner)
        assert await r.release("owned-1", settled=True, fence=owner) is True
        await _nothing_held(d, r)

    asyncio.run(scenario())


def test_an_abort_before_the_prefill_is_remembered(decode):
    d = decode

    async def scenario():
        r = _receiver(d)
        assert await r.release("early-abort", settled=True) is False  # not seen here yet
        assert r.aborted("early-abort") and not r.aborted("another")
        sender = KVSender(d.peer, d.send, d.layout)
        engine = SimpleNamespace()  # never reached: the prefill is refused before it starts
        prefiller = Prefiller(engine, sender, 1.0, aborted=r.aborted)
        dest = KVDestination(d.transfer.address, d.staging.handle, 0, 0, 3)
        with pytest.raises(UnknownReservation):
            await prefiller.prefill("early-abort", PROMPT, PARAMS, dest)
        assert not sender._out and d.send.num_allocated == 0

    asyncio.run(scenario())


def test_a_release_cancelled_while_the_engine_drops_still_frees_blocks_and_staging(decode):
    """A release whose caller is cancelled while the engine thread is busy (the drop waits for
    the step) must still drop the blocks and free the receive staging: the lease is gone, so
    nothing else ever would."""
    d = decode
    gate = asyncio.Event()

    class BusyEngine:  # the engine thread in a long step: a call waits for the gate
        async def call(self, fn):
            await gate.wait()
            return await d.client.call(fn)

    async def scenario():
        gate.set()
        r = Receiver(BusyEngine(), d.handoff, d.staging, d.transfer.address, 30.0, 0.1)
        await r.reserve("cancelled-release", PROMPT, PARAMS, Fence("c", 1))
        assert d.staging.num_allocated == 1
        gate.clear()
        releasing = asyncio.ensure_future(r.release("cancelled-release", settled=True, fence=Fence("c", 1)))
        await asyncio.sleep(0.05)
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        assert d.staging.num_allocated == 0  # settled: freed at once
        gate.set()  # the step ends: the drop runs after all
        await _nothing_held(d, r)

    asyncio.run(scenario())


# -- the engine thread's writes hold no lock the event loop takes ----------------------------------------

@contextlib.contextmanager
def _stuck_writes() -> Iterator[SimpleNamespace]:
    """A ``KVSender`` (``sender``, over ``send`` staging, ``layout``) whose Messenger writes block,
    as a reconnect to a dead peer does, until ``stuck`` is set, then fail; ``entered`` is set once
    a write has started."""
    transfer = Messenger(MessengerConfig(secret=SECRET, transport="tcp"))
    try:
        layout = KVLayout(2, 1, 4, 8, "float32")
        send = StagingArea(transfer, 1 << 16)
        stuck, entered = threading.Event(), threading.Event()

        def write(peer, entries, **kw):
            entered.set()
            stuck.wait(10)
            from cluster.messenger import Batch, PeerError
            b = Batch()
            b.fail(PeerError("cannot connect"))
            return b

        transfer.write = write
        yield SimpleNamespace(sender=KVSender(transfer, send, layout), send=send, layout=layout,
                              stuck=stuck, entered=entered)
    finally:
        transfer.close()


def test_expect_and_finish_do_not_wait_for_a_stuck_layer_write():
    with _stuck_writes() as w:
        sender, send = w.sender, w.send
        region = send.handle
        dest = KVDestination("127.0.0.1:9", region, 0, 0, 1)
        kv_cache = torch.randn(w.layout.shape(4))

        async def scenario():
            sender.expect("stuck", dest)
            engine = threading.Thread(target=sender.layer_done, args=(
                0, kv_cache, [PromptChunk("stuck", [0], 0, 3, 3)]))
            engine.start()
            assert await asyncio.to_thread(w.entered.wait, 5)
            try:
                start = time.monotonic()
                sender.expect("other", KVDestination("127.0.0.1:9", region, 0, 1, 0))  # all cached there
                report = await asyncio.wait_for(sender.finish("other", 5.0), 2.0)
                assert time.monotonic() - start < 1.0
                assert report.bytes_sent == 0
                # The stuck request's own finish waits for its write, off the event loop.
                finishing = asyncio.ensure_future(sender.finish("stuck", 5.0))
                await asyncio.sleep(0.1)
                assert not finishing.done()
            finally:
                w.stuck.set()
            with pytest.raises(Exception, match="cannot connect|KV write failed|only"):
                await finishing
            await asyncio.to_thread(engine.join, 5)
            assert send.num_allocated == 0

        asyncio.run(scenario())


def test_a_finish_cancelled_while_a_layer_write_is_stuck_frees_the_staging_after_it():
    """The Conductor hangs up (the prefill is cancelled) while ``finish`` waits for a layer the
    engine thread is still handing to a dead peer: the send staging is freed once that write
    gives up, not held for good."""
    with _stuck_writes() as w:
        sender, send = w.sender, w.send
        dest = KVDestination("127.0.0.1:9", send.handle, 0, 0, 1)

        async def scenario():
            sender.expect("hung-up", dest)
            engine = threading.Thread(target=sender.layer_done, args=(
                0, torch.randn(w.layout.shape(4)), [PromptChunk("hung-up", [0], 0, 3, 3)]))
            engine.start()
            try:
                assert await asyncio.to_thread(w.entered.wait, 5)
                finishing = asyncio.ensure_future(sender.finish("hung-up", 5.0))
                await asyncio.sleep(0.1)
                finishing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await finishing
                assert [owner for owner, _ in send.holders()] == ["hung-up"]  # the engine thread may still pack into it
            finally:
                w.stuck.set()
            await asyncio.to_thread(engine.join, 5)
            deadline = time.monotonic() + 5
            while send.num_allocated and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert send.num_allocated == 0 and not sender._out
            send.check()

        asyncio.run(scenario())


def test_an_abort_that_comes_while_the_pool_is_asked_releases_the_pool_load(decode):
    """The second check of an early abort (after the pool was asked) used to raise before the
    code that closes the pool load: its staging range was held for good (bench.chaos found one)."""
    d = decode
    closed: list[bool] = []
    checks = iter([False, True])  # not aborted on arrival; aborted once the pool has answered

    class Pool:
        async def prepare_load(self, request_id, token_ids, salt=None):
            return SimpleNamespace(close=lambda used: closed.append(used))

        def start(self, request_id, token_ids, params, load, session):
            return lambda engine: None  # never run: the engine is never reached

        async def plan_store(self, request_id, token_ids, salt=None):
            return False

    async def scenario():
        sender = KVSender(d.peer, d.send, d.layout)
        prefiller = Prefiller(SimpleNamespace(), sender, 1.0, pool=Pool(), aborted=lambda rid: next(checks))
        dest = KVDestination(d.transfer.address, d.staging.handle, 0, 0, 3)
        with pytest.raises(UnknownReservation):
            await prefiller.prefill("aborted-mid-way", PROMPT, PARAMS, dest)
        assert closed == [False], "the pool load was not released"
        assert not sender._out and d.send.num_allocated == 0

    asyncio.run(scenario())
