"""Shared memory: buffers a same-host peer can map, and the transport that copies through them.

Shareable buffers come from :class:`SharedMemoryPool`, one ``memfd`` per allocation (tmpfs, like
``/dev/shm``, but with no name to leak when the owner is killed: the kernel frees it once the last
mapping goes). A peer on the same host asks the owner to EXPORT a region, opens the owner's file
through ``/proc/<pid>/fd``, maps exactly the region's window and then copies with ``copy_`` (no
socket, no second copy). The owner still decides: every batch is CHECKed by the owner before the
copy and fenced with a PING after it, so unknown handles and out-of-range slices are refused and a
dead owner fails the batch.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .batch import Batch, Request, Slice
from .config import TransferConfig
from .errors import ChecksumError, PeerError, TransferError, remote_error
from .protocol import FLAG_WRITE, MAX_SLICES_PER_MESSAGE, Op, Status, checksum, decode_json, encode_json
from .regions import RegionTable, SharedSpan, view_address
from .tcp import Stream

PAGE = mmap.PAGESIZE


class SharedMemoryPool:
    """This engine's shareable allocations, and where a registered buffer lies inside them."""

    def __init__(self) -> None:
        self._blocks: list[tuple[int, int, int, mmap.mmap]] = []  # (address, length, fd, map)
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> torch.Tensor:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        fd = os.memfd_create("mooncake-py-transfer", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            block = mmap.mmap(fd, nbytes)
        except OSError:
            os.close(fd)
            raise
        tensor = torch.frombuffer(block, dtype=torch.uint8)
        with self._lock:
            self._blocks.append((tensor.data_ptr(), nbytes, fd, block))
        return tensor

    def locate(self, address: int, length: int) -> SharedSpan | None:
        with self._lock:
            for start, size, fd, _ in self._blocks:
                if start <= address and address + length <= start + size:
                    return SharedSpan(fd, address - start)
        return None

    def close(self) -> None:
        with self._lock:
            blocks, self._blocks = self._blocks, []
        for _, _, fd, _ in blocks:
            os.close(fd)  # mappings (ours and peers') stay valid until unmapped


def export_region(table: RegionTable, region_id: int) -> tuple[Status, dict]:
    """Owner side of EXPORT for shared memory: where a peer on this host can map the region."""
    region = table.get(region_id)
    if region is None:
        return Status.UNKNOWN_REGION, {}
    if region.shared is None:
        return Status.UNSUPPORTED, {"reason": "region is not in shared memory"}
    return Status.OK, {"pid": os.getpid(), "fd": region.shared.fd, "offset": region.shared.offset, "length": region.length}


class Window(NamedTuple):
    """A peer's region mapped into this process: its bytes and their address."""

    view: memoryview
    address: int

    def __len__(self) -> int:
        return len(self.view)


def map_window(pid: int, fd: int, offset: int, length: int) -> Window:
    """Map ``[offset, offset + length)`` of another process's memfd; the view keeps the map alive."""
    start = offset - offset % PAGE  # mmap offsets must be page-aligned
    path = f"/proc/{pid}/fd/{fd}"
    try:
        file = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise PeerError(f"cannot open the owner's shared memory {path}: {exc}") from exc
    try:
        window = mmap.mmap(file, offset + length - start, offset=start)
    finally:
        os.close(file)
    view = memoryview(window)[offset - start :]
    return Window(view, view_address(view))


class ShmTransport:
    """Copies a batch straight between local memory and a same-host peer's mapped regions."""

    name = "shm"

    def __init__(self, control: Stream, config: TransferConfig) -> None:
        self._control = control
        self._config = config
        self._windows: dict[int, Window] = {}
        self._work: queue.SimpleQueue[tuple[Batch, Op, Sequence[Request]] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name=f"{control.name} shm", daemon=True)
        self._worker.start()

    @property
    def alive(self) -> bool:
        return self._control.alive

    def submit(self, batch: Batch, op: Op, requests: Sequence[Request]) -> None:
        batch.expect(1)
        self._work.put((batch, op, requests))

    def close(self) -> None:
        self._work.put(None)

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            batch, op, requests = item
            try:
                self._transfer(op, requests)
            except TransferError as exc:
                batch.fail(exc)
            else:
                batch.part_done()

    def _transfer(self, op: Op, requests: Sequence[Request]) -> None:
        write = op == Op.WRITE
        flags = FLAG_WRITE if write else 0
        # Every chunk goes to the owner for checking at once and is copied as soon as its answer
        # is in, so the owner checks chunk k+1 while we copy chunk k. Entries the owner refuses
        # are never copied (earlier chunks of a failing batch may have been).
        chunks = [requests[i : i + MAX_SLICES_PER_MESSAGE] for i in range(0, len(requests), MAX_SLICES_PER_MESSAGE)]
        answers = [
            self._control.request(Op.CHECK, slices=[Slice(r.local, r.region_id, r.offset) for r in chunk], flags=flags)
            for chunk in chunks
        ]
        for chunk, answer in zip(chunks, answers):
            status, index, _ = self._control.answer(answer)
            if status != Status.OK:
                if status == Status.UNKNOWN_REGION:
                    self._windows.pop(chunk[index].region_id, None)
                raise remote_error(status, f"{self._control.name}, entry at offset {chunk[index].offset}")
            self._copy(chunk, write)
        # The fence: a copy into a dead owner's memory is lost, so the batch only succeeds if the
        # owner is still there after the last byte landed.
        status, _, _ = self._control.call(Op.PING)
        if status != Status.OK:
            raise PeerError(f"{self._control.name}: fence failed with status {status}")

    def _copy(self, requests: Sequence[Request], write: bool) -> None:
        step = self._config.slice_bytes
        region_id, window = -1, None
        for request in requests:
            if request.region_id != region_id:
                region_id, window = request.region_id, self._window(request.region_id)
            if request.offset + request.length > len(window):  # the owner's CHECK passed; this guards our map
                raise TransferError(f"entry at offset {request.offset} is outside the mapped region")
            local = request.local_region.address + request.local_offset
            remote = window.address + request.offset
            # memmove rather than torch's copy_: it releases the GIL too, and it never starts an
            # OpenMP team in this thread, which on a small host fights the caller's own team
            # (seconds-long stalls were measured with copy_ here).
            if write:
                ctypes.memmove(remote, local, request.length)
            else:
                ctypes.memmove(local, remote, request.length)
            if self._config.checksum:
                remote_view = window.view[request.offset : request.offset + request.length]
                local_view = request.local
                for at in range(0, request.length, step):
                    if checksum(remote_view[at : at + step]) != checksum(local_view[at : at + step]):
                        raise ChecksumError(f"{self._control.name}: checksum mismatch at offset {request.offset + at}")

    def _window(self, region_id: int) -> Window:
        window = self._windows.get(region_id)
        if window is None:
            status, _, body = self._control.call(Op.EXPORT, encode_json({"kind": "shm", "region_id": region_id}))
            if status != Status.OK:
                raise remote_error(status, f"{self._control.name}: cannot map region {region_id}")
            info = decode_json(body)
            window = map_window(int(info["pid"]), int(info["fd"]), int(info["offset"]), int(info["length"]))
            self._windows[region_id] = window
        return window
