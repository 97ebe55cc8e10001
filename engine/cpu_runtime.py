"""Process-wide settings that make CPU inference fast: thread count and the allocator; and what
the CPU computes fast."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def configure_cpu_runtime(threads: int) -> None:
    """Set torch's intra-op threads and keep freed activation memory for reuse.

    By default glibc serves every allocation above a few MB with a fresh ``mmap`` and returns it
    on free, so each step's large activations (gathered KV pages, MLP outputs) are page-faulted
    in again, which costs more than the copies themselves (measured 3.8 ms -> 0.65 ms for a 15 MB
    KV gather). Raising the mmap and trim thresholds makes the heap keep and reuse that memory.
    """
    torch.set_num_threads(threads)
    if not sys.platform.startswith("linux"):
        return
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        ok = False
    if not ok:
        log.info("could not tune the C allocator (not glibc); CPU steps may be slower")


def fast_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (avx512_bf16 or AMX).

    Without it (AVX2 only) torch emulates bfloat16 matmuls: a prefill-sized one measured 7x
    slower than in float32, so the CPU default precision depends on this
    (``engine.config.EngineConfig``). torch exposes the check only as a private function.
    """
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
