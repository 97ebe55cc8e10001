"""Registered memory: the owner's table of regions and the handles peers use to name them.

A :class:`RegionHandle` is plain data (``to_dict`` / ``from_dict``) so it can travel through the
pool metadata or a control message. It names a region by the owning engine and an id; it carries
no address or key, so holding a handle grants nothing: every access is resolved and bounds-checked
by the owner's :class:`RegionTable`.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import TransferError
from .wire import Status


@dataclass(frozen=True)
class RegionHandle:
    """Names one registered region of one engine; safe to share with peers as plain data."""

    engine_id: str
    address: str
    region_id: int
    length: int
    shared: bool = False  # lies in shared memory, so a same-host peer may map it

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "address": self.address,
            "region_id": self.region_id,
            "length": self.length,
            "shared": self.shared,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegionHandle:
        try:
            handle = cls(
                str(data["engine_id"]),
                str(data["address"]),
                int(data["region_id"]),
                int(data["length"]),
                bool(data.get("shared", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a region handle: {data!r}") from exc
        if handle.length <= 0 or handle.region_id < 0:
            raise ValueError(f"not a region handle: {data!r}")
        return handle


@dataclass(frozen=True)
class SharedSpan:
    """Where a region lies inside a shared-memory file of this process (for same-host peers)."""

    fd: int
    offset: int


@dataclass(frozen=True)
class LocalRegion:
    """A registered buffer as its owner sees it: a flat byte view plus what keeps it alive."""

    region_id: int
    view: memoryview
    writable: bool
    address: int
    shared: SharedSpan | None
    keepalive: object

    @property
    def length(self) -> int:
        return len(self.view)

    def span(self, offset: int, length: int) -> memoryview:
        """Local bounds check for the requesting side's own buffer."""
        if offset < 0 or length <= 0 or offset + length > len(self.view):
            raise TransferError(
                f"local range [{offset}, {offset + length}) is outside region {self.region_id} of {len(self.view)} bytes"
            )
        return self.view[offset : offset + length]


def as_byte_view(buffer: object) -> tuple[memoryview, bool, object]:
    """A flat ``'B'`` memoryview of ``buffer``, whether it is writable, and the object to keep alive.

    Accepts contiguous CPU tensors of any dtype and anything with the buffer protocol (bytearray,
    mmap, numpy arrays, memoryview). Views are built without copying; they are what ``recv_into``
    fills and ``sendmsg`` reads.
    """
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise TransferError(
                f"only CPU tensors can be registered (got {buffer.device}); stage device memory through a CPU tensor"
            )
        if not buffer.is_contiguous():
            raise TransferError("tensor must be contiguous to be registered")
        # uint8 view -> numpy keeps the tensor's storage alive for as long as the view lives.
        array = buffer.detach().reshape(-1).view(torch.uint8).numpy()
        view = memoryview(array)
    else:
        try:
            view = memoryview(buffer)  # type: ignore[arg-type]
        except TypeError as exc:
            raise TransferError(f"cannot register {type(buffer).__name__}: no buffer protocol") from exc
        if not view.c_contiguous:
            raise TransferError("buffer must be C-contiguous to be registered")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if len(view) == 0:
        raise TransferError("cannot register an empty buffer")
    return view, not view.readonly, buffer


