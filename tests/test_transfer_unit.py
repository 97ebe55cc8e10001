"""Transfer engine pieces without a second process: config, handles, handshake, wire checks,
checksum mismatches in both directions, batches as futures and awaitables."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import threading
import time

import pytest
import torch

from cluster.messenger import (
    AuthenticationError,
    Batch,
    ChecksumError,
    RegionHandle,
    MessengerConfig,
    Messenger,
    TransferError,
)
from cluster.messenger.auth import client_handshake, server_handshake
from cluster.messenger.wire import (
    CHECKSUM,
    FLAG_CHECKSUM,
    REPLY,
    REQUEST,
    SLICE,
    Op,
    Status,
    checksum,
    recv_buffers,
    recv_exact,
    recv_struct,
    send_buffers,
)
from cluster.messenger.regions import RegionTable
from cluster.messenger.tcp import connect

SECRET = b"unit test cluster secret"


def config(**overrides) -> MessengerConfig:
    return MessengerConfig(secret=SECRET, timeout_s=overrides.pop("timeout_s", 5.0), transport=overrides.pop("transport", "tcp"), **overrides)


@pytest.mark.parametrize(
    "bad",
    [
        {"secret": b"short"},
        {"port": 70000},
        {"streams": 0},
        {"slice_bytes": 100},
        {"slice_bytes": 1 << 20, "message_bytes": 1 << 19},
        {"timeout_s": 0},
        {"transport": "carrier-pigeon"},
        {"socket_buffer_bytes": 1024},
        {"rdma_gid_index": -1},
        {"host": ""},
    ],
)
def test_config_rejects_invalid_values(bad):
    kwargs = {"secret": SECRET, **bad}
    with pytest.raises(ValueError):
        MessengerConfig(**kwargs)


def test_defaults_listen_on_loopback():
    assert MessengerConfig(secret=SECRET).host == "127.0.0.1"


def test_handle_round_trips_as_plain_data():
    handle = RegionHandle("abc", "127.0.0.1:1", 42, 4096, True)
    assert RegionHandle.from_dict(handle.to_dict()) == handle
    with pytest.raises(ValueError):
        RegionHandle.from_dict({"engine_id": "abc", "address": "x", "region_id": 1})
    with pytest.raises(ValueError):
        RegionHandle.from_dict({**handle.to_dict(), "length": 0})


def test_region_table_checks_bounds_ids_and_write_access():
    table = RegionTable()
    rw = table.add(bytearray(100))
    ro = table.add(bytes(100))
    assert table.resolve(rw.region_id, 90, 10, write=True)[0] == Status.OK
    assert table.resolve(rw.region_id, 91, 10, write=True)[0] == Status.OUT_OF_BOUNDS
    assert table.resolve(rw.region_id, -1, 10, write=False)[0] == Status.OUT_OF_BOUNDS
    assert table.resolve(rw.region_id, 0, 0, write=False)[0] == Status.OUT_OF_BOUNDS
    assert table.resolve(rw.region_id + 1, 0, 1, write=False)[0] == Status.UNKNOWN_REGION
    assert table.resolve(ro.region_id, 0, 1, write=True)[0] == Status.READ_ONLY
    assert table.resolve(ro.region_id, 0, 1, write=False)[0] == Status.OK


def test_registers_tensors_of_any_dtype_and_buffers_but_not_strided_or_empty():
    table = RegionTable()
    assert table.add(torch.zeros(10, dtype=torch.bfloat16)).length == 20
    assert table.add(memoryview(bytearray(8)).cast("I")).length == 8
    with pytest.raises(TransferError):
        table.add(torch.zeros(4, 4)[:, 0])
    with pytest.raises(TransferError):
        table.add(bytearray())
    with pytest.raises(TransferError):
        table.add(object())


def test_handshake_both_ways_and_wrong_secret():
    for server_secret, ok in ((SECRET, True), (b"another secret, not ours", False)):
        a, b = socket.socketpair()
        a.settimeout(5)
        b.settimeout(5)
        result = {}

        def serve() -> None:
            try:
                result["hello"] = server_handshake(b, server_secret, {"who": "server"})
            except AuthenticationError as exc:
                result["error"] = exc
                b.close()  # what the Messenger does: close without a word

        t = threading.Thread(target=serve)
        t.start()
        if ok:
            assert client_handshake(a, SECRET, {"who": "client"}) == {"who": "server"}
        else:
            with pytest.raises(AuthenticationError):
                client_handshake(a, SECRET, {"who": "client"})
        t.join(5)
        assert ("hello" in result) == ok
        a.close()
        b.close()


def test_send_and_receive_many_buffers_with_short_reads():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    chunks = [bytes([i]) * (1000 * i + 1) for i in range(40)]
    t = threading.Thread(target=send_buffers, args=(a, [memoryview(c) for c in chunks]))
    t.start()
    out = [bytearray(len(c)) for c in chunks]
    recv_buffers(b, [memoryview(o) for o in out])
    t.join(5)
    assert [bytes(o) for o in out] == chunks
    a.close()
    assert recv_struct(b, REPLY) is None  # clean EOF before a message
    b.close()


def _raw_stream(engine: Messenger) -> socket.socket:
    sock, _ = connect(engine.address, config(), {"engine_id": "raw", "host": "elsewhere", "rdma": False})
    return sock


def test_owner_rejects_a_write_whose_checksum_does_not_match():
    with Messenger(config()) as owner:
        region = torch.zeros(8192, dtype=torch.uint8)
        handle = owner.register(region)
        sock = _raw_stream(owner)
        payload = bytes(range(256)) * 16
        header = REQUEST.pack(Op.WRITE, FLAG_CHECKSUM, 1, 1, len(payload))
        send_buffers(sock, [header + SLICE.pack(handle.region_id, 0, len(payload), checksum(memoryview(payload)) ^ 1), payload])
        status, _, index, msg_id, _ = recv_struct(sock, REPLY)
        assert (Status(status), index, msg_id) == (Status.CHECKSUM_MISMATCH, 0, 1)
        # The same slice with the right checksum lands, on the same connection.
        send_buffers(sock, [REQUEST.pack(Op.WRITE, FLAG_CHECKSUM, 1, 2, len(payload)) + SLICE.pack(handle.region_id, 0, len(payload), checksum(memoryview(payload))), payload])
        assert Status(recv_struct(sock, REPLY)[0]) == Status.OK
        # The owner verifies bytes it did not receive itself (what the RDMA path asks for).
        send_buffers(sock, [REQUEST.pack(Op.CHECK, FLAG_CHECKSUM, 1, 3, 0) + SLICE.pack(handle.region_id, 0, 4096, 12345)])
        assert Status(recv_struct(sock, REPLY)[0]) == Status.CHECKSUM_MISMATCH
        sock.close()


class LyingOwner:
    """Speaks the protocol but corrupts the checksum of every read reply it sends."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.region = bytes(range(256)) * 64
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.settimeout(5)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            server_handshake(conn, SECRET, {"engine_id": "liar", "host": "elsewhere", "rdma": False})
            while (header := recv_struct(conn, REQUEST)) is not None:
                _, _, count, msg_id, _ = header
                raw = bytearray(SLICE.size * count)
                recv_exact(conn, memoryview(raw))
                slices = [self.region[o : o + n] for _, o, n, _ in SLICE.iter_unpack(raw)]
                sums = b"".join(CHECKSUM.pack(checksum(memoryview(s)) ^ 1) for s in slices)
                send_buffers(conn, [REPLY.pack(Status.OK, FLAG_CHECKSUM, 0, msg_id, sum(map(len, slices))) + sums, *slices])
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.listener.close()


