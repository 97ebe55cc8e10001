"""The native CPU kernels against this machine's roofline: what ``python -m bench.kernels`` runs
on a machine without CUDA (``--help`` for the flags).

Method (every figure a median over ``--repeats`` timed runs after one untimed; one process,
``--threads`` threads):
  * the roofline: read bandwidth (``sum`` of a 512 MiB float32 tensor) and the matmul rate of
    oneDNN at a large square size in float32 and bfloat16 (the rate a compute-bound kernel can
    reach here);
  * the int4 projection (``kernels.quant_linear_native``, the default model's 3072x576 gate/up
    shape) at 1-64 rows, cycling through enough distinct weights that they come from memory:
    the weight bytes read per second against the read bandwidth, and GFLOP/s against the float32
    matmul rate;
  * paged decode attention (``kernels.decode_attention_native``): ``--attn-seqs`` sequences of
    ``--context`` tokens, one layer's KV per call, 30 layers' worth cycled (from memory), float32
    and bfloat16 caches: KV bytes per second;
  * the whole decode step of the default model (``LLMEngine.step`` with every sequence decoding,
    ``--context``-token prompts) at ``--rows`` sequences, through the native decoder layers and,
    in the same engine, the eager layers (``native_rows`` 0: what ran past 8 rows before the
    native layer took every batch): ms a step, the bytes it must read (the weights as that batch
    reads them: int4 codes at up to the crossover, the dense copies past it; the LM head; the
    contexts' KV) and that over the time as a share of the read bandwidth.

Targets (issue 39), printed beside the figures: a step of 16 rows at most 2x the 1-row step and
64 rows at most 4x; the 1-row step at least 50% of the read bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bench.transfer import format_table

STEP_16_OVER_1, STEP_64_OVER_1, BANDWIDTH_SHARE = 2.0, 4.0, 0.5


def median_s(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Median seconds of one ``fn()`` over ``repeats`` timed batches of ``inner`` calls."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def read_bandwidth(repeats: int) -> float:
    """GB/s of reading a 512 MiB float32 tensor once (``sum``)."""
    x = torch.ones(128 << 20)
    return x.numel() * 4 / median_s(x.sum, repeats) / 1e9


def matmul_rate(dtype: torch.dtype, repeats: int, n: int = 1024) -> float:
    """GFLOP/s of oneDNN's ``n x n x n`` matmul in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_s(lambda: a @ b, repeats, 5) / 1e9


