"""The SSD tier of a pool segment: objects evicted from DRAM, one file each, LRU within a budget.

Every stored copy gets a file name of its own (a hash of the object key, which holds ``/``, and
a generation number), written under a temporary name and then renamed, so a crash never leaves
a half-written file under an object's name, and a copy deleted while another thread still reads
it (or a deletion carried out late) can never touch a newer copy of the same object. The
directory is this segment's alone: it is emptied at start, since the index that named its files
died with the previous process.

The tier's own lock guards only its bookkeeping; the file reads and writes run outside it (and
the segment calls them outside its own lock, ``segment.py``). ``delete`` forgets a copy at once
and leaves its file to ``sweep``, which the segment calls once it has let go of its lock.

A write that fails (a full disk: ``ENOSPC``; any ``OSError``) stores nothing: its space is given
back, its partial file removed, and the error goes to the caller, whose object is then simply
not on this tier.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
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
        self._lock = threading.Lock()
        self._files: OrderedDict[str, tuple[int, Path]] = OrderedDict()  # key -> (bytes, file), LRU first
        self._reserved = 0  # bytes of writes in flight
        self._trash: list[Path] = []  # files of forgotten copies, unlinked by ``sweep``
        self._generation = itertools.count()
        self.used_bytes = 0  # stored and being written

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._files

    def _new_path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.{next(self._generation)}.kv"

    def put(self, key: str, data: memoryview | bytes) -> list[str]:
        """Store ``data`` under ``key`` (replacing any copy); returns the keys evicted (least
        recently used first) to make room. Raises ValueError when it can never fit, and
        ``OSError`` when the write fails (nothing is stored then, and nothing was evicted for it
        that was not evicted already)."""
        size = len(data)
        if size > self.capacity_bytes:
            raise ValueError(f"{size} bytes exceed the SSD tier's {self.capacity_bytes}")
        evicted = []
        with self._lock:
            self._forget(key)
            while self.used_bytes + size > self.capacity_bytes and self._files:
                old = next(iter(self._files))
                self._forget(old)
                evicted.append(old)
            self.used_bytes += size
            path = self._new_path(key)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.used_bytes -= size
            self.sweep()
            raise
        with self._lock:
            self._forget(key)  # a concurrent put of the same object may have won meanwhile
            self._files[key] = (size, path)
        self.sweep()
        return evicted

    def read_into(self, key: str, out: memoryview) -> None:
        """Copy the object into ``out`` (its exact size) and mark it recently used. ``OSError``
        (``FileNotFoundError`` when it is not, or no longer, on this tier)."""
        with self._lock:
            entry = self._files.get(key)
            if entry is None:
                raise FileNotFoundError(f"SSD object {key} is not on this tier")
            self._files.move_to_end(key)
        with open(entry[1], "rb") as f:
            if f.readinto(out) != len(out):
                raise OSError(f"SSD object {key} is shorter than {len(out)} bytes")

    def delete(self, key: str) -> bool:
        """Forget ``key``'s copy now; its file goes at the next ``sweep``."""
        with self._lock:
            return self._forget(key)

    def sweep(self) -> None:
        """Unlink the files of the copies forgotten so far (call it holding no other lock)."""
        with self._lock:
            trash, self._trash = self._trash, []
        for path in trash:
            path.unlink(missing_ok=True)

    def _forget(self, key: str) -> bool:  # lock held
        entry = self._files.pop(key, None)
        if entry is None:
            return False
        self.used_bytes -= entry[0]
        self._trash.append(entry[1])
        return True
