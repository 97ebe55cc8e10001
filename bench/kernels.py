"""Kernel micro-benchmarks: achieved memory bandwidth against the device's copy bandwidth.

Run with ``python -m bench.kernels`` (``--help`` for the flags). With CUDA it measures the Triton
kernels as below; without, the native CPU kernels against the machine's roofline
(:mod:`bench.cpu_kernels`).

Method:
  * every figure is ``bytes that must move / time``: the bytes each op has to read and write at
    least once (helpers ``*_bytes`` below), over the median of ``--iters`` runs timed with CUDA
    events, after ``--warmup`` untimed runs;
  * the reference is the copy bandwidth measured in the same run: a large ``dst.copy_(src)``
    (read + write counted, as for the kernels);
  * decode attention (``kernels.decode_attention.decode_attention_triton``) is also timed
    against torch SDPA on the same KV: once
    on KV already gathered into contiguous ``[B, Hkv, L, D]`` tensors (SDPA alone: the best a
    non-paged kernel does) and once including that gather (``kernels.paged.gather_context``),
    which is what paged attention through SDPA costs;
  * sizes: batch 1/16/64/256 x context 512/2k/8k/32k, 32 query heads, 4 KV heads (GQA 8),
    head_dim 128, block_size 16, bf16; every sequence full-length, pages shuffled. A combination
    whose paged KV plus its gathered copy would not fit in 60% of free memory is skipped;
  * KV gather/scatter: 32 layers x 8 KV heads x block_size 16 x head_dim 128 (a Llama-8B-like
    cache), 256..4096 random blocks (and one layer of 4096), into/out of one contiguous buffer.

Targets (printed with each table): decode >= 80% of copy bandwidth at 8k context and >= 2x
gather+SDPA; gather/scatter >= 80% of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F

from bench import cpu_kernels, isa

from mooncake_kernels.activation import silu_and_mul_triton
from mooncake_kernels.decode_attention import decode_attention_triton
from mooncake_kernels.kv_transfer import gather_kv_torch, gather_kv_triton, scatter_kv_triton
from mooncake_kernels.norms import rms_norm_triton
from mooncake_kernels.paged import gather_context
from mooncake_kernels.rope import rotary_embedding_triton
from mooncake_kernels.store_kv import store_kv_triton

BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
TRANSFER_LAYERS, TRANSFER_KV_HEADS = 32, 8
TRANSFER_BLOCKS = (256, 1024, 4096)
MEM_FRACTION = 0.6
DECODE_TARGET_COPY, DECODE_TARGET_SDPA, TRANSFER_TARGET_COPY = 0.80, 2.0, 0.80
DECODE_TARGET_CONTEXT = 8192


# --------------------------------------------------------------------------------------------
# Bytes each op must move (pure helpers, tested without CUDA)
# --------------------------------------------------------------------------------------------


def copy_bytes(nbytes: int) -> int:
    """A copy reads and writes every byte."""
    return 2 * nbytes


def decode_kv_bytes(batch: int, context: int, num_kv_heads: int, head_dim: int, elem: int) -> int:
    """Paged K and V of every sequence (the dominant term of decode attention)."""
    return 2 * batch * context * num_kv_heads * head_dim * elem


def decode_bytes(batch: int, context: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 elem: int, block_size: int = BLOCK_SIZE) -> int:
    """K/V read once, q read, out written, the block tables (int32) and seq_lens (int32) read."""
    qo = 2 * batch * num_q_heads * head_dim * elem
    tables = batch * math.ceil(context / block_size) * 4 + batch * 4
    return decode_kv_bytes(batch, context, num_kv_heads, head_dim, elem) + qo + tables


def store_kv_bytes(tokens: int, num_kv_heads: int, head_dim: int, elem: int) -> int:
    """k and v read, the same written into the cache, one int64 slot per token read."""
    return 4 * tokens * num_kv_heads * head_dim * elem + 8 * tokens


def rms_norm_bytes(rows: int, n: int, elem: int, residual: bool = False, weight_elem: int | None = None) -> int:
    """x read, out written (plus residual read and new residual written), weight read once."""
    per_row = (4 if residual else 2) * n * elem
    return rows * per_row + n * (weight_elem or elem)


def rope_bytes(tokens: int, num_heads: int, head_dim: int, elem: int, cache_elem: int = 4) -> int:
    """x read, out written, one cos/sin row per token read."""
    return 2 * tokens * num_heads * head_dim * elem + tokens * head_dim * cache_elem


def silu_and_mul_bytes(rows: int, n: int, elem: int) -> int:
    """[gate | up] (2n) read, n written per row."""
    return 3 * rows * n * elem


def kv_transfer_bytes(n_layers: int, n_blocks: int, num_kv_heads: int, block_size: int,
                      head_dim: int, elem: int) -> int:
    """Every K and V page of the selection read once and written once."""
    return copy_bytes(n_layers * 2 * n_blocks * num_kv_heads * block_size * head_dim * elem)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def fits(need_bytes: int, free_bytes: int, fraction: float = MEM_FRACTION) -> bool:
    return need_bytes <= fraction * free_bytes


def format_table(headers: list[str], rows: list[list]) -> str:
    """Plain-text table, right-aligned columns; floats with 2 decimals (or 3 under 1)."""

    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"
        return str(v)

    body = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CUDA measurements
# --------------------------------------------------------------------------------------------


_L2_FLUSH: torch.Tensor | None = None


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs, each between its own CUDA events.

    Before each run a 256 MiB buffer is zeroed: that evicts L2 (so every kernel reads from
    HBM) and keeps the GPU busy while the host enqueues ``fn``, so small kernels are timed
    without the Python launch latency (a launcher that syncs still pays it)."""
    global _L2_FLUSH
    if _L2_FLUSH is None:
        _L2_FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _L2_FLUSH.zero_()
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def measure_copy(args) -> float:
    n = 1 << 30  # 1 GiB, far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), args.warmup, args.iters)
    del src, dst
    torch.cuda.empty_cache()
    return gbps(copy_bytes(n), ms)


