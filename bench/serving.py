"""Online serving benchmark: an OpenAI-API load generator.

Run with ``python -m bench.serving --base-url http://127.0.0.1:8000`` (``--help`` for flags).

Every request is ``POST {base_url}/v1/completions`` with ``stream: true``,
``stream_options: {include_usage: true}``, ``temperature: 0``, ``ignore_eos: true`` and
``max_tokens`` = the wanted output length; the prompt is a list of token ids, so prompt
lengths are exact. ``model`` is ``--model`` or the first entry of ``GET /v1/models``.

Workload, one of:
  * random (default): ``--num-prompts`` requests, prompt / output lengths fixed or drawn
    uniformly from ``--input-len MIN MAX`` / ``--output-len MIN MAX``, token ids uniform in
    ``[100, --vocab-size)``; arrivals at ``--request-rate`` req/s (``inf``: all at once) with
    Poisson (``--burstiness 1``) or gamma (shape = burstiness, same mean rate) inter-arrival
    gaps; everything seeded by ``--seed``;
  * ``--trace PATH``: replay of a Mooncake trace, see :mod:`bench.trace` for how prompts are
    synthesized from ``hash_ids`` (equal ids -> equal token blocks) and for
    ``--length-scale`` / ``--time-scale`` / ``--max-requests``.

Per request we record the send time, the arrival time of every streamed chunk carrying a
choice, the end time, the output token count (``usage.completion_tokens`` from the final
usage chunk, else the number of such chunks) and success / HTTP status / error text.
HTTP 429 counts as *rejected* (not as failed).

Metrics (over completed requests; times in ms):
  * TTFT: first chunk arrival - send time;
  * E2E: end of stream - send time;
  * TPOT: (E2E - TTFT) / (output tokens - 1), requests with > 1 output token;
  * ITL: every gap between consecutive chunks (all requests pooled);
  * TBT (per request, as in the Mooncake paper): mean of the longest 10% (at least one) of
    the request's inter-token intervals; a request with no interval has TBT 0;
  * each reported as mean, p50, p90, p99; plain P90 ITL is the ITL p90;
  * throughputs: completed requests, output tokens, and prompt + output tokens per second of
    benchmark duration (first send to last end);
  * SLO attainment: fraction of ALL sent requests (rejected and failed ones count as misses)
    that completed with TTFT <= ``--slo-ttft-ms`` and TBT <= ``--slo-tbt-ms`` (each only if
    given); goodput = such requests / duration.

``--result-json`` writes the metrics (and per-request records); ``--plot`` writes TTFT and
TBT CDFs. The exit status is 1 if no request completed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

from bench.harness import DONE, sse_data
from cluster.policies.early_rejection import request_tbt
from bench.trace import MIN_TOKEN_ID, BenchRequest, load_trace, synthesize_requests


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # requested
    send_time: float = 0.0
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end_time: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them (usage)
    cached_tokens: int = 0  # prompt tokens the server found cached (usage.prompt_tokens_details)
    text: str = ""  # what was generated
    success: bool = False
    rejected: bool = False
    status: int | None = None
    error: str = ""

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


# --------------------------------------------------------------------------- workload


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets (s) of ``n`` arrivals, first at 0: Poisson (burstiness 1) or gamma gaps."""
    if n <= 0:
        return []
    if math.isinf(rate) or rate <= 0:
        if rate <= 0:
            raise ValueError("request rate must be positive (or inf)")
        return [0.0] * n
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    rng = np.random.default_rng([seed, 7])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def _length_range(v: list[int]) -> tuple[int, int]:
    lo, hi = (v[0], v[0]) if len(v) == 1 else (v[0], v[1])
    if lo < 1 or hi < lo:
        raise ValueError(f"bad length range {v}")
    return lo, hi