def test_reader_rejects_slices_whose_checksum_does_not_match():
    liar = LyingOwner()
    with Messenger(config(checksum=True)) as engine:
        local = engine.register(bytearray(4096))
        remote = RegionHandle("liar", liar.address, 1, 16384)
        with pytest.raises(ChecksumError):
            engine.read(liar.address, [(local, 0, remote, 0, 4096)]).wait(10)
    liar.close()


def test_batch_is_a_future_and_an_awaitable():
    batch = Batch()
    batch.expect(2)
    batch.part_done()
    assert not batch.done()
    batch.part_done()
    batch.wait(1)
    failed = Batch()
    failed.expect(2)
    failed.fail(TransferError("first"))
    failed.fail(TransferError("second"))  # only the first error is kept
    failed.part_done()
    with pytest.raises(TransferError, match="first"):
        failed.wait(1)

    async def waiter() -> None:
        late = Batch()
        late.expect(1)
        asyncio.get_running_loop().call_later(0.01, late.part_done)
        await late

    asyncio.run(waiter())


def test_empty_batch_completes_and_foreign_local_handles_are_refused():
    with Messenger(config()) as a, Messenger(config()) as b:
        theirs = b.register(bytearray(64))
        a.write(b.address, []).wait(5)
        with pytest.raises(TransferError, match="not a region of this engine"):
            a.write(b.address, [(theirs, 0, theirs, 0, 8)]).wait(5)
        with pytest.raises(TransferError, match="unknown transport"):
            a.write(b.address, [], transport="smoke-signals").wait(5)


