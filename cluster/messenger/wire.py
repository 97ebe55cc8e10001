"""Wire format shared by the requesting side (streams) and the owning side (Messenger).

A request is a fixed header, ``count`` slice descriptors and, for a write, the slices' bytes back
to back; a reply is a fixed header, for a checksummed read ``count`` checksums, then the bytes.
Everything is little-endian and fixed-size so both sides can ``recv_into`` straight into the
registered memory: the descriptors say where each slice goes before any of its bytes arrive.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
import time
from collections.abc import Callable, Sequence

import xxhash

# op, flags, slice count, message id, payload bytes
REQUEST = struct.Struct("<BBHIQ")
# status, flags, index of the failing slice, message id, payload bytes
REPLY = struct.Struct("<BBHIQ")
# region id, offset, length, checksum (0 when checksums are off)
SLICE = struct.Struct("<QQQQ")
CHECKSUM = struct.Struct("<Q")
# with FLAG_GENERATION: the generation a WRITE (or a write CHECK) names, after the descriptors
GENERATION = struct.Struct("<Q")

MAX_SLICES_PER_MESSAGE = 1024  # iovec limit of one sendmsg, and a bound on header size
MAX_CONTROL_PAYLOAD = 1 << 20  # JSON control messages are small; refuse anything bigger

FLAG_CHECKSUM = 1  # slices carry checksums to verify on arrival
FLAG_WRITE = 2  # a CHECK asks for write access (otherwise read access)
FLAG_GENERATION = 4  # a WRITE or write CHECK names the generation of the guarded range it writes


class Op(enum.IntEnum):
    WRITE = 1  # bytes travel with the request into the owner's region
    READ = 2  # bytes travel back with the reply
    CHECK = 3  # validate descriptors only (shared memory checks before it copies)
    PING = 4  # liveness fence
    EXPORT = 5  # JSON: details a transport needs to reach a region directly (shm, rdma)
    RDMA_CONNECT = 6  # JSON: queue-pair details exchanged over this side channel
    SERVICE = 7  # JSON: a request to a service the owning process added (the KV pool's segment)


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_REGION = 1
    OUT_OF_BOUNDS = 2
    CHECKSUM_MISMATCH = 3
    READ_ONLY = 4
    BAD_REQUEST = 5
    UNSUPPORTED = 6
    STALE = 7  # a write into a guarded range that does not name the range's current generation


def checksum(data: memoryview) -> int:
    """Per-slice checksum; xxh3 runs at memory speed, so turning it on costs little."""
    return xxhash.xxh3_64_intdigest(data)


def recv_exact(sock: socket.socket, view: memoryview, idle_ok: Callable[[], bool] | None = None,
               deadline: float | None = None) -> bool:
    """Fill ``view`` from ``sock``; False on a clean EOF before the first byte.

    The socket carries a timeout. A timeout before the first byte is tolerated while ``idle_ok()``
    says nothing is pending (an idle connection is healthy); any other timeout, or an EOF in the
    middle, raises, because the peer died or stalled with work outstanding. ``deadline``
    (``time.monotonic()``): every byte by then, however the peer spaces them, else
    ``socket.timeout`` (the socket is left with the timeout that remained).
    """
    got = 0
    total = len(view)
    while got < total:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the deadline passed before the message was in")
            sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except socket.timeout:
            if got == 0 and idle_ok is not None and idle_ok():
                continue
            raise
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError("connection closed in the middle of a message")
        got += n
    return True


def _advance(pending: list[memoryview], start: int, nbytes: int) -> int:
    """Consume ``nbytes`` moved by one scatter/gather call from ``pending[start:]``.

    Returns the index of the first buffer not yet complete; a partly moved buffer is replaced
    by its remaining tail so the next call resumes at the exact byte.
    """
    while nbytes and start < len(pending):
        size = len(pending[start])
        if nbytes >= size:
            nbytes -= size
            start += 1
        else:
            pending[start] = pending[start][nbytes:]
            nbytes = 0
    return start


def recv_buffers(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill each view in order with ``recvmsg_into``: one system call scatters the stream over
    many slices, where a ``recv_into`` per slice would cost a call (and a GIL round) each."""
    pending = [v for v in views if len(v)]
    start = 0
    while start < len(pending):
        got = sock.recvmsg_into(pending[start : start + MAX_SLICES_PER_MESSAGE])[0]
        if got == 0:
            raise ConnectionError("connection closed in the middle of a message")
        start = _advance(pending, start, got)


def recv_struct(sock: socket.socket, fmt: struct.Struct, idle_ok: Callable[[], bool] | None = None) -> tuple | None:
    buf = bytearray(fmt.size)
    if not recv_exact(sock, memoryview(buf), idle_ok):
        return None
    return fmt.unpack(buf)


def send_buffers(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """Send every buffer in order with as few ``sendmsg`` calls as the kernel allows.

    ``sendmsg`` gathers the header and the slices from where they lie (no joining copy); a short
    send is resumed from the exact byte it stopped at.
    """
    pending = [memoryview(b).cast("B") if not isinstance(b, memoryview) else b for b in buffers]
    start = 0
    while start < len(pending):
        sent = sock.sendmsg(pending[start : start + MAX_SLICES_PER_MESSAGE + 2])
        start = _advance(pending, start, sent)
        while start < len(pending) and len(pending[start]) == 0:
            start += 1


def drain(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` so a refused write leaves the stream in sync."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes:
        step = min(nbytes, len(scratch))
        if not recv_exact(sock, scratch[:step]):
            raise ConnectionError("connection closed while discarding a refused write")
        nbytes -= step


def encode_json(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(data: bytes | bytearray) -> dict:
    obj = json.loads(bytes(data))
    if not isinstance(obj, dict):
        raise ValueError("control payload must be a JSON object")
    return obj