def bench_elementwise(args, copy_bw: float) -> list[dict]:
    dt, e = torch.bfloat16, 2
    dev = "cuda"
    hidden, inter = 4096, 14336
    results = []
    for t in (256, 8192):
        cases = []
        x = torch.randn(t, hidden, dtype=dt, device=dev)
        r = torch.randn_like(x)
        w = torch.randn(hidden, dtype=dt, device=dev)
        cases.append(("rms_norm", f"{t}x{hidden}", lambda: rms_norm_triton(x, w, 1e-6), rms_norm_bytes(t, hidden, e)))
        cases.append(("rms_norm+residual", f"{t}x{hidden}", lambda: rms_norm_triton(x, w, 1e-6, r),
                      rms_norm_bytes(t, hidden, e, residual=True)))
        qk = torch.randn(t, NUM_Q_HEADS, HEAD_DIM, dtype=dt, device=dev)
        wq = torch.randn(HEAD_DIM, dtype=dt, device=dev)
        cases.append(("rms_norm per-head", f"{t}x{NUM_Q_HEADS}x{HEAD_DIM}", lambda: rms_norm_triton(qk, wq, 1e-6),
                      rms_norm_bytes(t * NUM_Q_HEADS, HEAD_DIM, e)))
        cos_sin = torch.randn(t, HEAD_DIM, dtype=torch.float32, device=dev)  # the step's rows
        cases.append(("rotary_embedding", f"{t}x{NUM_Q_HEADS}x{HEAD_DIM}",
                      lambda: rotary_embedding_triton(qk, cos_sin), rope_bytes(t, NUM_Q_HEADS, HEAD_DIM, e)))
        gu = torch.randn(t, 2 * inter, dtype=dt, device=dev)
        cases.append(("silu_and_mul", f"{t}x2x{inter}", lambda: silu_and_mul_triton(gu), silu_and_mul_bytes(t, inter, e)))
        nb = 2 * t // BLOCK_SIZE + 1
        kc = torch.zeros(nb, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=dt, device=dev)
        vc = torch.zeros_like(kc)
        k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, dtype=dt, device=dev)
        v = torch.randn_like(k)
        slots = torch.randperm(nb * BLOCK_SIZE, device=dev)[:t]
        cases.append(("store_kv", f"{t}x{NUM_KV_HEADS}x{HEAD_DIM}", lambda: store_kv_triton(k, v, kc, vc, slots),
                      store_kv_bytes(t, NUM_KV_HEADS, HEAD_DIM, e)))
        for name, size, fn, nbytes in cases:
            ms = time_ms(fn, args.warmup, args.iters)
            bw = gbps(nbytes, ms)
            results.append({"kernel": name, "size": size, "us": ms * 1e3, "GB/s": bw, "of_copy": bw / copy_bw})
        del x, r, qk, gu, kc, vc, k, v
        torch.cuda.empty_cache()
    return results


