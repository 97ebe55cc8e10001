"""Staging memory for KV in flight: one registered region carved into per-request ranges.

A prefill instance gathers a finished prompt's KV, layer by layer, into a range of its send
staging; the Messenger writes each layer into the range the decode instance set aside in its
receive staging; the decode instance scatters it into its KV pages. Registering one region once
(rather than a buffer per request) keeps registration, and the peer's shared-memory mapping of
it, off the per-request path.

``StagingArea`` is a first-fit allocator over that region, with neighbouring free ranges merged
on release. Invariant (``check``): the free ranges and the allocated ones tile the region exactly.

Receive staging is *guarded* (``guard``): each allocation opens its range under a fresh generation
(``StagingRange.generation``, what the writer is told with the range), and ``revoke`` (or
``release``) ends that use, so a late write for it is refused by the Messenger instead of landing
in the range's next use.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from cluster.messenger import RegionHandle, Messenger

T = TypeVar("T")

# Ranges start on cache-line multiples so copies into them stay aligned.
_ALIGN = 64


class StagingFull(RuntimeError):
    """No free range is large enough right now."""


@dataclass(frozen=True)
class StagingRange:
    offset: int
    nbytes: int
    generation: int | None = None  # a guarded area's: writes into the range must name it


class StagingArea:
    def __init__(self, engine: Messenger, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging size must be positive, got {nbytes}")
        self.nbytes = nbytes
        self.buffer = engine.alloc_shared(nbytes)
        self.handle: RegionHandle = engine.register(self.buffer)
        self._engine = engine
        self.guarded = False
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, length)
        self._used: dict[int, int] = {}  # offset -> rounded length
        self._holders: dict[int, tuple[str, float]] = {}  # offset -> (owner, monotonic time allocated)

    def guard(self) -> None:
        """Peers write into this area only into allocated ranges, naming their generation (the
        ranges allocated from now on; idempotent)."""
        self._engine.guard(self.handle)
        self.guarded = True

    def allocate(self, nbytes: int, owner: str = "") -> StagingRange:
        """A range of at least ``nbytes``; raises ``StagingFull`` (or ValueError if it can never fit).
        ``owner``: what the range is for (a request id), as ``holders`` names it."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        size = -(-nbytes // _ALIGN) * _ALIGN
        if size > self.nbytes:
            raise ValueError(f"{nbytes} bytes can never fit in a staging area of {self.nbytes}")
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, length - size)
                    self._used[off] = size
                    self._holders[off] = (owner, time.monotonic())
                    break
            else:
                raise StagingFull(f"no free staging range of {nbytes} bytes ({self._free_bytes()} free, fragmented)")
        generation = self._engine.open_range(self.handle, off, nbytes) if self.guarded else None
        return StagingRange(off, nbytes, generation)

    def revoke(self, r: StagingRange) -> None:
        """End the range's current use: writes for it are refused from now on (idempotent; the
        range stays allocated until ``release``)."""
        if r.generation is not None:
            self._engine.close_range(self.handle, r.generation)

    def release(self, r: StagingRange) -> None:
        self.revoke(r)
        with self._lock:
            size = self._used.pop(r.offset, None)
            if size is None:
                raise ValueError(f"staging range at {r.offset} is not allocated")
            del self._holders[r.offset]
            i = bisect.bisect(self._free, (r.offset, 0))
            off, length = r.offset, size
            if i < len(self._free) and self._free[i][0] == off + length:  # merge with the next
                length += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # and the previous
                off, prev = self._free[i - 1]
                length += prev
                i -= 1
                del self._free[i]
            self._free.insert(i, (off, length))

    def view(self, r: StagingRange, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The range as a tensor of ``shape`` (its bytes must match exactly)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for d in shape:
            count *= d
        if count * itemsize != r.nbytes:
            raise ValueError(f"shape {shape} of {dtype} is not {r.nbytes} bytes")
        return self.buffer[r.offset : r.offset + r.nbytes].view(dtype).view(shape)

    @property
    def num_free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes()

    def _free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def num_allocated(self) -> int:
        with self._lock:
            return len(self._used)

    def holders(self) -> list[tuple[str, float]]:
        """Each allocated range's owner and how long it has been held (seconds), oldest first:
        what names the culprit when a range stays held after its request has ended."""
        now = time.monotonic()
        with self._lock:
            held = sorted(self._holders.values(), key=lambda h: h[1])
        return [(owner, round(now - since, 1)) for owner, since in held]

    def check(self) -> None:
        """Free and allocated ranges tile the region with no gap or overlap."""
        with self._lock:
            spans = sorted([*self._free, *self._used.items()])
        pos = 0
        for off, length in spans:
            if off != pos:
                raise AssertionError(f"staging: range at {off}, expected {pos}")
            pos += length
        if pos != self.nbytes:
            raise AssertionError(f"staging ranges cover {pos} of {self.nbytes} bytes")


async def when_free(allocate: Callable[[], T], timeout_s: float) -> T:
    """``allocate()``, retried while it raises ``StagingFull``, for at most ``timeout_s``:
    earlier requests free their ranges as their writes complete. Raises ``TimeoutError``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return allocate()
        except StagingFull:
            if loop.time() > deadline:
                raise TimeoutError("staging stayed full") from None
            await asyncio.sleep(0.005)
