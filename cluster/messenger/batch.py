"""A batch of transfers: its slices and the future that completes when all of them have."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator, Iterable
from concurrent.futures import Future
from typing import Any, NamedTuple

from .errors import TransferError
from .regions import LocalRegion


class Slice(NamedTuple):
    """One contiguous piece of a request: local bytes and where they go (or come from) remotely.

    Named tuples rather than dataclasses: a 1 GiB batch of 64 KiB slices builds 16k of them,
    and tuple construction is several times cheaper.
    """

    local: memoryview
    region_id: int
    offset: int

    @property
    def length(self) -> int:
        return len(self.local)


class Request(NamedTuple):
    """One entry of a batch after the local side resolved and bounds-checked its own buffer."""

    local_region: LocalRegion
    local_offset: int
    region_id: int
    offset: int
    length: int

    @property
    def local(self) -> memoryview:
        return self.local_region.view[self.local_offset : self.local_offset + self.length]

    def slices(self, slice_bytes: int) -> Iterable[Slice]:
        local = self.local
        if self.length <= slice_bytes:
            yield Slice(local, self.region_id, self.offset)
            return
        for start in range(0, self.length, slice_bytes):
            yield Slice(local[start : start + slice_bytes], self.region_id, self.offset + start)


class Batch(Future):
    """Completes once every part of the batch has; fails with the first error any part reports.

    A ``concurrent.futures.Future`` (``result(timeout)`` is the blocking form) that is also
    awaitable from asyncio. Parts are whatever a transport completes independently (a wire
    message, a group of RDMA work requests); the count is fixed before the first part is sent so
    a fast completion cannot finish the batch early.
    """

    def __init__(self, keepalive: object = None) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._pending = 0
        self._keepalive = keepalive  # the regions the slices point into stay alive until done

    def expect(self, parts: int) -> None:
        with self._lock:
            self._pending += parts
            finished = self._pending == 0
        if finished:
            self._finish(None)

    def part_done(self) -> None:
        with self._lock:
            self._pending -= 1
            finished = self._pending == 0
        if finished:
            self._finish(None)

    def fail(self, exc: BaseException) -> None:
        self._finish(exc if isinstance(exc, TransferError) else TransferError(str(exc)))

    def _finish(self, exc: BaseException | None) -> None:
        with self._lock:
            if self.done():
                return
            if exc is None:
                self.set_result(None)
            else:
                self.set_exception(exc)
            self._keepalive = None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the batch completes; raises its TransferError."""
        self.result(timeout)

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.wrap_future(self).__await__()