def bench_decode(args, copy_bw: float) -> list[dict]:
    dt, e, dev = torch.bfloat16, 2, "cuda"
    scale = 1.0 / math.sqrt(HEAD_DIM)
    results = []
    for batch in args.batches:
        for ctx in args.contexts:
            kv = decode_kv_bytes(batch, ctx, NUM_KV_HEADS, HEAD_DIM, e)
            free, _ = torch.cuda.mem_get_info()
            if not fits(2 * kv, free):  # the paged cache plus SDPA's gathered copy
                print(f"decode: batch {batch} x context {ctx} skipped ({2 * kv / 2**30:.1f} GiB would not fit)")
                continue
            nbpseq = math.ceil(ctx / BLOCK_SIZE)
            nb = batch * nbpseq
            k_cache = torch.randn(nb, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=dt, device=dev)
            v_cache = torch.randn_like(k_cache)
            tables = torch.randperm(nb, device=dev).to(torch.int32).view(batch, nbpseq)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=dt, device=dev)

            ms = time_ms(lambda: decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale),
                         args.warmup, args.iters)
            q4 = q.unsqueeze(2)  # [B, Hq, 1, D]

            def sdpa(k, v):
                return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

            def gather_sdpa():
                return sdpa(gather_context(k_cache, tables, ctx), gather_context(v_cache, tables, ctx))

            ms_gs = time_ms(gather_sdpa, args.warmup, args.iters)
            kg, vg = gather_context(k_cache, tables, ctx), gather_context(v_cache, tables, ctx)
            ms_s = time_ms(lambda: sdpa(kg, vg), args.warmup, args.iters)
            bw = gbps(decode_bytes(batch, ctx, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, e), ms)
            results.append({
                "batch": batch, "context": ctx, "us": ms * 1e3, "GB/s": bw, "of_copy": bw / copy_bw,
                "sdpa_us": ms_s * 1e3, "gather_sdpa_us": ms_gs * 1e3,
                "x_sdpa": ms_s / ms, "x_gather_sdpa": ms_gs / ms,
            })
            del k_cache, v_cache, kg, vg, tables, q, q4
            torch.cuda.empty_cache()
    return results


