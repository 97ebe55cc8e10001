"""Process-wide settings that make CPU inference fast: thread count and the allocator; and what
the CPU computes fast."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import time
from collections.abc import Callable

import torch

from mooncake_kernels import cpu_ext

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the only one whose allocator is tuned here), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None  # musl has neither


def configure_cpu_runtime(threads: int) -> None:
    """Set torch's intra-op threads and keep freed activation memory for reuse.

    By default glibc serves every allocation above a few MB with a fresh ``mmap`` and returns it
    on free, so each step's large activations (gathered KV pages, MLP outputs) are page-faulted
    in again, which costs more than the copies themselves (measured 3.8 ms -> 0.65 ms for a 15 MB
    KV gather). Raising the mmap and trim thresholds makes the heap keep and reuse that memory;
    ``return_freed_memory`` gives it back once the engine is idle.
    """
    torch.set_num_threads(threads)
    libc = _glibc()
    if libc is None or not (libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        log.info("could not tune the C allocator (not glibc); CPU steps may be slower")


def set_threads(threads: int) -> None:
    """Change the calling thread's torch (and OpenMP) thread count between two steps: the native
    kernels' parallel regions use the same OpenMP runtime (kernels/csrc/cpu_decode.cpp)."""
    torch.set_num_threads(threads)


def return_freed_memory() -> None:
    """Return the heap's free pages to the OS (glibc ``malloc_trim``; elsewhere nothing to do).

    With the thresholds ``configure_cpu_runtime`` sets, the heap keeps what the largest batch
    needed for good: after a burst at ten times the sustainable load a decode instance's private
    memory stayed 403 MiB higher. Trimming costs about 0.1 s per 1.5 GB freed and the next step
    faults its pages in again, so the engine calls it only after a while idle.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def rss_anon_bytes() -> int | None:
    """This process's private resident memory (``RssAnon``), or None where it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


HEAP_CHECK_S = 1.0  # how often a busy engine checks its memory (``HeapBound``)


class HeapBound:
    """Bounds how far the heap's kept memory grows while the engine is busy.

    ``configure_cpu_runtime`` has the heap keep freed memory for reuse, and the idle trim gives it
    back only once traffic pauses. Under steady heavy traffic it never pauses, and the heap grows
    far past what any step holds at once: the steps' temporaries are sized by their rows, which
    change every step, so freed blocks rarely fit the next ones and the heap fragments (256 rows
    of decodes: 94 MiB more live at the peak than at rest, the heap 420 MiB more). So
    after a step, at most every ``every_s``, this reads the process's private resident memory and
    trims the heap when it grew more than ``budget`` bytes since the last trim (what the next
    steps need is faulted in again, once a check at most); steady traffic that reuses what it
    keeps costs nothing. (Not glibc's free-byte count: a trim gives the pages back but leaves the
    chunks counted as free.) Nothing where the memory cannot be read (``rss_anon_bytes``).
    ``EngineConfig.busy_heap_free_mib`` is the budget (64 MiB)."""

    def __init__(self, budget: int, every_s: float = HEAP_CHECK_S, clock: Callable[[], float] = time.monotonic,
                 resident: Callable[[], int | None] = rss_anon_bytes) -> None:
        self.budget, self.every_s = budget, every_s
        self._clock, self._resident = clock, resident
        self._next = clock() + every_s
        self._floor: int | None = None  # resident memory after the last trim (or the first check)
        self.trims = 0

    def after_step(self) -> None:
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.every_s
        rss = self._resident()
        if rss is None:
            return
        if self._floor is None or rss < self._floor:  # the first check, or memory went back (idle)
            self._floor = rss
        elif rss - self._floor > self.budget:
            return_freed_memory()
            self.trims += 1
            self._floor = self._resident() or rss


def avx2_limit() -> bool:
    """Whether this process runs as an AVX2-only machine would: torch's own kernels limited with
    ``ATEN_CPU_CAPABILITY=avx2`` (oneDNN's with ``ONEDNN_MAX_CPU_ISA=AVX2``) or the native ones
    built with ``MOONCAKE_ISA=avx2``. Then no bfloat16 units and no AMX count as present, so the
    defaults are an AVX2 machine's, measurable on any machine (``--isa avx2`` of the benchmarks)."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" or cpu_ext.isa() == "avx2"


def fast_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (avx512_bf16 or AMX).

    Without it (AVX2 only) torch emulates bfloat16 matmuls: a prefill-sized one measured 7x
    slower than in float32, so the CPU default precision depends on this
    (``engine.config.EngineConfig``). torch exposes the check only as a private function.
    """
    if avx2_limit():
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@functools.cache
def amx_granted() -> bool:
    """Whether this process may run AMX tile instructions: the CPU lists them and the kernel grants
    the process their register state (Linux ``arch_prctl(ARCH_REQ_XCOMP_PERM)``, which torch's
    ``_init_amx`` asks for). A CPU can list AMX in /proc/cpuinfo while its VM refuses the state:
    a process that runs a tile instruction without the grant dies of SIGILL (llama.cpp's AMX
    path did on one of our Xeons). oneDNN asks for the grant itself and uses AMX only with it;
    this says whether its bfloat16 matmuls run on tiles here (the benchmarks print it beside the
    kernels they measured)."""
    if avx2_limit():
        return False
    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
