"""The SSD tier of a pool segment: objects evicted from DRAM, one file each, LRU within a budget.

Files are named by a hash of the object key (keys hold ``/``) and written to a temporary name,
then renamed, so a crash never leaves a half-written file under an object's name. The directory
is this segment's alone: it is emptied at start, since the index that named its files died with
the previous process.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path


class SsdTier:
    def __init__(self, directory: str | Path, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"SSD tier capacity must be positive, got {capacity_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("*.kv*"):
            stale.unlink()
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self.used_bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def _path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest() + ".kv")

    def put(self, key: str, data: memoryview) -> list[str]:
        """Store ``data`` under ``key``; returns the keys evicted (least recently used first) to
        make room. Raises ValueError when it can never fit."""
        if len(data) > self.capacity_bytes:
            raise ValueError(f"{len(data)} bytes exceed the SSD tier's {self.capacity_bytes}")
        evicted = []
        self.delete(key)
        while self.used_bytes + len(data) > self.capacity_bytes:
            old = next(iter(self._sizes))
            self.delete(old)
            evicted.append(old)
        path = self._path(key)
        tmp = path.with_suffix(".kv.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self._sizes[key] = len(data)
        self.used_bytes += len(data)
        return evicted

    def read_into(self, key: str, out: memoryview) -> None:
        """Copy the object into ``out`` (its exact size) and mark it recently used."""
        with open(self._path(key), "rb") as f:
            if f.readinto(out) != len(out):
                raise OSError(f"SSD object {key} is shorter than {len(out)} bytes")
        self._sizes.move_to_end(key)

    def delete(self, key: str) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.used_bytes -= size
        self._path(key).unlink(missing_ok=True)
        return True
