"""What a busy CPU engine's memory costs and what bounding it costs: ``python -m bench.memory``.

The engine keeps freed step memory in its heap for the next steps (``configure_cpu_runtime``)
and, while busy, trims the heap at most once a second when its private memory grew more than
``EngineConfig.busy_heap_free_mib`` since the last trim (``engine.cpu_runtime.HeapBound``, issue 40). This bench runs one large batch (``--prompts``
short prompts at once, ``--max-tokens`` sampled tokens each, so the decode steps reach that many
rows) with the bound at ``--budget-mib`` and with it off, each in a process of its own, in turns
(``--rounds`` pairs). Per run: the wall time of the batch, the private memory (``RssAnon``) at its
peak and after it, above the loaded engine's; the table gives each side's median and the time
ratio pair by pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time


def _anon_mib() -> int:
    from engine.cpu_runtime import rss_anon_bytes

    anon = rss_anon_bytes()
    if anon is None:
        raise RuntimeError("bench.memory reads RssAnon from /proc/self/status (Linux)")
    return anon >> 20


def child(budget: float | None, prompts: int, max_tokens: int, dtype: str, threads: int,
          model: str | None = None) -> dict:
    """One run in this process: the batch's wall time and memory above the loaded engine's."""
    from engine import LLM, SamplingParams
    from engine.cpu_runtime import return_freed_memory

    kwargs = {} if dtype == "default" else {"dtype": dtype}
    llm = LLM(model, threads=threads, busy_heap_free_mib=budget, **kwargs)
    llm.generate(["warm up"], SamplingParams(max_tokens=4))
    return_freed_memory()
    rest = _anon_mib()
    peak, sampling = [rest], [True]

    def sample() -> None:
        while sampling[0]:
            peak[0] = max(peak[0], _anon_mib())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    batch = [f"Request {i}: tell me about the sea." for i in range(prompts)]
    t0 = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True))
    wall = time.perf_counter() - t0
    sampling[0] = False
    sampler.join()
    return {"wall_s": wall, "peak_mib": peak[0] - rest, "after_mib": _anon_mib() - rest,
            "trims": llm.engine.heap.trims if llm.engine.heap is not None else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=256, help="prompts at once: the decode steps' rows (256)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget-mib", type=float, default=64.0, help="the bound measured against none (64, the default)")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, or default (the engine's choice)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rounds", type=int, default=3, help="pairs of runs, bound then none (3)")
    ap.add_argument("--json", metavar="PATH", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a run: the budget in MiB, or "off"
    args = ap.parse_args(argv)
    if args.child is not None:
        budget = None if args.child == "off" else float(args.child)
        print(json.dumps(child(budget, args.prompts, args.max_tokens, args.dtype, args.threads, args.model)))
        return 0

    sides = {"bound": f"{args.budget_mib:g}", "off": "off"}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, value in sides.items():
            cmd = [sys.executable, "-m", "bench.memory", "--child", value, "--prompts", str(args.prompts),
                   "--max-tokens", str(args.max_tokens), "--dtype", args.dtype, "--threads", str(args.threads),
                   *(["--model", args.model] if args.model else [])]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {side}: {runs[side][-1]}", flush=True)
    ratios = [b["wall_s"] / o["wall_s"] for b, o in zip(runs["bound"], runs["off"])]
    med = {side: {k: statistics.median(run[k] for run in rs) for k in ("wall_s", "peak_mib", "after_mib", "trims")}
           for side, rs in runs.items()}
    print(f"\n{args.prompts} prompts at once, {args.max_tokens} tokens each, {args.dtype}, {args.threads} thread(s); "
          f"medians of {args.rounds} runs each")
    print(f"{'heap bound':<16} {'batch s':>8} {'peak MiB':>9} {'after MiB':>10} {'trims':>6}")
    for side, label in (("off", "off (until idle)"), ("bound", f"{args.budget_mib:g} MiB")):
        m = med[side]
        print(f"{label:<16} {m['wall_s']:8.2f} {m['peak_mib']:+9.0f} {m['after_mib']:+10.0f} {m['trims']:6.0f}")
    print(f"time, bound / off, pair by pair: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "medians": med, "time_ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
