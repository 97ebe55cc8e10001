"""The native CPU kernels against this machine's roofline: what ``python -m bench.kernels`` runs
on a machine without CUDA (``--help`` for the flags; ``--isa avx2`` measures an AVX2-only
machine's kernels on any CPU, :mod:`bench.isa`).

Method (every figure a median over ``--repeats`` timed runs after one untimed; one process,
``--threads`` threads):
  * the roofline: read bandwidth (``sum`` of a 512 MiB float32 tensor), the matmul rate of
    oneDNN at a large square size in float32 and bfloat16 (the rate a compute-bound float kernel
    reaches here), and the rate of the integer dot instruction the GEMM uses (a loop of it,
    ``int8_dot_rate``), whose half is the two-level GEMM's ceiling;
  * the quantized projections (``kernels.quant_linear_native``, the integer GEMM) at the default
    model's shapes (q4: q/k/v 960x576, output 576x576, gate/up 3072x576, down 576x1536; the q8 LM
    head 49152x576) and ``--rows`` rows, cycling through enough distinct weights that they come
    from memory: GFLOP/s against the float32 matmul rate and the GEMM's integer ceiling; then a
    step's linear layers together (30 layers and the head), against the target;
  * paged decode attention (``kernels.decode_attention_native``): ``--attn-seqs`` sequences of
    ``--context`` tokens, one layer's KV per call, 30 layers' worth cycled (from memory), float32
    and bfloat16 caches: KV bytes per second;
  * the whole decode step of the default model (``LLMEngine.step`` with every sequence decoding,
    ``--context``-token prompts) at ``--rows`` sequences: the default (deterministic: the GEMM at
    every row count) and ``--no-deterministic`` (the GEMM up to the crossover measured here,
    oneDNN on dense copies past it), one engine each: ms a step, the bytes it must read (the
    weights as that batch reads them, the contexts' KV) and that over the time as a share of the
    read bandwidth.

Targets (issue 51), printed beside the figures: a step's linear layers at 16 and 64 rows at least
1.3x the float32 matmul rate; the 1-row step at least 50% of the read bandwidth.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench import isa
from bench.transfer import format_table
from engine.kernel_choice import median_s

LINEARS_OVER_FP32, BANDWIDTH_SHARE = 1.3, 0.5
# The default model's projections (SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64,
# intermediate 1536, 30 layers) and its LM head (vocab 49152, int8).
LAYER_SHAPES = {"q/k/v": (960, 576), "output": (576, 576), "gate/up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE, LAYERS = (49152, 576), 30


def read_bandwidth(repeats: int) -> float:
    """GB/s of reading a 512 MiB float32 tensor once (``sum``)."""
    x = torch.ones(128 << 20)
    return x.numel() * 4 / median_s(x.sum, repeats) / 1e9


def matmul_rate(dtype: torch.dtype, repeats: int, n: int = 1024) -> float:
    """GFLOP/s of oneDNN's ``n x n x n`` matmul in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_s(lambda: a @ b, repeats, 5) / 1e9


def int8_dot_rate(repeats: int) -> float:
    """G int8 multiply-adds a second of the GEMM's dot instruction, all threads (``int8_dot_rate``)."""
    from mooncake_kernels import cpu_ext

    ext = cpu_ext.load()
    return statistics.median(ext.int8_dot_rate(2_000_000) for _ in range(repeats)) / 1e9


