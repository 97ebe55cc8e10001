"""bench.faults --costs: what the KV checks cost, against the step they guard.

The decode instance verifies one checksum per layer of every prompt it takes (xxh3-64 keyed by
the range's use, ``cluster.kv_stream.checksums``), and the prefill instance computes them as it
streams; a pool reader checks each part of each object it loads (the same hash). This measures,
for a prompt of ``tokens`` tokens of the default model at the shipped precision (its prefill is
the fastest step, so the checks' share is the largest there):

* the prefill step that computes it (the engine in this process, best of a few);
* the checksum of every layer of its KV, with xxh3-64 (what ships) and with CRC32C (the
  ``crc32c`` package: hardware CRC where the CPU has it) and zlib's CRC-32 for comparison;

and prints each hash's time, its share of the step, and its throughput.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch
import xxhash

from cluster.kv_stream import layer_checksums
from engine.kv_layout import KVLayout


def _best(fn: Callable[[], object], runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _crc32c() -> Callable[[memoryview], int]:
    try:
        import crc32c
    except ImportError as exc:  # an optional package: only this comparison needs it
        raise ImportError("bench.faults --costs needs crc32c: pip install -e '.[bench]'", name=exc.name) from exc
    return crc32c.crc32c


def measure(tokens: int = 512) -> dict[str, float]:
    """Seconds for one prefill of ``tokens`` tokens and for each hash over its whole KV."""
    from engine import LLM, SamplingParams

    llm = LLM()
    ids = [(7919 * i) % 20000 + 100 for i in range(tokens)]
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([ids], params)  # warm up (kernels, allocator)
    # A prompt the prefix cache has not seen each time: shift the tokens.
    shifts = iter(range(1, 1000))

    def prefill() -> None:
        shift = next(shifts)
        llm.generate([[t + shift for t in ids]], params)

    step = _best(prefill, runs=3)
    layout: KVLayout = llm.engine.runner.wire_layout
    blocks = -(-tokens // layout.block_size)
    kv = torch.randint(0, 255, (layout.nbytes(blocks),), dtype=torch.uint8).view(layout.torch_dtype)
    kv = kv.reshape(layout.shape(blocks))
    layers = [memoryview(kv[i].reshape(-1).view(torch.uint8).numpy()) for i in range(layout.num_layers)]
    crc32c = _crc32c()
    return {
        "tokens": tokens, "layers": layout.num_layers, "kv_bytes": layout.nbytes(blocks), "prefill_s": step,
        "xxh3_s": _best(lambda: layer_checksums(kv, 12345)),
        "crc32c_s": _best(lambda: [crc32c(m) for m in layers]),
        "zlib_crc32_s": _best(lambda: [zlib.crc32(m) for m in layers]),
        "xxh3_raw_s": _best(lambda: [xxhash.xxh3_64_intdigest(m) for m in layers]),
    }


def format_costs(m: dict[str, float]) -> str:
    lines = [f"checks' costs: a {m['tokens']}-token prompt, {m['layers']} layers, "
             f"{m['kv_bytes'] / 2**20:.1f} MiB of KV; its prefill step {m['prefill_s'] * 1e3:.1f} ms",
             "| hash | all layers | share of the prefill step | GB/s |", "|---|---|---|---|"]
    for name, key in (("xxh3-64 as shipped (keyed, per layer tensor)", "xxh3_s"),
                      ("xxh3-64 over the same bytes", "xxh3_raw_s"),
                      ("CRC32C (crc32c package)", "crc32c_s"), ("CRC-32 (zlib)", "zlib_crc32_s")):
        s = m[key]
        lines.append(f"| {name} | {s * 1e3:.2f} ms | {100 * s / m['prefill_s']:.2f}% | {m['kv_bytes'] / s / 1e9:.1f} |")
    return "\n".join(lines)


def print_costs() -> None:
    print(format_costs(measure()), flush=True)
