"""Owning side: the RegionServer answers peers' requests against this engine's registered regions.

It listens (loopback unless configured otherwise), authenticates every connection with the
cluster secret, then serves one connection per thread. Each request's descriptors are resolved
against the :class:`RegionTable` *before* any byte of memory is touched: an unknown handle or an
out-of-range slice gets an error reply, and a refused write's bytes are read off the socket and
dropped so the stream stays in sync. A write into a guarded region (``RegionTable.guard``) must
name the generation of the range it writes (``FLAG_GENERATION``), checked the same way: a write for
an earlier use of a range is refused (``Status.STALE``) before any byte of it lands.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable

from .auth import server_handshake
from .config import MessengerConfig
from .errors import AuthenticationError
from .wire import (
    CHECKSUM,
    FLAG_CHECKSUM,
    FLAG_GENERATION,
    FLAG_WRITE,
    GENERATION,
    MAX_CONTROL_PAYLOAD,
    MAX_SLICES_PER_MESSAGE,
    REPLY,
    REQUEST,
    SLICE,
    Op,
    Status,
    checksum,
    decode_json,
    drain,
    encode_json,
    recv_buffers,
    recv_exact,
    recv_struct,
    send_buffers,
)
from .regions import RegionTable

log = logging.getLogger(__name__)

# A control handler gets the request's JSON and returns a status and the JSON to send back.
ControlHandler = Callable[[dict, dict], tuple[Status, dict]]


# A connecting peer must finish the handshake within this many seconds; at most this many
# connections may be in their handshake at once: strangers cannot tie up threads, while peers
# that hold the secret finish in a round trip.
HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 64
# And at most this many from one address, so that one stranger cannot hold every slot
# while peers elsewhere wait. Past either bound a newcomer takes the slot of the oldest connection
# still in its handshake (from its address, else from any): a silent stranger cannot lock out a
# peer of the same host that holds the secret, which needs its slot for a round trip
# only. Once half the slots are taken, a new connection's handshake gets this much time only: a
# stranger must then come back every fraction of a second to keep its slots.
MAX_HANDSHAKES_PER_ADDRESS = 16
# Slots over the bounds while evicted connections' threads wind down; past this many, a newcomer
# is closed as it comes (a flood of connections faster than their threads end).
EVICTION_SLACK = 8
CROWDED_HANDSHAKE_TIMEOUT_S = 0.5
# After a failed accept() (out of descriptors, a connection reset while queued), how long the
# acceptor waits before the next one: the listener stays open, the next peer is served.
ACCEPT_RETRY_S = 0.1


class RegionServer:
    """Listens for peers and serves their reads, writes and control requests."""

    def __init__(self, config: MessengerConfig, table: RegionTable, hello: dict, handlers: dict[Op, ControlHandler]) -> None:
        self._config = config
        self._table = table
        self._hello = hello
        self._handlers = handlers
        self._listener = socket.create_server((config.host, config.port), backlog=128, reuse_port=False)
        host, port = self._listener.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._handshakes = 0
        self._handshakes_from: dict[str, int] = {}  # address -> connections in their handshake
        self._in_handshake: OrderedDict[socket.socket, str] = OrderedDict()  # oldest first -> address
        self.evicted_handshakes = 0
        self._accept_errors = 0
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"messenger {self.address}", daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._acceptor.join(timeout=2)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                # EMFILE and the like cost the connection waiting in the queue, never the listener.
                self._accept_errors += 1
                if self._accept_errors & (self._accept_errors - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...
                    log.warning("transfer: accept() on %s failed (%d so far): %s", self.address,
                                self._accept_errors, exc)
                self._closed.wait(ACCEPT_RETRY_S)
                continue
            address = peer[0]
            with self._lock:
                from_here = self._handshakes_from.get(address, 0)
                crowded = (self._handshakes >= MAX_HANDSHAKES + EVICTION_SLACK
                           or from_here >= MAX_HANDSHAKES_PER_ADDRESS + EVICTION_SLACK)
                victim = None
                if not crowded:
                    if from_here >= MAX_HANDSHAKES_PER_ADDRESS:
                        victim = self._oldest_handshake(address)
                    elif self._handshakes >= MAX_HANDSHAKES:
                        victim = self._oldest_handshake(None)
                    self._handshakes += 1
                    self._handshakes_from[address] = from_here + 1
                    self._in_handshake[conn] = address
                    self._conns.add(conn)
                    pressed = self._handshakes > MAX_HANDSHAKES // 2
            if crowded:
                conn.close()
                continue
            if victim is not None:
                self.evicted_handshakes += 1
                try:
                    victim.shutdown(socket.SHUT_RDWR)  # its thread sees the end and gives the slot back
                except OSError:
                    pass
            deadline = min(CROWDED_HANDSHAKE_TIMEOUT_S if pressed else HANDSHAKE_TIMEOUT_S, self._config.timeout_s)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._config.socket_buffer_bytes)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._config.socket_buffer_bytes)
                conn.settimeout(self._config.timeout_s)  # the handshake then shortens it to its deadline
                threading.Thread(target=self._serve, args=(conn, peer, deadline), name=f"messenger conn {peer}",
                                 daemon=True).start()
            except (OSError, RuntimeError) as exc:  # a peer gone already; no thread to be had
                log.debug("transfer: connection from %s dropped before serving: %s", peer, exc)
                self._forget(conn, address, handshaking=True)

    def _oldest_handshake(self, address: str | None) -> socket.socket | None:
        """Under the lock: the connection longest in its handshake (from ``address``, or any),
        taken out of the order so that it is evicted once."""
        for conn, at in self._in_handshake.items():
            if address is None or at == address:
                del self._in_handshake[conn]
                return conn
        return None

    def _handshake_over(self, conn: socket.socket, address: str) -> None:
        """Under the lock: ``conn``, from ``address``, is out of its handshake."""
        self._in_handshake.pop(conn, None)
        self._handshakes -= 1
        left = self._handshakes_from[address] - 1
        if left:
            self._handshakes_from[address] = left
        else:
            del self._handshakes_from[address]

    def _forget(self, conn: socket.socket, address: str, handshaking: bool) -> None:
        with self._lock:
            self._conns.discard(conn)
            if handshaking:
                self._handshake_over(conn, address)
        conn.close()

    def _serve(self, conn: socket.socket, peer: tuple, deadline_s: float) -> None:
        handshaking = True
        try:
            try:
                peer_hello = server_handshake(conn, self._config.secret, self._hello, timeout_s=deadline_s)
            except AuthenticationError as exc:
                log.warning("transfer: refused peer %s:%s: %s", peer[0], peer[1], exc)
                return
            with self._lock:
                self._handshake_over(conn, peer[0])
            handshaking = False
            conn.settimeout(self._config.timeout_s)
            while not self._closed.is_set():
                header = recv_struct(conn, REQUEST, idle_ok=lambda: True)
                if header is None:
                    return
                if not self._handle(conn, peer_hello, *header):
                    return
        except (OSError, ConnectionError, ValueError) as exc:
            # A peer that vanished mid-message (or stalled in its handshake) only costs its own
            # connection.
            log.debug("transfer: connection from %s closed: %s", peer, exc)
        finally:
            self._forget(conn, peer[0], handshaking)

    def _handle(self, conn: socket.socket, peer_hello: dict, op: int, flags: int, count: int, msg_id: int, payload: int) -> bool:
        """Serve one request; False when the stream can no longer be trusted and must close."""
        if count > MAX_SLICES_PER_MESSAGE:
            return False
        raw = bytearray(SLICE.size * count)
        if count and not recv_exact(conn, memoryview(raw)):
            return False
        slices = list(SLICE.iter_unpack(raw))
        generation = None
        if flags & FLAG_GENERATION:
            tail = recv_struct(conn, GENERATION)
            if tail is None:
                return False
            generation = tail[0]
        if op == Op.WRITE:
            return self._write(conn, flags, msg_id, payload, slices, generation)
        if op == Op.READ:
            return self._read(conn, flags, msg_id, payload, slices)
        if op == Op.CHECK:
            if flags & FLAG_WRITE:
                status, index = self._table.admits(slices, generation)
                if status != Status.OK:
                    return self._reply(conn, status, index, msg_id)
            if not flags & FLAG_CHECKSUM:
                return self._reply(conn, *self._table.check_all(slices, write=bool(flags & FLAG_WRITE)), msg_id)
            status, index, views = self._resolve(slices, write=bool(flags & FLAG_WRITE))
            if status == Status.OK:
                index = next((i for i, v in enumerate(views) if checksum(v) != slices[i][3]), -1)
                status = Status.OK if index < 0 else Status.CHECKSUM_MISMATCH
            return self._reply(conn, status, max(index, 0), msg_id)
        if op == Op.PING:
            return self._reply(conn, Status.OK, 0, msg_id) if payload == 0 else False
        handler = self._handlers.get(op)
        if payload > MAX_CONTROL_PAYLOAD:
            return False
        body = bytearray(payload)
        if payload and not recv_exact(conn, memoryview(body)):
            return False
        if handler is None:
            return self._reply(conn, Status.UNSUPPORTED, 0, msg_id)
        try:
            status, answer = handler(decode_json(body), peer_hello)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("transfer: bad control request %d: %s", op, exc)
            return self._reply(conn, Status.BAD_REQUEST, 0, msg_id)
        return self._reply(conn, status, 0, msg_id, encode_json(answer))

    def _resolve(self, slices: list[tuple[int, int, int, int]], write: bool) -> tuple[Status, int, list[memoryview]]:
        views = []
        for i, (region_id, offset, length, _) in enumerate(slices):
            status, view = self._table.resolve(region_id, offset, length, write)
            if status != Status.OK:
                return status, i, []
            views.append(view)
        return Status.OK, 0, views

    def _write(self, conn: socket.socket, flags: int, msg_id: int, payload: int, slices: list,
               generation: int | None) -> bool:
        if payload != sum(s[2] for s in slices):
            return False
        status, index, views = self._resolve(slices, write=True)
        if status == Status.OK:
            status, index = self._table.admits(slices, generation)
        if status != Status.OK:
            drain(conn, payload)
            return self._reply(conn, status, index, msg_id)
        recv_buffers(conn, views)  # straight into the registered region
        if flags & FLAG_CHECKSUM:
            for i, view in enumerate(views):
                if checksum(view) != slices[i][3]:
                    return self._reply(conn, Status.CHECKSUM_MISMATCH, i, msg_id)
        return self._reply(conn, Status.OK, 0, msg_id)

    def _read(self, conn: socket.socket, flags: int, msg_id: int, payload: int, slices: list) -> bool:
        if payload:
            return False
        status, index, views = self._resolve(slices, write=False)
        if status != Status.OK:
            return self._reply(conn, status, index, msg_id)
        sums = b"".join(CHECKSUM.pack(checksum(v)) for v in views) if flags & FLAG_CHECKSUM else b""
        total = sum(len(v) for v in views)
        send_buffers(conn, [REPLY.pack(Status.OK, flags & FLAG_CHECKSUM, 0, msg_id, total) + sums, *views])
        return True

    def _reply(self, conn: socket.socket, status: Status, index: int, msg_id: int, body: bytes = b"") -> bool:
        send_buffers(conn, [REPLY.pack(status, 0, index, msg_id, len(body)) + body])
        return True