def bench_projections(rows: list[int], fp32_rate: float, gemm_ceiling: float, repeats: int) -> tuple[list[list], dict]:
    """Each shape at each row count, then the step's linears together; returns the table's rows
    and ``{rows: GFLOP/s of the step's linears}``."""
    from mooncake_kernels.quant_linear import pack_q4, pack_q8, quant_linear_native

    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, (n, k) in LAYER_SHAPES.items():
        copies = max(4, (48 << 20) // (n * k * 20 // 32))  # ~48 MB of each: past the caches
        weights[name] = (n, k, None, [pack_q4(torch.randint(0, 16, (n, k), generator=g),
                                             torch.rand(n, k // 32, generator=g) * 0.01,
                                             -torch.rand(n, k // 32, generator=g) * 0.1) for _ in range(copies)])
    n, k = HEAD_SHAPE
    p8, s8 = pack_q8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 0.01)
    weights["LM head (q8)"] = (n, k, s8, [p8])
    out, linears = [], {}
    for m in rows:
        total_s = total_flop = 0.0
        for name, (n, k, scale, ws) in weights.items():
            x = torch.randn(m, k, generator=g)
            at = iter(range(1 << 40))
            s = median_s(lambda: quant_linear_native(x, ws[next(at) % len(ws)], n, scale), repeats, len(ws))
            flop = 2 * m * n * k
            per_step = 1 if scale is not None else LAYERS
            total_s, total_flop = total_s + per_step * s, total_flop + per_step * flop
            out.append([name, f"{n}x{k}", m, s * 1e6, flop / s / 1e9, f"{flop / s / 1e9 / fp32_rate:.2f}x",
                        f"{flop / s / 1e9 / gemm_ceiling:.0%}"])
        linears[m] = total_flop / total_s / 1e9
        out.append([f"a step's linears ({LAYERS} layers + head)", "", m, total_s * 1e6, linears[m],
                    f"{linears[m] / fp32_rate:.2f}x", f"{linears[m] / gemm_ceiling:.0%}"])
    return out, linears


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
    """The default engine (deterministic) and a ``--no-deterministic`` one side by side, their steps
    timed alternately (this machine's noise moves both alike)."""
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engines = {}
    for name, deterministic in (("default", None), ("--no-deterministic", False)):
        engines[name] = LLMEngine(EngineConfig(threads=threads, kv_cache_gib=1.0, max_num_batched_tokens=4096,
                                               deterministic=deterministic))
        print(f"{name}: deterministic {engines[name].config.deterministic}; "
              f"projections: {engines[name].runner.linear_path}")
    times: dict[tuple[str, int], list[float]] = {}
    for n in rows:
        for name, engine in engines.items():
            g = torch.Generator().manual_seed(2)
            vocab = engine.model_config.vocab_size
            for i in range(n):
                engine.add_request(torch.randint(100, vocab - 100, (context,), generator=g).tolist(),
                                   SamplingParams(temperature=0, max_tokens=8 * repeats + 8, ignore_eos=True),
                                   request_id=f"{n}-{i}")
            while any(s.num_output_tokens == 0 for s in engine.seqs.values()):
                engine.step()  # the prompts' prefill
            engine.step()
        for _ in range(repeats):
            for name, engine in engines.items():
                times.setdefault((name, n), []).append(median_s(engine.step, 3, 2))
        for engine in engines.values():
            while engine.has_unfinished():
                engine.step()
    out, one = [], {}
    for name, engine in engines.items():
        for n in rows:
            s = statistics.median(times[(name, n)])
            step_read = step_bytes(engine, n, context)
            one.setdefault(name, s)
            out.append([name, n, s * 1e3, f"{s / one[name]:.2f}x", step_read / 1e6,
                        f"{step_read / s / 1e9 / bandwidth:.0%}", n / s])
    return out


def run(args: argparse.Namespace) -> int:
    import platform

    torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    bandwidth = read_bandwidth(args.repeats)
    fp32, bf16 = matmul_rate(torch.float32, args.repeats), matmul_rate(torch.bfloat16, args.repeats)
    dots = int8_dot_rate(args.repeats)
    ceiling = dots  # GFLOP/s: 2 flops a product, 2 dot products a product (the two activation levels)
    print(f"CPU: {cpu}, {args.threads} threads; {isa.describe()}")
    print(f"roofline: read {bandwidth:.1f} GB/s; oneDNN matmul {fp32:.0f} GFLOP/s float32, {bf16:.0f} bfloat16; "
          f"integer dot {dots:.0f} G int8 multiply-adds/s (the two-level GEMM's ceiling: {ceiling:.0f} GFLOP/s)\n")
    table, linears = bench_projections(args.rows, fp32, ceiling, args.repeats)
    print(format_table(["integer GEMM", "shape", "rows", "us", "GFLOP/s", "/ fp32 matmul", "of int ceiling"], table))
    print()
    print(format_table(["decode attention, a layer", "ms", "KV GB/s", "of read bw"],
                       bench_attention(args.attn_seqs, args.context, bandwidth, args.repeats)))
    print()
    steps = bench_steps(args.rows, args.context, args.threads, bandwidth, args.repeats)
    print(format_table(["decode step (default model)", "rows", "ms", "/ 1 row", "MB read", "of read bw", "tok/s"], steps))
    print()
    for n in (16, 64):
        if n in linears:
            ratio = linears[n] / fp32
            print(f"target: a step's linears at {n} rows >= {LINEARS_OVER_FP32}x the float32 matmul: {ratio:.2f}x "
                  f"{'met' if ratio >= LINEARS_OVER_FP32 else 'MISSED'}")
    one_row = [r for r in steps if r[0] == "default" and r[1] == 1]
    if one_row:
        share = float(one_row[0][5].rstrip("%")) / 100
        print(f"target: 1 row >= {BANDWIDTH_SHARE:.0%} of read bandwidth: {share:.0%} "
              f"{'met' if share >= BANDWIDTH_SHARE else 'MISSED'}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CPU (no CUDA)")
    isa.add_argument(g)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="decode rows (sequences) a step")
    g.add_argument("--context", type=int, default=300, help="tokens of each sequence's context")
    g.add_argument("--attn-seqs", type=int, default=64)
    g.add_argument("--repeats", type=int, default=5)