def bench_transfer(args, copy_bw: float) -> list[dict]:
    dt, e, dev = torch.bfloat16, 2, "cuda"
    max_blocks = max(args.transfer_blocks)
    num_blocks = 2 * max_blocks
    shape = (TRANSFER_LAYERS, 2, num_blocks, TRANSFER_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    need = 2 * math.prod(shape) * e  # source and destination caches (buffer is smaller)
    free, _ = torch.cuda.mem_get_info()
    if not fits(need + need // 2, free):
        print(f"kv transfer: skipped ({need / 2**30:.1f} GiB of caches would not fit)")
        return []
    src = torch.randn(shape, dtype=dt, device=dev)
    dst = torch.zeros_like(src)
    results = []
    cases = [(n, None) for n in args.transfer_blocks] + [(max_blocks, range(0, 1))]
    for n, layers in cases:
        src_ids = torch.randperm(num_blocks, device=dev)[:n]
        dst_ids = torch.randperm(num_blocks, device=dev)[:n]
        n_layers = TRANSFER_LAYERS if layers is None else len(layers)
        buf = torch.empty(n_layers, 2, n, TRANSFER_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=dt, device=dev)
        nbytes = kv_transfer_bytes(n_layers, n, TRANSFER_KV_HEADS, BLOCK_SIZE, HEAD_DIM, e)
        # check_ids=False: the kernel alone; the default host check adds one device sync.
        ms_g = time_ms(lambda: gather_kv_triton(src, src_ids, layers, out=buf, check_ids=False),
                       args.warmup, args.iters)
        ms_s = time_ms(lambda: scatter_kv_triton(buf, dst, dst_ids, layers, check_ids=False),
                       args.warmup, args.iters)
        ms_t = time_ms(lambda: gather_kv_torch(src, src_ids, layers, out=buf), args.warmup, args.iters)
        label = "all" if layers is None else f"{layers.start}..{layers.stop - 1}"
        for op, ms in (("gather", ms_g), ("scatter", ms_s), ("gather (torch twin)", ms_t)):
            bw = gbps(nbytes, ms)
            results.append({"op": op, "layers": label, "blocks": n, "MiB": nbytes / 2 / 2**20,
                            "us": ms * 1e3, "GB/s": bw, "of_copy": bw / copy_bw})
        del buf
    del src, dst
    torch.cuda.empty_cache()
    return results


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISS"


def report(copy_bw: float, elementwise, decode, transfer) -> str:
    out = [f"copy bandwidth (1 GiB dst.copy_(src), read+write): {copy_bw:.1f} GB/s", ""]
    out.append("elementwise kernels (bf16)")
    out.append(format_table(["kernel", "size", "us", "GB/s", "of copy"],
                            [[r["kernel"], r["size"], r["us"], r["GB/s"], r["of_copy"]] for r in elementwise]))
    out.append("")
    if decode:
        out.append(f"decode attention (bf16, Hq {NUM_Q_HEADS}, Hkv {NUM_KV_HEADS}, D {HEAD_DIM}, block {BLOCK_SIZE}); "
                   f"targets at {DECODE_TARGET_CONTEXT} context: >= {DECODE_TARGET_COPY:.0%} of copy, "
                   f">= {DECODE_TARGET_SDPA:.0f}x gather+SDPA")
        rows = []
        for r in decode:
            mark = ""
            if r["context"] == DECODE_TARGET_CONTEXT:
                mark = _mark(r["of_copy"] >= DECODE_TARGET_COPY) + "/" + _mark(r["x_gather_sdpa"] >= DECODE_TARGET_SDPA)
            rows.append([r["batch"], r["context"], r["us"], r["GB/s"], r["of_copy"], r["sdpa_us"],
                         r["x_sdpa"], r["gather_sdpa_us"], r["x_gather_sdpa"], mark])
        out.append(format_table(["batch", "context", "us", "GB/s", "of copy", "sdpa us", "x sdpa",
                                 "gather+sdpa us", "x gather+sdpa", "target"], rows))
        out.append("")
    if transfer:
        out.append(f"KV gather/scatter ({TRANSFER_LAYERS} layers, Hkv {TRANSFER_KV_HEADS}, D {HEAD_DIM}, block "
                   f"{BLOCK_SIZE}, bf16, random ids); target >= {TRANSFER_TARGET_COPY:.0%} of copy for the Triton "
                   "kernels (timed with check_ids=False: no host-side id check)")
        rows = [[r["op"], r["layers"], r["blocks"], r["MiB"], r["us"], r["GB/s"], r["of_copy"],
                 "" if "twin" in r["op"] else _mark(r["of_copy"] >= TRANSFER_TARGET_COPY)] for r in transfer]
        out.append(format_table(["op", "layers", "blocks", "MiB", "us", "GB/s", "of copy", "target"], rows))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--transfer-blocks", type=int, nargs="+", default=list(TRANSFER_BLOCKS))
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    cpu_kernels.add_arguments(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        # No GPU: the native CPU kernels against this machine's roofline (bench/cpu_kernels.py).
        isa.apply(args)
        return cpu_kernels.run(args)
    torch.manual_seed(0)
    copy_bw = measure_copy(args)
    elementwise = bench_elementwise(args, copy_bw)
    decode = bench_decode(args, copy_bw)
    transfer = bench_transfer(args, copy_bw)
    print(f"device: {torch.cuda.get_device_name()}")
    print(report(copy_bw, elementwise, decode, transfer))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GB/s": copy_bw, "elementwise": elementwise,
                       "decode": decode, "transfer": transfer}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
