"""The Messenger: one per process, the API the KV pool and the prefill->decode path use.

It registers memory, serves peers through its :class:`RegionServer`, and moves batches to and from
peers over the transport chosen per peer: RDMA when both sides have a device, shared memory when
the peer is on this host and the remote regions are shareable, TCP otherwise (or whatever the
caller forces). Connections are opened on first use and reopened on the next request after a
failure, so a dead peer costs the batches that were in flight with it and nothing else.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .batch import Batch, Request
from .config import MessengerConfig
from .errors import PeerError, RdmaUnavailable, TransferError
from .region_server import ControlHandler, RegionServer
from .wire import Op, Status, decode_json, encode_json
from .rdma import RdmaDevice, RdmaTransport
from .regions import LocalRegion, RegionHandle, RegionTable
from .shm import SharedMemoryPool, ShmTransport, export_region
from .tcp import Stream, TcpTransport, connect

log = logging.getLogger(__name__)

# (local region, local offset, remote region, remote offset, length)
Entry = tuple[RegionHandle, int, RegionHandle, int, int]


class Transport(Protocol):
    name: str

    @property
    def alive(self) -> bool: ...

    def submit(self, batch: Batch, op: Op, requests: Sequence[Request], generation: int | None = None) -> None: ...

    def close(self) -> None: ...


def host_identity() -> str:
    """Same value exactly when two processes can map each other's memory (same kernel boot and
    pid namespace, since shared memory is reached through ``/proc/<pid>``) and share a network
    namespace: a peer in another one (a container, a host simulated by ``ip netns``) is taken
    for another host, so its KV goes over TCP as it would between machines."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"unshared-{secrets.token_hex(8)}"  # no /proc: never claim to share a host
    return f"{socket.gethostname()}:{boot}:{pidns}:{netns}"


@dataclass
class _Link:
    """What this engine holds for one peer: a control stream, its hello, and opened transports."""

    address: str
    control: Stream
    hello: dict
    transports: dict[str, Transport] = field(default_factory=dict)

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()
        self.control.close()


