"""Which kernel multiplies how many rows of a quantized projection, chosen by measurement on this
machine, never by the names of its instruction sets.

With the native kernels the integer GEMM (:mod:`kernels.quant_linear`) takes every row count, in
one order of sums (the deterministic mode's weights). The mode that is not deterministic
(``--no-deterministic``) may hand the rows past a crossover to oneDNN's dense matmul in the
model's dtype, on a dense copy of the weights, where that is faster: on a CPU whose bfloat16 units
(avx512_bf16, AMX tiles) outrun the integer dot products at many rows. :func:`integer_rows`
measures where, once per machine kind and setting: both kernels on the default model's gate/up
shape (3072x576, weights from memory) at 1 to 512 rows, the GEMM's crossover the last row count
before the dense matmul is faster by more than ``MARGIN`` at it and at every larger one. The result
is cached as JSON in ``<cache root>/kernel-choice/`` (keyed by the kernels' build, the dtype, the
threads and torch's instruction-set limits), and said in the start log and /stats.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import mooncake_kernels as kernels
from mooncake_kernels import cpu_ext

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SHAPE = (3072, 576)
# The dense matmul must beat the GEMM by this much to take rows from it: a tie keeps the GEMM,
# whose answers do not depend on the batch and which needs no dense copy in memory.
MARGIN = 0.05
_COPIES = 24  # distinct weights cycled through, 1 MB each: past the caches


def _key(dtype: torch.dtype) -> dict:
    return {"build": cpu_ext.build_key(), "dtype": str(dtype), "threads": torch.get_num_threads(),
            "limits": {v: os.environ.get(v, "") for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")},
            "shape": SHAPE, "rows": ROWS, "margin": MARGIN}


def _path(key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cpu_ext.cache_root() / "kernel-choice" / f"{name}.json"


def median_s(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Median seconds of one ``fn()`` over ``repeats`` timed batches of ``inner`` calls, after one
    untimed call (also the CPU benchmarks' timer, :mod:`bench.cpu_kernels`)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def measure(dtype: torch.dtype) -> dict[int, tuple[float, float]]:
    """Seconds of one projection by the integer GEMM and by oneDNN's packed matmul in ``dtype``,
    at each of ``ROWS``."""
    n, k = SHAPE
    g = torch.Generator().manual_seed(0)
    q4 = [kernels.pack_q4(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.01,
                          -torch.rand(n, k // 32, generator=g) * 0.1) for _ in range(_COPIES)]
    dense = [kernels.pack_dense(torch.randn(n, k, generator=g).to(dtype)) for _ in range(_COPIES)]
    times = {}
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        xd = x.to(dtype)
        at = iter(range(1 << 40))
        t_int = median_s(lambda: kernels.quant_linear_native(x, q4[next(at) % _COPIES], n), 5, _COPIES)
        t_dense = median_s(lambda: kernels.dense_linear_native(xd, dense[next(at) % _COPIES]), 5, _COPIES)
        times[rows] = (t_int, t_dense)
    return times


def crossover(times: dict[int, tuple[float, float]], margin: float = MARGIN) -> int | None:
    """The most rows the integer GEMM should take: the row count before the first from which the
    dense matmul is faster by more than ``margin`` at every larger count measured; None where
    there is none (the GEMM takes every row count)."""
    rows = sorted(times)
    last = None
    for i in range(len(rows) - 1, -1, -1):
        t_int, t_dense = times[rows[i]]
        if t_dense * (1 + margin) < t_int:
            last = i
        else:
            break
    if last is None:
        return None
    return rows[last - 1] if last > 0 else 0


def integer_rows(dtype: torch.dtype) -> int | None:
    """The integer GEMM's crossover to a dense matmul in ``dtype`` on this machine (see the module
    docstring), measured at the first call of a machine kind and cached; None: every row count,
    and also where oneDNN cannot pack ``dtype`` here."""
    if not kernels.dense_native_available(dtype):
        return None
    key = _key(dtype)
    path = _path(key)
    try:
        data = json.loads(path.read_text())
        if data["key"] == key:
            return data["int_rows"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    started = time.perf_counter()
    try:
        times = measure(dtype)
    except RuntimeError as e:  # oneDNN lists the dtype yet cannot run it on this CPU
        log.info("no dense %s matmul here (%s): the integer GEMM takes every row count", dtype, e)
        return None
    rows = crossover(times)
    log.info("kernel choice measured in %.1f s: integer GEMM (%s) %s; us by rows (GEMM / dense %s): %s",
             time.perf_counter() - started, cpu_ext.load().int_gemm_path(),
             "at every row count" if rows is None else f"up to {rows} rows, oneDNN past them",
             str(dtype).removeprefix("torch."),
             ", ".join(f"{r}: {a * 1e6:.0f}/{b * 1e6:.0f}" for r, (a, b) in times.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "int_rows": rows, "us": {r: [a * 1e6, b * 1e6] for r, (a, b) in times.items()}}))
    tmp.replace(path)
    return rows