def bench_projection(rows: list[int], bandwidth: float, fp32_rate: float, repeats: int) -> list[list]:
    from mooncake_kernels.quant_linear import pack_q4, quant_linear_native

    n, k, copies = 3072, 576, 64  # 64 weights of 1.1 MB: past the caches
    g = torch.Generator().manual_seed(0)
    weights = [pack_q4(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.01,
                       -torch.rand(n, k // 32, generator=g) * 0.1) for _ in range(copies)]
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=g)
        at = iter(range(1 << 30))
        s = median_s(lambda: quant_linear_native(x, weights[next(at) % copies]), repeats, copies)
        gbs = weights[0].numel() / s / 1e9
        gflops = 2 * m * n * k / s / 1e9
        out.append([f"int4 {n}x{k}", m, s * 1e6, gbs, f"{gbs / bandwidth:.0%}", gflops, f"{gflops / fp32_rate:.0%}"])
    return out


def bench_attention(seqs: int, context: int, bandwidth: float, repeats: int) -> list[list]:
    from mooncake_kernels.decode_attention import decode_attention_native

    layers, hkv, group, d, bs = 30, 3, 3, 64, 16  # the default model's attention
    blocks = seqs * -(-context // bs)
    g = torch.Generator().manual_seed(1)
    tables = torch.randperm(blocks, generator=g).int().view(seqs, -1).contiguous()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, hkv * group, d, generator=g)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        caches = [(torch.randn(blocks, hkv, bs, d, generator=g).to(dtype), torch.randn(blocks, hkv, bs, d, generator=g).to(dtype))
                  for _ in range(layers)]
        at = iter(range(1 << 30))

        def call() -> torch.Tensor:
            k, v = caches[next(at) % layers]
            return decode_attention_native(q, k, v, tables, lens, d**-0.5)

        s = median_s(call, repeats, layers)
        kv = 2 * seqs * context * hkv * d * caches[0][0].element_size()
        out.append([f"{seqs} x {context} tokens, {str(dtype).removeprefix('torch.')}", s * 1e3, kv / s / 1e9,
                    f"{kv / s / 1e9 / bandwidth:.0%}"])
    return out


def step_bytes(engine, rows: int, context: int) -> int:
    """What a decode step of ``rows`` sequences must read: the weights as that batch multiplies by
    them (``engine.quantization.step_weight_bytes``) and every sequence's K and V in every layer."""
    from engine.quantization import step_weight_bytes

    kv = rows * context * engine.model_config.kv_bytes_per_token(engine.config.kv_cache_dtype)
    return step_weight_bytes(engine.runner.model, rows) + kv


def bench_steps(rows: list[int], context: int, threads: int, bandwidth: float, repeats: int) -> list[list]:
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(threads=threads, kv_cache_gib=1.0, max_num_batched_tokens=4096))
    model = engine.runner.model
    native_rows = model.native_rows
    g = torch.Generator().manual_seed(2)
    vocab = engine.model_config.vocab_size
    out, one = [], {}
    for n in rows:
        for i in range(n):
            engine.add_request(torch.randint(100, vocab - 100, (context,), generator=g).tolist(),
                               SamplingParams(temperature=0, max_tokens=4 * repeats + 8, ignore_eos=True),
                               request_id=f"{n}-{i}")
        while any(s.num_output_tokens == 0 for s in engine.seqs.values()):
            engine.step()  # the prompts' prefill
        for name, rows_native in (("native", native_rows), ("eager", 0)):
            model.native_rows = rows_native
            s = median_s(engine.step, repeats, 2)
            step_read = step_bytes(engine, n, context)
            one.setdefault(name, s)
            out.append([name, n, s * 1e3, f"{s / one[name]:.2f}x", step_read / 1e6,
                        f"{step_read / s / 1e9 / bandwidth:.0%}", n / s])
        model.native_rows = native_rows
        while engine.has_unfinished():
            engine.step()
    return out


def run(args: argparse.Namespace) -> int:
    import platform

    torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    bandwidth = read_bandwidth(args.repeats)
    fp32, bf16 = matmul_rate(torch.float32, args.repeats), matmul_rate(torch.bfloat16, args.repeats)
    print(f"CPU: {cpu}, {args.threads} threads")
    print(f"roofline: read {bandwidth:.1f} GB/s; oneDNN matmul {fp32:.0f} GFLOP/s float32, {bf16:.0f} bfloat16\n")
    print(format_table(["kernel", "rows", "us", "weight GB/s", "of read bw", "GFLOP/s", "of fp32 matmul"],
                       bench_projection(args.rows, bandwidth, fp32, args.repeats)))
    print()
    print(format_table(["decode attention, a layer", "ms", "KV GB/s", "of read bw"],
                       bench_attention(args.attn_seqs, args.context, bandwidth, args.repeats)))
    print()
    steps = bench_steps(args.rows, args.context, args.threads, bandwidth, args.repeats)
    print(format_table(["decode step (default model)", "rows", "ms", "/ 1 row", "MB read", "of read bw", "tok/s"], steps))
    native = {r[1]: r[2] for r in steps if r[0] == "native"}
    eager = {r[1]: r[2] for r in steps if r[0] == "eager"}
    print()
    for n in sorted(native):
        print(f"rows {n}: native {native[n]:.1f} ms, eager {eager[n]:.1f} ms: {eager[n] / native[n]:.2f}x faster")
    if 1 in native:
        for n, target in ((16, STEP_16_OVER_1), (64, STEP_64_OVER_1)):
            if n in native:
                ratio = native[n] / native[1]
                print(f"target: {n} rows <= {target:.0f}x 1 row: {ratio:.2f}x {'met' if ratio <= target else 'MISSED'}")
        share = next(float(r[5].rstrip("%")) / 100 for r in steps if r[0] == "native" and r[1] == 1)
        print(f"target: 1 row >= {BANDWIDTH_SHARE:.0%} of read bandwidth: {share:.0%} "
              f"{'met' if share >= BANDWIDTH_SHARE else 'MISSED'}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CPU (no CUDA)")
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="decode rows (sequences) a step")
    g.add_argument("--context", type=int, default=300, help="tokens of each sequence's context")
    g.add_argument("--attn-seqs", type=int, default=64)
    g.add_argument("--repeats", type=int, default=5)
