"""Chunked pipeline parallel prefill: TTFT with prefill groups of one stage and of two.

Run with ``python -m bench.cpp`` (``--help`` for the flags). Two clusters of the default model,
one after the other, each ``python -m server --prefill-instances 1 --decode-instances 1
--instance-threads 1 --no-pool --cpp-stages X`` for X = 1 and X = 2 (one thread per stage
process: X = 2 uses a second core, as a second node would). For each prompt length, a prompt of
random tokens (the same for both clusters, never cached before) is completed with ``max_tokens``
1, streamed; the figure is the time to its first token, the median of ``--rounds``.
``--chunk-tokens`` is the prefill step budget (``--max-num-batched-tokens``), so a prompt of n
tokens goes through the pipeline in ceil(n / chunk) chunks.

The default model's context is 8,192 tokens. For longer prompts (16,383 by default) both
clusters run a *stretched* copy of it: the same weights, with a context of 16,384 positions by
linear RoPE interpolation (``rope_scaling`` linear, factor 2). Its text would be worse; its
compute per token, which is all TTFT measures, is the model's own. Every length of such a run
uses the stretched copy, so the two clusters are compared on one model.

Targets (issue 13): X = 2 at least 1.6x faster than X = 1 at 8k tokens, and no slower at 256.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import httpx

from bench.harness import launch_server
from bench.pool import first_token_s, random_tokens
from bench.transfer import format_table
from engine.default_model import resolve_model

DEFAULT_LENGTHS = (256, 2048, 4096, 8191, 16383)
DEFAULT_OUT = Path("out") / "cpp"


def stretched_model(model: Path, factor: int, into: Path) -> Path:
    """A copy of ``model`` (links to its files) whose context is ``factor`` times longer by
    linear RoPE interpolation."""
    config = json.loads((model / "config.json").read_text())
    if config.get("rope_scaling"):
        raise ValueError(f"{model} already scales its RoPE; not stretching it again")
    config["max_position_embeddings"] = int(config["max_position_embeddings"]) * factor
    config["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    into.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def measure(stages: int, lengths: list[int], rounds: int, chunk: int, log_dir: Path,
            model: Path | None = None) -> dict[int, float]:
    """Median TTFT (s) per prompt length on a cluster whose prefill group has ``stages`` stages."""
    flags = ["--prefill-instances", "1", "--decode-instances", "1", "--instance-threads", "1", "--no-pool",
             "--cpp-stages", str(stages), "--max-num-batched-tokens", str(chunk)]
    flags += [] if model is None else ["--model", str(model)]
    server = launch_server(flags, log_dir / f"server-x{stages}.log", name=f"X={stages}")
    base_url = server.base_url
    try:
        server.wait_healthy(600)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        first_token_s(base_url, model, random_tokens(64, seed=1))  # warm-up: not timed
        out = {}
        for n in lengths:
            # Another prompt each round and length, the same ones for every X: nothing cached.
            times = [first_token_s(base_url, model, random_tokens(n, seed=1000 * r + n)) for r in range(rounds)]
            out[n] = statistics.median(times)
            print(f"  X={stages}: {n} tokens: {out[n]:.2f} s", flush=True)
        return out
    finally:
        server.stop()


def report(results: dict[int, dict[int, float]], lengths: list[int]) -> str:
    rows = [[str(n), f"{results[1][n]:.2f}", f"{results[2][n]:.2f}", f"{results[1][n] / results[2][n]:.2f}x"]
            for n in lengths]
    lines = [format_table(["prompt tokens", "X=1 TTFT (s)", "X=2 TTFT (s)", "X=1 / X=2"], rows)]
    shortest = min(lengths)
    at_short = results[1][shortest] / results[2][shortest]
    for n in (n for n in lengths if 8000 <= n <= 8192):  # the target is at 8k tokens
        at_8k = results[1][n] / results[2][n]
        lines.append(f"Target X=2 >= 1.6x faster at {n} tokens: {'MET' if at_8k >= 1.6 else 'MISSED'} ({at_8k:.2f}x)")
    lines.append(f"Target X=2 no slower than X=1 at {shortest} tokens: {'MET' if at_short >= 1.0 else 'MISSED'} "
                 f"({at_short:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help="prompt lengths in tokens, comma-separated (256,2048,4096,8191,16383)")
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
    model = resolve_model(None)
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    stretched = None
    if max(lengths) >= context:
        factor = -(-(max(lengths) + 1) // context)
        stretched = stretched_model(model, factor, log_dir / "model")
        print(f"prompts of up to {max(lengths)} tokens exceed the default model's {context}: every length runs on "
              f"its copy stretched {factor}x by linear RoPE interpolation ({stretched})", flush=True)
    results = {x: measure(x, lengths, args.rounds, args.chunk_tokens, log_dir, stretched) for x in (1, 2)}
    print(report(results, lengths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