def view_address(view: memoryview) -> int:
    """Virtual address of a view's first byte (what RDMA registers and shared memory matches)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def check_access(region: LocalRegion | None, offset: int, length: int, write: bool) -> Status:
    if region is None:
        return Status.UNKNOWN_REGION
    if length <= 0 or offset < 0 or offset + length > region.length:
        return Status.OUT_OF_BOUNDS
    if write and not region.writable:
        return Status.READ_ONLY
    return Status.OK


class RegionTable:
    """The owner's registered regions; every remote access is resolved here before memory is touched.

    A region may be *guarded* (``guard``): a peer may then write only into a range of it the
    owner opened (``open_range``), and only naming the generation that opening returned. Closing
    the range (``close_range``) ends that use of it: a write still on its way for it, from a
    sender that stalled past the owner's timeout, is refused instead of landing in bytes that may
    belong to the range's next use.
    """

    def __init__(self) -> None:
        self._regions: dict[int, LocalRegion] = {}
        self._lock = threading.Lock()
        self._guards: dict[int, dict[int, tuple[int, int]]] = {}  # region -> generation -> (offset, length)

    def add(self, buffer: object, locate: Callable[[int, int], SharedSpan | None] = lambda a, n: None) -> LocalRegion:
        """Register ``buffer``; ``locate`` says whether its bytes lie in shareable memory."""
        view, writable, keepalive = as_byte_view(buffer)
        address = view_address(view)
        shared = locate(address, len(view))
        with self._lock:
            # Random ids make a stale or forged handle miss instead of hitting a newer region.
            region_id = secrets.randbits(62)
            while region_id in self._regions:
                region_id = secrets.randbits(62)
            region = LocalRegion(region_id, view, writable, address, shared, keepalive)
            self._regions[region_id] = region
        return region

    def guard(self, region_id: int) -> None:
        """From now on, writes into the region need a range opened for them (idempotent)."""
        with self._lock:
            if region_id not in self._regions:
                raise TransferError(f"region {region_id} is not registered")
            self._guards.setdefault(region_id, {})

    def open_range(self, region_id: int, offset: int, length: int) -> int:
        """Let writes naming the returned generation into ``[offset, offset + length)`` of a
        guarded region. Generations are random (a stale one cannot be guessed into a new use)."""
        with self._lock:
            guards = self._guards.get(region_id)
            if guards is None:
                raise TransferError(f"region {region_id} is not guarded")
            generation = secrets.randbits(63) | 1  # never 0
            while generation in guards:
                generation = secrets.randbits(63) | 1
            guards[generation] = (offset, length)
            return generation

    def close_range(self, region_id: int, generation: int) -> bool:
        """End a use of a range: its writes are refused from now on (False if it was not open)."""
        with self._lock:
            guards = self._guards.get(region_id)
            return guards is not None and guards.pop(generation, None) is not None

    def admits(self, slices: list[tuple[int, int, int, int]], generation: int | None) -> tuple[Status, int]:
        """Whether writes of (region, offset, length, _) descriptors naming ``generation`` may
        land: each one into a guarded region must lie inside the range opened under it."""
        with self._lock:
            for i, (region_id, offset, length, _) in enumerate(slices):
                guards = self._guards.get(region_id)
                if guards is None:
                    continue
                span = None if generation is None else guards.get(generation)
                if span is None or offset < span[0] or offset + length > span[0] + span[1]:
                    return Status.STALE, i
        return Status.OK, 0

    def remove(self, region_id: int) -> LocalRegion:
        with self._lock:
            self._guards.pop(region_id, None)
            region = self._regions.pop(region_id, None)
        if region is None:
            raise TransferError(f"region {region_id} is not registered")
        return region

    def get(self, region_id: int) -> LocalRegion | None:
        with self._lock:
            return self._regions.get(region_id)

    def resolve(self, region_id: int, offset: int, length: int, write: bool) -> tuple[Status, memoryview | None]:
        """The bytes ``[offset, offset + length)`` of a region, or the reason the access is refused."""
        region = self.get(region_id)
        status = check_access(region, offset, length, write)
        if status != Status.OK:
            return status, None
        return status, region.view[offset : offset + length]

    def check_all(self, slices: list[tuple[int, int, int, int]], write: bool) -> tuple[Status, int]:
        """Check (region, offset, length, _) descriptors without building views; the first refusal."""
        cache: dict[int, LocalRegion | None] = {}
        for i, (region_id, offset, length, _) in enumerate(slices):
            if region_id not in cache:
                cache[region_id] = self.get(region_id)
            status = check_access(cache[region_id], offset, length, write)
            if status != Status.OK:
                return status, i
        return Status.OK, 0
