"""Shared memory: buffers a same-host peer can map, and the transport that copies through them.

Shareable buffers come from :class:`SharedMemoryPool`, one ``memfd`` per allocation (tmpfs, like
``/dev/shm``, but with no name to leak when the owner is killed: the kernel frees it once the last
mapping goes). A peer on the same host asks the owner to EXPORT a region, opens the owner's file
through ``/proc/<pid>/fd``, maps exactly the region's window and then copies with ``copy_`` (no
socket, no second copy). The owner still decides: every batch is CHECKed by the owner before the
copy and fenced with a PING after it, so unknown handles and out-of-range slices are refused and a
dead owner fails the batch. A write into a guarded range names its generation in that CHECK; the
owner refuses one for an ended use of the range. (The check comes before the copy: an owner that
ends the use between the two relies on not reusing the range at once, and on the KV stream's
per-layer checksums.)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from .batch import Batch, Request
from .config import MessengerConfig
from .errors import ChecksumError, PeerError, TransferError, remote_error
from .wire import FLAG_WRITE, MAX_SLICES_PER_MESSAGE, Op, Status, checksum, decode_json, encode_json
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
    map: mmap.mmap

    def __len__(self) -> int:
        return len(self.view)

    def unmap(self) -> None:
        """Give the mapping back: while it lasts, the peer's memory stays allocated here, even
        after the peer has died."""
        self.view.release()
        self.map.close()


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
    return Window(view, view_address(view), window)


class _Span(NamedTuple):
    """A remote range the owner checks: entries that follow each other in one region, merged."""

    region_id: int
    offset: int
    length: int


class _Chunk(NamedTuple):
    """Up to one message of entries: what the owner checks, what is copied, and the entries."""

    spans: list[_Span]
    runs: list[list[int]]  # [local address, region id, remote offset, length]
    requests: Sequence[Request]


def _plan(requests: Sequence[Request]) -> _Chunk:
    """One pass over a chunk's entries: entries contiguous remotely (a layer's blocks, say) are
    checked as one range, and those contiguous locally too are copied with one ``memmove``."""
    spans: list[list[int]] = []
    runs: list[list[int]] = []
    span: list[int] = []
    run: list[int] = []
    region_id = remote_end = local_end = -1
    for local_region, local_offset, request_region, offset, length in requests:  # length > 0: checked
        local = local_region.address + local_offset
        if request_region == region_id and offset == remote_end:
            span[2] += length
            if local == local_end:
                run[3] += length
            else:
                run = [local, region_id, offset, length]
                runs.append(run)
        else:
            region_id = request_region
            span = [region_id, offset, length]
            spans.append(span)
            run = [local, region_id, offset, length]
            runs.append(run)
        remote_end, local_end = offset + length, local + length
    return _Chunk([_Span(*s) for s in spans], runs, requests)


# Below this many bytes a chunk is copied on the transport's thread alone: handing parts to the
# pool costs tens of microseconds, more than a small copy takes.
PARALLEL_MIN_BYTES = 1 << 20


class ShmTransport:
    """Copies a batch straight between local memory and a same-host peer's mapped regions."""

    name = "shm"

    def __init__(self, control: Stream, config: MessengerConfig) -> None:
        self._control = control
        self._config = config
        self._windows: dict[int, Window] = {}
        self._work: queue.SimpleQueue[tuple[Batch, Op, list[tuple[_Chunk, Future]]] | None] = queue.SimpleQueue()
        self._pool: ThreadPoolExecutor | None = None  # the extra copy threads, started on first need
        self._closed = False
        self._close_lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name=f"{control.name} shm", daemon=True)
        self._worker.start()

    @property
    def alive(self) -> bool:
        return self._control.alive

    def submit(self, batch: Batch, op: Op, requests: Sequence[Request], generation: int | None = None) -> None:
        # Planned and sent for checking here, not when the copy thread gets to this batch, so the
        # owner checks this batch while earlier ones are still being copied.
        batch.expect(1)
        flags = FLAG_WRITE if op == Op.WRITE else 0
        chunks = []
        for i in range(0, len(requests), MAX_SLICES_PER_MESSAGE):
            chunk = _plan(requests[i : i + MAX_SLICES_PER_MESSAGE])
            chunks.append((chunk, self._control.request(Op.CHECK, slices=chunk.spans, flags=flags, generation=generation)))
        with self._close_lock:
            if not self._closed:
                self._work.put((batch, op, chunks))
                return
        # The link died between handing this transport out and this call: no thread copies any more.
        batch.fail(PeerError(f"{self._control.name}: the link to the peer is closed"))

    def close(self) -> None:
        """Stop after the batches already submitted; then the peer's regions are unmapped."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._work.put(None)

    def _run(self) -> None:
        try:
            while True:
                item = self._work.get()
                if item is None:
                    return
                batch, op, chunks = item
                try:
                    self._transfer(op, chunks)
                    # The fence: a copy into a dead owner's memory is lost, so the batch only
                    # succeeds if the owner is still there after the last byte landed. Its answer
                    # is awaited off this thread, which goes on to copy the next batch.
                    fence = self._control.request(Op.PING)
                except Exception as exc:  # noqa: BLE001 - anything else would strand the batch
                    batch.fail(exc)
                else:
                    fence.add_done_callback(lambda answer, batch=batch: self._fenced(batch, answer))
        finally:
            # Every copy has finished (a batch waits for its chunks), so nothing reads the
            # windows any more; unmapped, a dead peer's memory is freed at last.
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            windows, self._windows = list(self._windows.values()), {}
            for window in windows:
                window.unmap()

    def _fenced(self, batch: Batch, answer: Future) -> None:
        exc = answer.exception()
        if exc is not None:
            batch.fail(exc)
        elif answer.result()[0] != Status.OK:
            batch.fail(PeerError(f"{self._control.name}: fence failed with status {answer.result()[0]}"))
        else:
            batch.part_done()

    def _transfer(self, op: Op, chunks: list[tuple[_Chunk, Future]]) -> None:
        # Each chunk is copied as soon as the owner's answer to its CHECK is in. Entries the owner
        # refuses are never copied (earlier chunks of a failing batch may have been).
        write = op == Op.WRITE
        for chunk, answer in chunks:
            status, index, _ = self._control.answer(answer)
            if status != Status.OK:
                span = chunk.spans[index] if 0 <= index < len(chunk.spans) else chunk.spans[0]
                if status == Status.UNKNOWN_REGION:
                    self._windows.pop(span.region_id, None)
                raise remote_error(status, f"{self._control.name}, entry at offset {span.offset}")
            self._move(self._runs(chunk.runs, write))
            if self._config.checksum:
                self._verify(chunk.requests)

    def _verify(self, requests: Sequence[Request]) -> None:
        step = self._config.slice_bytes
        windows = self._windows
        for request in requests:
            remote_view = windows[request.region_id].view[request.offset : request.offset + request.length]
            local_view = request.local
            for at in range(0, request.length, step):
                if checksum(remote_view[at : at + step]) != checksum(local_view[at : at + step]):
                    raise ChecksumError(f"{self._control.name}: checksum mismatch at offset {request.offset + at}")

    def _runs(self, runs: list[list[int]], write: bool) -> list[tuple[int, int, int]]:
        """The planned runs as ``(destination, source, length)`` addresses in this process."""
        out = []
        region_id, base, size = -1, 0, 0
        for local, run_region, offset, length in runs:
            if run_region != region_id:
                region_id = run_region
                window = self._window(region_id)
                base, size = window.address, len(window.view)
            if offset + length > size:  # the owner's CHECK passed; this guards our map
                raise TransferError(f"entry at offset {offset} is outside the mapped region")
            out.append((base + offset, local, length) if write else (local, base + offset, length))
        return out

    def _move(self, runs: list[tuple[int, int, int]]) -> None:
        # memmove rather than torch's copy_: it releases the GIL too, and it never starts an
        # OpenMP team in this thread, which on a small host fights the caller's own team
        # (seconds-long stalls were measured with copy_ here). Big chunks are cut into one part
        # per copy thread; this thread copies the first part itself.
        threads = self._config.shm_copy_threads
        total = sum(run[2] for run in runs)
        if threads == 1 or total < PARALLEL_MIN_BYTES:
            _memmove_all(runs)
            return
        parts = _split(runs, total, threads)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix=f"{self._control.name} shm copy")
        pending = [self._pool.submit(_memmove_all, part) for part in parts[1:]]
        try:
            _memmove_all(parts[0])
        finally:
            for future in pending:
                future.result()

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


def _memmove_all(runs: list[list[int]]) -> None:
    memmove = ctypes.memmove
    for destination, source, length in runs:
        memmove(destination, source, length)


def _split(runs: list[list[int]], total: int, parts: int) -> list[list[list[int]]]:
    """Cut runs into ``parts`` lists of about equal bytes (cuts at 4 KiB multiples)."""
    share = -(-total // parts)
    share += -share % 4096
    out: list[list[list[int]]] = [[]]
    room = share
    for destination, source, length in runs:
        while length > room and len(out) < parts:
            if room:
                out[-1].append([destination, source, room])
                destination, source, length = destination + room, source + room, length - room
            out.append([])
            room = share
        if length:
            out[-1].append([destination, source, length])
            room -= length
    return out
