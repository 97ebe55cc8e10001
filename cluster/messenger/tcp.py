"""Requesting side over TCP: authenticated streams and the TCP transport built on them.

A :class:`Stream` is one connection to a peer's Messenger with a sender thread (for writes; small
messages go out from the caller's thread) and a receiver thread, so many messages are in flight at once and a batch never waits for a round trip per
slice. Bytes go out with ``sendmsg`` straight from the registered buffer and come back with
``recv_into`` straight into it. The :class:`TcpTransport` spreads a batch's slices over several
streams, which keeps more than one core and socket buffer busy on a large transfer.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from .auth import client_handshake
from .batch import Batch, Request, Slice
from .config import MessengerConfig
from .errors import ChecksumError, PeerError, TransferError, remote_error
from .wire import (
    CHECKSUM,
    FLAG_CHECKSUM,
    FLAG_GENERATION,
    GENERATION,
    MAX_CONTROL_PAYLOAD,
    MAX_SLICES_PER_MESSAGE,
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

log = logging.getLogger(__name__)


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"peer address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def connect(address: str, config: MessengerConfig, hello: dict,
            timeout_s: float | None = None) -> tuple[socket.socket, dict]:
    """Open and authenticate one connection; returns it with the server's hello. ``timeout_s``
    bounds the connect and each wait of the handshake (default: the transfer timeout): a caller
    that gives up on a peer after a second must not wait longer for a frozen one to say hello."""
    try:
        sock = socket.create_connection(split_address(address), timeout=timeout_s or config.timeout_s)
    except OSError as exc:
        raise PeerError(f"cannot connect to {address}: {exc}") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer_bytes)
        server_hello = client_handshake(sock, config.secret, hello)
    except BaseException:
        sock.close()
        raise
    return sock, server_hello


@dataclass
class Message:
    """One wire request: its slices (data ops) or JSON payload (control ops) and who to tell."""

    op: Op
    slices: Sequence[Slice] = ()
    payload: bytes = b""
    batch: Batch | None = None
    reply: Future | None = None  # control ops: (status, failing index, payload)
    flags: int = 0
    msg_id: int = 0
    sums: list[int] = field(default_factory=list)
    generation: int | None = None  # a write into a guarded range names its use of it

    def complete(self, status: int, index: int, payload: bytes, where: str) -> None:
        if self.reply is not None:
            self.reply.set_result((Status(status), index, payload))
        elif self.batch is not None:
            if status == Status.OK:
                self.batch.part_done()
            else:
                self.batch.fail(remote_error(status, f"{where}, slice at offset {self._offset(index)}"))

    def fail(self, exc: TransferError) -> None:
        if self.reply is not None:
            if not self.reply.done():
                self.reply.set_exception(exc)
        elif self.batch is not None:
            self.batch.fail(exc)

    def _offset(self, index: int) -> int:
        return self.slices[index].offset if index < len(self.slices) else -1


class Stream:
    """One authenticated, pipelined connection to a peer's Messenger."""

    def __init__(self, sock: socket.socket, name: str, config: MessengerConfig, on_dead: Callable[[], None] = lambda: None):
        self.name = name
        self._sock = sock
        self._checksum = config.checksum
        self._timeout_s = config.timeout_s
        self._on_dead = on_dead
        self._outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._inflight: deque[Message] = deque()
        self._lock = threading.Lock()
        self._wire = threading.Lock()  # held from taking a message id to the last byte sent
        self._queued = 0  # messages handed to the sender thread and not yet sent
        self._error: PeerError | None = None
        self._next_id = 0
        sock.settimeout(config.timeout_s)
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    @property
    def alive(self) -> bool:
        return self._error is None

    def submit(self, message: Message) -> None:
        if self._error is not None:
            message.fail(self._error)
            return
        # A message without data (a control request, a READ, a CHECK) goes out from the caller's
        # thread when nothing waits before it: the hand-off to the sender thread cost a thread
        # switch, about a third of a control round trip on loopback. A WRITE is queued so the
        # caller never blocks while its bytes go out. Either way the wire order is the order of
        # submission for any one thread.
        with self._lock:
            inline = message.op != Op.WRITE and self._queued == 0
            if not inline:
                self._queued += 1
        if inline:
            self._send(message)
        else:
            self._outbox.put(message)

    def request(self, op: Op, payload: bytes = b"", slices: Sequence[Slice] = (), flags: int = 0,
                generation: int | None = None) -> Future:
        """Send a control request; the future resolves to (status, failing index, payload)."""
        reply: Future = Future()
        self.submit(Message(op, slices=slices, payload=payload, reply=reply, flags=flags, generation=generation))
        return reply

    def answer(self, reply: Future) -> tuple[Status, int, bytes]:
        """Wait for a control reply; a silent peer kills the stream after the timeout."""
        try:
            return reply.result(self._timeout_s * 2)
        except TimeoutError as exc:
            self._die(PeerError(f"{self.name}: no reply within {self._timeout_s}s"))
            raise PeerError(f"{self.name}: no reply to a control request") from exc

    def call(self, op: Op, payload: bytes = b"", slices: Sequence[Slice] = (), flags: int = 0,
             generation: int | None = None) -> tuple[Status, int, bytes]:
        """A control request answered synchronously (within the timeout)."""
        return self.answer(self.request(op, payload, slices, flags, generation))

    def close(self) -> None:
        self._die(PeerError(f"{self.name}: closed"))

    def _die(self, error: PeerError) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            stranded = list(self._inflight)
            self._inflight.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the other thread out of its syscall
        except OSError:
            pass
        self._sock.close()
        self._outbox.put(None)
        for message in stranded:
            message.fail(error)
        self._on_dead()

    def _send(self, message: Message) -> None:
        with self._wire:  # the ids, the in-flight queue and the bytes on the wire in one order
            with self._lock:
                if self._error is None:
                    self._next_id = (self._next_id + 1) & 0xFFFFFFFF
                    message.msg_id = self._next_id
                    self._inflight.append(message)  # before sending: the reply may beat us back
                error = self._error
            if error is not None:
                message.fail(error)
                return
            try:
                send_buffers(self._sock, self._frame(message))
            except (OSError, ValueError) as exc:
                self._die(PeerError(f"{self.name}: send failed: {exc}"))

    def _send_loop(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                break
            self._send(message)
            with self._lock:
                self._queued -= 1
        # Fail whatever was queued after the stream died.
        while True:
            try:
                message = self._outbox.get_nowait()
            except queue.Empty:
                return
            if message is not None and self._error is not None:
                message.fail(self._error)

    def _frame(self, message: Message) -> list:
        # Writes carry sums when checksums are on; a CHECK carries them to have the owner verify
        # bytes that arrived by another path (RDMA).
        with_sums = bool(message.flags & FLAG_CHECKSUM) or (self._checksum and message.op == Op.WRITE)
        if with_sums:
            message.sums = [checksum(s.local) for s in message.slices]
        descriptors = b"".join(
            SLICE.pack(s.region_id, s.offset, s.length, message.sums[i] if with_sums else 0)
            for i, s in enumerate(message.slices)
        )
        if message.op == Op.WRITE:
            payload_bytes = sum(s.length for s in message.slices)
            body = [s.local for s in message.slices]
        else:
            payload_bytes = len(message.payload)
            body = [message.payload] if message.payload else []
        flags = message.flags | (FLAG_CHECKSUM if (self._checksum and message.op in (Op.WRITE, Op.READ)) else 0)
        if message.generation is not None:
            flags |= FLAG_GENERATION
            descriptors += GENERATION.pack(message.generation)
        header = REQUEST.pack(message.op, flags, len(message.slices), message.msg_id, payload_bytes)
        return [header + descriptors, *body]

    def _idle(self) -> bool:
        return not self._inflight

    def _recv_loop(self) -> None:
        try:
            while True:
                header = recv_struct(self._sock, REPLY, self._idle)
                if header is None:
                    raise ConnectionError("peer closed the connection")
                status, flags, index, msg_id, payload_bytes = header
                with self._lock:
                    message = self._inflight[0] if self._inflight else None
                if message is None or message.msg_id != msg_id:
                    raise ConnectionError(f"reply {msg_id} does not match the oldest request")
                payload = self._receive_body(message, status, flags, payload_bytes)
                with self._lock:
                    if self._inflight and self._inflight[0] is message:
                        self._inflight.popleft()
                if isinstance(payload, TransferError):
                    message.fail(payload)
                else:
                    message.complete(status, index, payload, self.name)
        except (OSError, ConnectionError, ValueError) as exc:
            if isinstance(exc, socket.timeout):
                reason = f"no answer within {self._timeout_s}s with work pending"
            else:
                reason = str(exc) or type(exc).__name__
            self._die(PeerError(f"{self.name}: {reason}"))

    def _receive_body(self, message: Message, status: int, flags: int, payload_bytes: int) -> bytes | TransferError:
        if message.op == Op.READ and status == Status.OK:
            if payload_bytes != sum(s.length for s in message.slices):
                raise ConnectionError("read reply length does not match the request")
            sums: tuple[int, ...] = ()
            if flags & FLAG_CHECKSUM:
                raw = bytearray(CHECKSUM.size * len(message.slices))
                recv_exact(self._sock, memoryview(raw))
                sums = tuple(v[0] for v in CHECKSUM.iter_unpack(raw))
            recv_buffers(self._sock, [s.local for s in message.slices])  # straight into the registered buffer
            for i, s in enumerate(message.slices):
                if sums and checksum(s.local) != sums[i]:
                    return ChecksumError(f"{self.name}: checksum mismatch reading slice at offset {s.offset}")
            return b""
        if payload_bytes > MAX_CONTROL_PAYLOAD:
            raise ConnectionError(f"reply payload of {payload_bytes} bytes is too large")
        payload = bytearray(payload_bytes)
        if payload_bytes:
            recv_exact(self._sock, memoryview(payload))
        return bytes(payload)


class TcpTransport:
    """Moves a batch over ``config.streams`` connections, slices dealt round-robin among them."""

    name = "tcp"

    def __init__(self, address: str, config: MessengerConfig, hello: dict) -> None:
        self._config = config
        self._streams: list[Stream] = []
        try:
            for i in range(config.streams):
                sock, _ = connect(address, config, hello)
                self._streams.append(Stream(sock, f"tcp {address} #{i}", config))
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return all(s.alive for s in self._streams)

    def submit(self, batch: Batch, op: Op, requests: Sequence[Request], generation: int | None = None) -> None:
        cfg = self._config
        lanes: list[list[Slice]] = [[] for _ in self._streams]
        k = 0
        for request in requests:
            for piece in request.slices(cfg.slice_bytes):
                lanes[k % len(lanes)].append(piece)
                k += 1
        plan: list[tuple[Stream, Message]] = []
        for stream, lane in zip(self._streams, lanes):
            group: list[Slice] = []
            size = 0
            for piece in lane:
                if group and (size + piece.length > cfg.message_bytes or len(group) == MAX_SLICES_PER_MESSAGE):
                    plan.append((stream, Message(op, slices=group, batch=batch, generation=generation)))
                    group, size = [], 0
                group.append(piece)
                size += piece.length
            if group:
                plan.append((stream, Message(op, slices=group, batch=batch, generation=generation)))
        batch.expect(len(plan))
        for stream, message in plan:
            stream.submit(message)

    def close(self) -> None:
        for stream in self._streams:
            stream.close()