class Messenger:
    """Registers memory and moves batches of byte ranges to and from peer engines."""

    def __init__(self, config: MessengerConfig, *, verbs: Any | None = None) -> None:
        """``verbs`` replaces pyverbs (tests pass an in-process stand-in); None loads pyverbs."""
        self.config = config
        self.engine_id = secrets.token_hex(8)
        self._table = RegionTable()
        self._shared = SharedMemoryPool()
        self._rdma: RdmaDevice | None = None
        self.rdma_status = "RDMA not requested (transport forced to tcp/shm)"
        if config.transport in ("auto", "rdma"):
            try:
                self._rdma = RdmaDevice.open(config.rdma_device, verbs, config)
                self.rdma_status = f"RDMA device {self._rdma.name}"
            except RdmaUnavailable as exc:
                if config.transport == "rdma":
                    raise
                self.rdma_status = str(exc)
                log.info("transfer: %s", exc)
        self._hello = {"engine_id": self.engine_id, "host": host_identity(), "rdma": self._rdma is not None}
        self._services: dict[str, ControlHandler] = {}
        self._handlers = {Op.EXPORT: self._export, Op.RDMA_CONNECT: self._rdma_connect, Op.SERVICE: self._dispatch}
        self._messenger = RegionServer(config, self._table, self._hello, self._handlers)
        self.address = self._messenger.address
        self._links: dict[str, _Link] = {}
        self._link_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ----- memory ---------------------------------------------------------------------------

    def alloc_shared(self, nbytes: int) -> torch.Tensor:
        """A zeroed uint8 CPU tensor in shared memory; register it (or views of it) to let
        same-host peers reach it without a socket."""
        return self._shared.allocate(nbytes)

    def register(self, buffer: object) -> RegionHandle:
        """Register a contiguous CPU tensor or buffer-protocol object; returns its shareable handle."""
        region = self._table.add(buffer, self._shared.locate)
        if self._rdma is not None:
            try:
                self._rdma.register(region)
            except TransferError:
                self._table.remove(region.region_id)
                raise
        return RegionHandle(self.engine_id, self.address, region.region_id, region.length, region.shared is not None)

    def guard(self, handle: RegionHandle) -> None:
        """Peers may write into this region of ours only into ranges opened for them
        (``open_range``), naming the generation the opening returned (idempotent)."""
        self._table.guard(self._own(handle).region_id)

    def open_range(self, handle: RegionHandle, offset: int, length: int) -> int:
        """Open ``[offset, offset + length)`` of a guarded region of ours to writes naming the
        returned generation (what the writer is told with the range's address)."""
        return self._table.open_range(self._own(handle).region_id, offset, length)

    def close_range(self, handle: RegionHandle, generation: int) -> bool:
        """End that use of the range: writes naming ``generation`` are refused from now on (a
        write the owner already admitted may still be landing: do not reuse the range at once)."""
        return self._table.close_range(self._own(handle).region_id, generation)

    def unregister(self, handle: RegionHandle) -> None:
        """Forget a region; the caller must not have transfers on it in flight."""
        self._own(handle)
        region = self._table.remove(handle.region_id)
        if self._rdma is not None:
            self._rdma.deregister(region.region_id)

    # ----- transfers ------------------------------------------------------------------------

    def write(self, peer: str, entries: Sequence[Entry], *, transport: str | None = None,
              generation: int | None = None) -> Batch:
        """Copy local ranges into the peer's regions; returns the batch's future. ``generation``:
        the use of a guarded remote range the write is for (``open_range`` on the peer); the peer
        refuses the write (``StaleWrite``) when that use has ended."""
        return self._submit(peer, entries, Op.WRITE, transport, generation)

    def read(self, peer: str, entries: Sequence[Entry], *, transport: str | None = None) -> Batch:
        """Copy the peer's ranges into local regions; returns the batch's future."""
        return self._submit(peer, entries, Op.READ, transport)

    def write_sync(self, peer: str, entries: Sequence[Entry], *, transport: str | None = None, timeout: float | None = None) -> None:
        self.write(peer, entries, transport=transport).wait(timeout)

    def read_sync(self, peer: str, entries: Sequence[Entry], *, transport: str | None = None, timeout: float | None = None) -> None:
        self.read(peer, entries, transport=transport).wait(timeout)

    def serve(self, handler: ControlHandler, ops: Sequence[str]) -> None:
        """Answer peers' ``call``s whose ``op`` is one of ``ops`` with ``handler`` (on the
        Messenger's connection threads, so it must be thread-safe). Several services share an
        engine (a pool segment, a pipeline stage) as long as their ops differ."""
        with self._lock:
            taken = sorted(set(ops) & set(self._services))
            if taken:
                raise RuntimeError(f"this engine already serves {taken}")
            self._services.update(dict.fromkeys(ops, handler))

    def _dispatch(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        handler = self._services.get(request.get("op"))
        if handler is None:
            return Status.BAD_REQUEST, {"reason": f"no service for {request.get('op')!r}"}
        return handler(request, peer_hello)

    def call(self, peer: str, body: dict, timeout_s: float | None = None) -> tuple[Status, dict]:
        """One request to the service of the engine at ``peer``, over the authenticated control
        stream; raises ``TransferError`` when the peer cannot be reached or does not answer.
        ``timeout_s``: give up waiting after this long (``TransferError``) and leave the link
        as it is: a peer that is only slow answers later, into nothing. None: the link's own
        bound, past which a silent peer's link is closed."""
        if self._closed:
            raise TransferError("engine is closed")
        if timeout_s is None:
            status, _, payload = self._link(peer).control.call(Op.SERVICE, encode_json(body))
        else:
            # One budget for the link (made now if there is none) and the answer.
            deadline = time.monotonic() + timeout_s
            reply = self._link(peer, timeout_s).control.request(Op.SERVICE, encode_json(body))
            try:
                status, _, payload = reply.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TransferError(f"{peer}: no answer to {body.get('op')!r} within {timeout_s:g} s") from None
        return Status(status), (decode_json(payload) if payload else {})

    def notify(self, peer: str, body: dict) -> None:
        """``call`` without waiting for the answer, for a request whose outcome changes nothing
        for the sender (a release). Raises ``TransferError`` only when ``peer`` cannot be
        reached now; a refusal or a lost answer goes unnoticed."""
        if self._closed:
            raise TransferError("engine is closed")
        self._link(peer).control.request(Op.SERVICE, encode_json(body))

    def transport_for(self, peer: str, remote: Sequence[RegionHandle] = ()) -> str:
        """The transport a batch to ``peer`` touching ``remote`` regions would use."""
        return self._choose(self._link(peer), remote, None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
        self._messenger.close()
        if self._rdma is not None:
            self._rdma.close()
        self._shared.close()

    def __enter__(self) -> Messenger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- internals ------------------------------------------------------------------------

    def _submit(self, peer: str, entries: Sequence[Entry], op: Op, transport: str | None,
                generation: int | None = None) -> Batch:
        requests = []
        batch = Batch(keepalive=requests)
        try:
            if self._closed:
                raise TransferError("engine is closed")
            link = self._link(peer)
            peer_id = link.hello["engine_id"]
            regions: dict[int, LocalRegion] = {}  # a batch usually names a handful of regions
            for local, local_offset, remote, remote_offset, length in entries:
                region = regions.get(local.region_id)
                if region is None:
                    region = regions[local.region_id] = self._local_region(local, op)
                if local_offset < 0 or length <= 0 or local_offset + length > region.length:
                    region.span(local_offset, length)  # raises with the details
                if remote.engine_id != peer_id:
                    raise TransferError(f"region {remote.region_id} belongs to engine {remote.engine_id}, not to peer {peer}")
                requests.append(Request(region, local_offset, remote.region_id, remote_offset, length))
            name = self._choose(link, [e[2] for e in entries], transport)
            if generation is None:
                self._transport(link, name).submit(batch, op, requests)
            else:
                self._transport(link, name).submit(batch, op, requests, generation)
        except TransferError as exc:
            batch.fail(exc)
        return batch

    def _local_region(self, handle: RegionHandle, op: Op) -> LocalRegion:
        region = self._table.get(self._own(handle).region_id)
        if region is None:
            raise TransferError(f"local region {handle.region_id} is not registered")
        if op == Op.READ and not region.writable:
            raise TransferError(f"local region {handle.region_id} is read-only")
        return region

    def _own(self, handle: RegionHandle) -> RegionHandle:
        if handle.engine_id != self.engine_id:
            raise TransferError(f"region {handle.region_id} is not a region of this engine")
        return handle

    def _link(self, peer: str, timeout_s: float | None = None) -> _Link:
        """The link to ``peer``, connected now if there is none. ``timeout_s`` bounds the wait for
        another thread's connect to the same peer and this one's (default: the transfer timeout)."""
        with self._lock:
            lock = self._link_locks.setdefault(peer, threading.Lock())
        # One connect per peer at a time; other peers are not held up.
        if not lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise PeerError(f"{peer}: another connect to it has taken over {timeout_s:g} s")
        try:
            link = self._links.get(peer)
            if link is not None and link.control.alive:
                return link
            if link is not None:
                link.close()  # reconnect on the next request after a failure
            sock, hello = connect(peer, self.config, self._hello, timeout_s)
            # A link whose peer dies is closed and forgotten at once, not when (or if) that
            # address is asked for again: a restarted peer usually comes back elsewhere, and the
            # dead one's mapped memory and threads would stay with us for ever.
            made: list[Stream] = []
            stream = Stream(sock, f"control {peer}", self.config, on_dead=lambda: made and self._forget(peer, made[0]))
            made.append(stream)
            link = _Link(peer, stream, hello)
            with self._lock:
                if self._closed:
                    link.close()
                    raise TransferError("engine is closed")
                self._links[peer] = link
            return link
        finally:
            lock.release()

    def _forget(self, peer: str, control: Stream) -> None:
        """Called when ``control`` dies: close the link it belongs to and drop it, if it is still
        the one held for ``peer``."""
        with self._lock:
            link = self._links.get(peer)
            if link is None or link.control is not control:
                return
            del self._links[peer]
        link.close()

    def _choose(self, link: _Link, remote: Sequence[RegionHandle], forced: str | None) -> str:
        name = forced or (None if self.config.transport == "auto" else self.config.transport)
        same_host = link.hello.get("host") == self._hello["host"]
        if name is None:
            if self._rdma is not None and link.hello.get("rdma"):
                return "rdma"
            if same_host and remote and all(h.shared for h in remote):
                return "shm"
            return "tcp"
        if name == "shm" and not same_host:
            raise TransferError(f"peer {link.address} is not on this host; shared memory cannot reach it")
        if name == "rdma":
            if self._rdma is None:
                raise RdmaUnavailable(self.rdma_status)
            if not link.hello.get("rdma"):
                raise TransferError(f"peer {link.address} has no RDMA device")
        if name not in ("tcp", "shm", "rdma"):
            raise TransferError(f"unknown transport {name!r}")
        return name

    def _transport(self, link: _Link, name: str) -> Transport:
        with self._lock:
            lock = self._link_locks[link.address]
        with lock:
            transport = link.transports.get(name)
            if transport is not None and transport.alive:
                return transport
            if transport is not None:
                transport.close()
            if name == "tcp":
                transport = TcpTransport(link.address, self.config, self._hello)
            elif name == "shm":
                transport = ShmTransport(link.control, self.config)
            else:
                assert self._rdma is not None
                transport = RdmaTransport(self._rdma, link.control, self.config)
            link.transports[name] = transport
            return transport

    def _export(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        kind = request["kind"]
        region_id = int(request["region_id"])
        if kind == "shm":
            if peer_hello.get("host") != self._hello["host"]:
                return Status.UNSUPPORTED, {"reason": "peer is not on this host"}
            return export_region(self._table, region_id)
        if kind == "rdma" and self._rdma is not None:
            return self._rdma.export(region_id)
        return Status.UNSUPPORTED, {"reason": f"cannot export for {kind}"}

    def _rdma_connect(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        if self._rdma is None:
            return Status.UNSUPPORTED, {"reason": self.rdma_status}
        return Status.OK, self._rdma.accept(request)
