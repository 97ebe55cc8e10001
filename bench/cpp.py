"""Chunked pipeline parallel prefill: TTFT with prefill groups of one stage and of two.

Run with ``python -m bench.cpp`` (``--help`` for the flags). Two clusters of the default model,
one after the other, each ``python -m server --prefill-instances 1 --decode-instances 1
--instance-threads 1 --no-pool --cpp-stages X`` for X = 1 and X = 2 (one thread per stage
process: X = 2 uses a second core, as a second node would). For each prompt length, a prompt of
random tokens (the same for both clusters, never cached before) is completed with ``max_tokens``
1, streamed; the figure is the time to its first token, the median of ``--rounds``.
``--chunk-tokens`` is the prefill step budget (``--max-num-batched-tokens``), so a prompt of n
tokens goes through the pipeline in ceil(n / chunk) chunks. The default model's context is
8,192 tokens, so the longest prompt is 8,191 (16k would need a longer-context model; not run).

Targets (issue 13): X = 2 at least 1.6x faster than X = 1 at 8k tokens, and no slower at 256.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from bench.disagg import free_port, start_server, stop_server, wait_for_health
from bench.pool import first_token_s, random_tokens
from bench.transfer import format_table

DEFAULT_LENGTHS = (256, 2048, 4096, 8191)
DEFAULT_OUT = Path("out") / "cpp"


def measure(stages: int, lengths: list[int], rounds: int, chunk: int, log_dir: Path) -> dict[int, float]:
    """Median TTFT (s) per prompt length on a cluster whose prefill group has ``stages`` stages."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), "--prefill-instances", "1",
           "--decode-instances", "1", "--instance-threads", "1", "--no-pool", "--cpp-stages", str(stages),
           "--max-num-batched-tokens", str(chunk)]
    server = start_server(f"X={stages}", cmd, base_url, log_dir / f"server-x{stages}.log")
    try:
        wait_for_health(server, 600)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        out = {}
        for n in lengths:
            # Another prompt each round and length, the same ones for every X: nothing cached.
            times = [first_token_s(base_url, model, random_tokens(n, seed=1000 * r + n)) for r in range(rounds)]
            out[n] = statistics.median(times)
            print(f"  X={stages}: {n} tokens: {out[n]:.2f} s", flush=True)
        return out
    finally:
        stop_server(server)


def report(results: dict[int, dict[int, float]], lengths: list[int]) -> str:
    rows = [[str(n), f"{results[1][n]:.2f}", f"{results[2][n]:.2f}", f"{results[1][n] / results[2][n]:.2f}x"]
            for n in lengths]
    lines = [format_table(["prompt tokens", "X=1 TTFT (s)", "X=2 TTFT (s)", "X=1 / X=2"], rows)]
    longest, shortest = max(lengths), min(lengths)
    at_long = results[1][longest] / results[2][longest]
    at_short = results[1][shortest] / results[2][shortest]
    lines.append(f"Target X=2 >= 1.6x faster at {longest} tokens: {'MET' if at_long >= 1.6 else 'MISSED'} "
                 f"({at_long:.2f}x)")
    lines.append(f"Target X=2 no slower than X=1 at {shortest} tokens: {'MET' if at_short >= 1.0 else 'MISSED'} "
                 f"({at_short:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help="prompt lengths in tokens, comma-separated (256,2048,4096,8191)")
    parser.add_argument("--rounds", type=int, default=1, help="prompts per length, median kept (1)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="the prefill step budget (512)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for the logs ({DEFAULT_OUT})")
    args = parser.parse_args(argv)
    lengths = sorted(int(n) for n in args.lengths.split(","))
    if args.rounds < 1 or args.chunk_tokens < 16 or min(lengths) < 2:
        parser.error("--rounds must be positive, --chunk-tokens at least 16, lengths at least 2")
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.out))
    print(f"{os.cpu_count()} CPUs; TTFT with prefill groups of 1 and 2 stages, chunks of {args.chunk_tokens} "
          f"tokens; logs in {log_dir}", flush=True)
    results = {x: measure(x, lengths, args.rounds, args.chunk_tokens, log_dir) for x in (1, 2)}
    print(report(results, lengths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