def test_a_stalled_handshake_is_cut_at_its_deadline(monkeypatch):
    """Issue 31: a stranger trickling its handshake a byte at a time held a server thread for as
    long as it kept trickling; now the whole handshake has a deadline."""
    from cluster.messenger import region_server

    monkeypatch.setattr(region_server, "HANDSHAKE_TIMEOUT_S", 0.5)
    with Messenger(config()) as engine:
        host, port = engine.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=5)
        assert len(sock.recv(64)) > 0  # the challenge
        sock.settimeout(0.1)
        start, closed = time.monotonic(), False
        while time.monotonic() - start < 5 and not closed:
            try:
                sock.sendall(b"x")  # one byte of a nonce every 0.1 s
                closed = sock.recv(1) == b""
            except socket.timeout:
                pass
            except OSError:  # reset: closed as well
                closed = True
        assert closed and time.monotonic() - start < 2.0
        sock.close()
        # A peer with the secret is still served.
        _raw_stream(engine).close()


def _silent(engine: Messenger, source: str) -> socket.socket:
    """A stranger from ``source`` (a loopback address) that connects and never answers."""
    host, port = engine.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(0.05)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if sock.recv(4096) == b"":
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False


def test_one_stranger_cannot_hold_every_handshake_slot():
    """Issue 40: 64 silent connections from one address held every pre-authentication slot, and
    no peer could connect for the handshake deadline. Issue 52: 16 from one address then turned
    away a peer of the same host that holds the secret, and its error blamed the secret. Now a
    newcomer past 16 from an address takes the slot of the oldest from it (a peer with the secret
    needs it for a round trip); past half of all slots, a new connection has 0.5 s, not 5."""
    from cluster.messenger import region_server

    with Messenger(config()) as engine:
        held = [_silent(engine, "127.0.0.1") for _ in range(region_server.MAX_HANDSHAKES_PER_ADDRESS)]
        try:
            time.sleep(0.2)  # accepted, each in its handshake
            over = _silent(engine, "127.0.0.1")
            assert _closed_within(held[0], 2.0), "the oldest of the address kept its slot"
            assert not _closed_within(over, 0.3), "the newcomer was turned away"
            held[0] = over
            _raw_stream(engine).close()  # a peer with the secret, from the same address: served
            assert engine._messenger.evicted_handshakes >= 1
            elsewhere = _silent(engine, "127.0.0.2")
            assert not _closed_within(elsewhere, 0.3), "a connection from another address was turned away"
            # Past half the slots (16 + 16 + 1 held), a newcomer's deadline is the short one.
            held += [_silent(engine, "127.0.0.3") for _ in range(16)] + [elsewhere]
            time.sleep(0.2)
            start = time.monotonic()
            pressed = _silent(engine, "127.0.0.4")
            assert _closed_within(pressed, 3.0) and time.monotonic() - start < 2.0
            pressed.close()
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)
        _raw_stream(engine).close()  # a peer with the secret is served


def test_the_acceptor_survives_running_out_of_descriptors(caplog):
    """Issue 31: the first failed accept() (EMFILE here) ended the acceptor, and with it every
    later transfer to this instance."""
    with Messenger(config()) as engine:
        host, port = engine.address.rsplit(":", 1)
        client = socket.socket()  # made while there are descriptors
        client.settimeout(5)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fillers: list[int] = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
            with contextlib.suppress(OSError):
                while True:
                    fillers.append(os.open(os.devnull, os.O_RDONLY))
            client.connect((host, int(port)))  # queued by the kernel; the server's accept() fails
            time.sleep(0.5)
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert any("accept() on" in r.getMessage() for r in caplog.records), "accept() never failed"
        hello = client_handshake(client, SECRET, {"engine_id": "raw", "host": "elsewhere", "rdma": False})
        assert hello["engine_id"] == engine.engine_id
        client.close()
