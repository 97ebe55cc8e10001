"""Cores that follow the load between the engines of one host.

Two instances on one small machine, a prefill and a decode one, each started with half the
cores, leave half of the machine idle whenever one of them has nothing to do: a decode batch runs
on one core of two while the prefill instance waits for its next prompt. A ``CoreShare`` lets
them draw on one budget instead: before each step an engine marks itself busy and takes
``cores // busy engines`` threads (at least one); when it has nothing left it marks itself idle,
and the others take its cores at their next step.

The budget is a small file, in shared memory where the host has it, of one slot per engine::

    header: magic, cores, slots                                   (3 x int64)
    slot i: busy_until (CLOCK_MONOTONIC ns, 0 = idle), threads    (2 x int64)

``create`` writes it (the Supervisor, once for the instances it starts), each engine opens it
with the slot it was given. A busy mark is a lease, renewed by every step: an engine that dies
busy holds its share for ``LEASE_S`` at most. Fields are 8-byte aligned, one store each, so a
reader never sees half a write; nothing else is shared, and no lock is taken.

The hand-over is where cores are lost: an engine that turns busy while another runs a step on
all the cores would put three threads on two cores, and an OpenMP step with one thread
descheduled waits for it at every barrier (measured: the decode batch's TBT p90 rose 40.5 ->
42.9 ms and 58.7 -> 68.7 ms under bench.disagg's loads without the wait below). So before its
step an engine waits, at most ``HANDOVER_WAIT_S``, until the threads the others hold (``threads``,
which each publishes as its step starts) leave room for its own: the others shrink at their next
step, which is at most a decode step away. Only an engine whose steps are that short takes more
than its even share (``cores // slots``): a prefill step of hundreds of milliseconds on all the
cores would hold them for that long after a decode batch turned busy (measured: the trace's TBT
p90 57 -> 105 ms when every engine could), so in a prefill / decode pair it is the decode batch
that takes the idle prefill instance's cores, and gives them back within a step.

Invariants: ``busy()`` is between 1 and ``cores``; an engine only writes its own slot; with
every slot busy each engine gets ``cores // slots`` threads, the static split's; one whose last
step took longer than ``HANDOVER_WAIT_S`` gets no more.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from pathlib import Path

import numpy as np

MAGIC = int.from_bytes(b"MCCORES1", "little")
HEADER = 3  # int64 fields before the slots
SLOT = 2  # int64 fields a slot: busy_until, threads
# A busy mark lapses this long after its last step: longer than any step, short enough that the
# cores of an engine that died busy come back soon.
LEASE_S = 2.0
# How long an engine turning busy waits for the others to give up the cores it takes: about one
# decode step of a large batch; past it, it takes them anyway.
HANDOVER_WAIT_S = 0.05
_POLL_S = 0.0005


def create(path: str | os.PathLike, cores: int, slots: int) -> Path:
    """Write an empty budget of ``cores`` for ``slots`` engines at ``path`` (replacing any)."""
    if cores < 1 or slots < 1:
        raise ValueError(f"a core share needs at least one core and one slot, got {cores} and {slots}")
    table = np.zeros(HEADER + SLOT * slots, dtype=np.int64)
    table[:HEADER] = (MAGIC, cores, slots)
    path = Path(path)
    # Written whole under another name, then renamed: an engine never opens half a header.
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(table.tobytes())
    os.replace(tmp, path)
    return path


def default_dir() -> Path:
    """Where budgets live: /dev/shm (memory, never written back) where the host has it."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class CoreShare:
    """One engine's slot in a budget written by ``create`` (module doc). Engine thread only."""

    def __init__(self, path: str | os.PathLike, slot: int) -> None:
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER * 8:
                raise ValueError(f"{path} is not a core share (it has {size} bytes)")
            self._map = mmap.mmap(f.fileno(), size)
        table = np.frombuffer(self._map, dtype=np.int64)
        magic, cores, slots = (int(x) for x in table[:HEADER])
        if magic != MAGIC or size != (HEADER + SLOT * slots) * 8 or cores < 1:
            raise ValueError(f"{path} is not a core share")
        if not 0 <= slot < slots:
            raise ValueError(f"core share {path} has slots 0..{slots - 1}, not {slot}")
        self.path, self.slot, self.cores = Path(path), slot, cores
        self._slots = table[HEADER:].reshape(slots, SLOT)
        self._others = np.arange(slots) != slot
        self._last_threads = 1  # what its last busy() gave

    def busy(self, last_step_s: float = 0.0) -> int:
        """Mark this engine busy for the next ``LEASE_S`` and return the threads its step takes,
        once the others leave room for them (module doc: the hand-over). ``last_step_s``: how
        long its previous step took: one that would take longer than ``HANDOVER_WAIT_S`` on
        more than its even share gets no more than that."""
        slots = self._slots
        deadline = time.monotonic() + HANDOVER_WAIT_S
        even = max(1, self.cores // len(slots))
        while True:
            now = time.monotonic_ns()
            slots[self.slot, 0] = now + int(LEASE_S * 1e9)
            live = slots[:, 0] > now
            threads = max(1, self.cores // int(np.count_nonzero(live)))  # this slot included
            # The step to come, at those threads, if it is like the last one.
            if threads > even and last_step_s * self._last_threads / threads > HANDOVER_WAIT_S:
                threads = even
            held = int(slots[live & self._others, 1].sum())
            if held + threads <= self.cores or time.monotonic() >= deadline:
                slots[self.slot, 1] = self._last_threads = threads
                return threads
            time.sleep(_POLL_S)

    def idle(self) -> None:
        """This engine has nothing to step: the others may take its cores."""
        self._slots[self.slot] = 0

    def close(self) -> None:
        self.idle()
        self._slots = None  # the view must go before the map can close
        self._map.close()