def random_requests(
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    *,
    vocab_size: int = 32000,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Seeded random-token requests with exact lengths and arrival offsets."""
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID}")
    rng = np.random.default_rng([seed, 3])
    arrivals = arrival_times(num, rate, burstiness, seed)
    reqs = []
    for i in range(num):
        il = int(rng.integers(input_len[0], input_len[1] + 1))
        ol = int(rng.integers(output_len[0], output_len[1] + 1))
        prompt = rng.integers(MIN_TOKEN_ID, vocab_size, size=il).tolist()
        reqs.append(BenchRequest(prompt=prompt, output_len=ol, arrival_s=arrivals[i]))
    return reqs


# --------------------------------------------------------------------------- client


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    r = await client.get(f"{base_url}/v1/models", headers=_headers(api_key))
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models returned no models")
    return data[0]["id"]


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    req: BenchRequest,
    api_key: str | None = None,
    extra: dict[str, Any] | None = None,
) -> RequestResult:
    """Send one streaming completion request and time it; ``extra``: more body fields (a
    session hint, say)."""
    res = RequestResult(prompt_len=len(req.prompt), output_len=req.output_len)
    payload = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    usage_tokens: int | None = None
    res.send_time = time.perf_counter()
    try:
        async with client.stream(
            "POST", f"{base_url}/v1/completions", json=payload, headers=_headers(api_key)
        ) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                res.rejected = resp.status_code == 429
                res.error = f"HTTP {resp.status_code}: {body[:500]}"
                res.end_time = time.perf_counter()
                return res
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if (data := sse_data(line)) is None:
                    continue
                if data == DONE:
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:500]
                    break
                if chunk.get("choices"):
                    if res.first_token_time is None:
                        res.first_token_time = now
                    res.chunk_times.append(now)
                    res.text += chunk["choices"][0].get("text") or ""
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        res.end_time = time.perf_counter()
        res.output_tokens = usage_tokens if usage_tokens is not None else len(res.chunk_times)
        if not res.error:
            if res.first_token_time is None:
                res.error = "stream ended without any token"
            else:
                res.success = True
    except Exception as exc:  # network errors, bad JSON, timeouts: a failed request
        res.end_time = time.perf_counter()
        res.error = f"{type(exc).__name__}: {exc}"[:500]
    return res


async def run_benchmark(
    base_url: str,
    requests: list[BenchRequest],
    *,
    model: str | None = None,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    timeout_s: float | None = 3600.0,
    progress: bool = True,
) -> tuple[list[RequestResult], float, str]:
    """Send ``requests`` at their arrival offsets; returns (results, duration_s, model)."""
    base_url = base_url.rstrip("/")
    n = max(1, len(requests))
    limits = httpx.Limits(max_connections=max(n, 100), max_keepalive_connections=max(n, 100))
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), disable=not progress, unit="req")
    except ImportError:  # pragma: no cover
        bar = None

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        if model is None:
            model = await fetch_model(client, base_url, api_key)

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                r = await send_request(client, base_url, model, req, api_key)
            else:
                async with sem:
                    r = await send_request(client, base_url, model, req, api_key)
            if bar is not None:
                bar.update(1)
            return r

        start = time.perf_counter()
        tasks = []
        for req in sorted(requests, key=lambda r: r.arrival_s):
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
    if bar is not None:
        bar.close()
    if results:
        t_first = min(r.send_time for r in results)
        t_last = max(r.end_time for r in results)
        duration = max(t_last - t_first, 1e-9)
    else:
        duration = 0.0
    return results, duration, model


# --------------------------------------------------------------------------- metrics


def tbt(result: RequestResult) -> float:
    """Mooncake-paper TBT (s): mean of the longest 10% (at least one) inter-token intervals."""
    return request_tbt(result.itls)


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * 1000.0
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    *,
    slo_ttft_ms: float | None = None,
    slo_tbt_ms: float | None = None,
) -> dict:
    ok = [r for r in results if r.success]
    rejected = sum(r.rejected for r in results)
    failed = len(results) - len(ok) - rejected
    dur = duration_s if duration_s > 0 else float("nan")
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttfts = [r.ttft for r in ok]
    e2es = [r.e2e for r in ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [g for r in ok for g in r.itls]
    tbts = [tbt(r) for r in ok]

    def meets(r: RequestResult) -> bool:
        if slo_ttft_ms is not None and r.ttft * 1000.0 > slo_ttft_ms:
            return False
        if slo_tbt_ms is not None and tbt(r) * 1000.0 > slo_tbt_ms:
            return False
        return True

    good = sum(1 for r in ok if meets(r))
    m = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": failed,
        "rejected": rejected,
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "ttft_ms": _stats_ms(ttfts),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms(itls),
        "e2e_ms": _stats_ms(e2es),
        "tbt_ms": _stats_ms(tbts),
        "p90_itl_ms": _stats_ms(itls)["p90"],
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tbt_ms": slo_tbt_ms,
        "slo_attainment": good / len(results) if results else None,
        "goodput": good / dur,
    }
    errors = [r.error for r in results if r.error]
    m["errors_sample"] = errors[:5]
    return m


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def format_report(m: dict) -> str:
    w = 42
    lines = ["=" * (w + 14), f"{'Serving Benchmark Result':^{w + 14}}", "=" * (w + 14)]
    rows = [
        ("Requests sent", m["num_requests"]),
        ("Completed", m["completed"]),
        ("Failed", m["failed"]),
        ("Rejected (429)", m["rejected"]),
        ("Duration (s)", m["duration_s"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total output tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
        ("Output token throughput (tok/s)", m["output_throughput"]),
        ("Total token throughput (tok/s)", m["total_token_throughput"]),
    ]
    lines += [f"{k:<{w}}{_fmt(v):>14}" for k, v in rows]
    for key, title in [
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E latency"),
        ("tbt_ms", "TBT (mean of longest 10% ITLs)"),
    ]:
        lines.append(f"{'-' * 8} {title} {'-' * max(0, w + 4 - len(title))}")
        for s in ("mean", "p50", "p90", "p99"):
            lines.append(f"{s.upper() + ' ' + title.split(' (')[0] + ' (ms)':<{w}}{_fmt(m[key][s]):>14}")
    lines.append(f"{'-' * 8} SLO {'-' * (w + 1)}")
    lines.append(f"{'P90 ITL (ms)':<{w}}{_fmt(m['p90_itl_ms']):>14}")
    lines.append(f"{'SLO TTFT (ms)':<{w}}{_fmt(m['slo_ttft_ms']):>14}")
    lines.append(f"{'SLO TBT (ms)':<{w}}{_fmt(m['slo_tbt_ms']):>14}")
    att = m["slo_attainment"]
    lines.append(f"{'SLO attainment (%)':<{w}}{_fmt(None if att is None else 100 * att):>14}")
    lines.append(f"{'Goodput (req/s)':<{w}}{_fmt(m['goodput']):>14}")
    lines.append("=" * (w + 14))
    for e in m.get("errors_sample", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def plot_cdfs(results: list[RequestResult], path: str, m: dict | None = None) -> None:
    """Write TTFT and TBT CDFs (completed requests) to ``path``."""
    try:
        import matplotlib
    except ImportError as exc:  # an optional package: the server never plots
        raise ImportError("--plot needs matplotlib: pip install -e '.[bench]'", name=exc.name) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, vals, name, slo in [
        (axes[0], [r.ttft * 1000 for r in ok], "TTFT (ms)", m and m.get("slo_ttft_ms")),
        (axes[1], [tbt(r) * 1000 for r in ok], "TBT (ms)", m and m.get("slo_tbt_ms")),
    ]:
        if vals:
            x = np.sort(np.asarray(vals))
            y = np.arange(1, len(x) + 1) / len(x)
            ax.step(x, y, where="post")
        if slo:
            ax.axvline(slo, color="red", linestyle="--", label=f"SLO {slo:g} ms")
            ax.legend()
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def result_records(results: list[RequestResult]) -> list[dict]:
    """Per-request records for JSON: times relative to each request's send time."""
    recs = []
    for r in results:
        d = asdict(r)
        t0 = r.send_time
        d["chunk_times"] = [t - t0 for t in r.chunk_times]
        d["first_token_time"] = None if r.first_token_time is None else r.first_token_time - t0
        d["end_time"] = r.end_time - t0
        recs.append(d)
    return recs


def write_json(path: str, m: dict, results: list[RequestResult], args: dict | None = None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"args": args or {}, "metrics": m, "requests": result_records(results)}, f, indent=1)


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving", description="OpenAI-API streaming load generator"
    )
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: first entry of GET /v1/models")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, nargs="+", default=[128], metavar="N",
                   help="prompt length, fixed or MIN MAX")
    p.add_argument("--output-len", type=int, nargs="+", default=[64], metavar="N",
                   help="output length, fixed or MIN MAX")
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids drawn from [100, V)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None, help="replay a Mooncake JSONL trace")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="trace: scale input/output lengths and the 512-token block size")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="trace: multiply inter-arrival gaps")
    p.add_argument("--max-requests", type=int, default=None, help="trace: first N lines only")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tbt-ms", type=float, default=None)
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout (s)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, help="PNG path for TTFT / TBT CDFs")
    p.add_argument("--no-progress", action="store_true")
    return p


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.trace:
        entries = load_trace(args.trace, args.max_requests)
        return synthesize_requests(
            entries,
            length_scale=args.length_scale,
            time_scale=args.time_scale,
            vocab_size=args.vocab_size,
            seed=args.seed,
        )
    return random_requests(
        args.num_prompts,
        _length_range(args.input_len),
        _length_range(args.output_len),
        vocab_size=args.vocab_size,
        rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    requests = build_requests(args)
    if not requests:
        print("no requests to send", file=sys.stderr)
        return 1
    results, duration, model = asyncio.run(
        run_benchmark(
            args.base_url,
            requests,
            model=args.model,
            api_key=args.api_key,
            max_concurrency=args.max_concurrency,
            timeout_s=args.timeout,
            progress=not args.no_progress,
        )
    )
    m = compute_metrics(results, duration, slo_ttft_ms=args.slo_ttft_ms, slo_tbt_ms=args.slo_tbt_ms)
    m["model"] = model
    print(format_report(m))
    if args.result_json:
        a = {k: v for k, v in vars(args).items() if k != "api_key"}
        write_json(args.result_json, m, results, a)
    if args.plot:
        plot_cdfs(results, args.plot, m)
    return 0 if m["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
