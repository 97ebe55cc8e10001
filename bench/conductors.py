"""bench.conductors: one overload, split over 1, 2 and 4 Conductors (issue 41).

One prefill and one decode instance announce themselves in an etcd of the bench's own; for each
count N, N Conductors (``--conductor-id c1..cN``) find them there and the same seeded stream of
``--prompt-len``-token prompts, offered at ``--load`` times what the prefill instance can take
(1 / the unloaded TTFT, measured first through one Conductor), is dealt round-robin over them for
``--duration-s``. Each Conductor books its own requests and adds what the instances report of
the others' (``InstanceState.work``), so N Conductors should admit, refuse and serve as one does:
the table gives each N's admitted, refused, TTFT, SLO attainment and goodput, and its ratio to
N = 1 from the same run, over ``--repeats`` runs (seeds ``--seed``.., pooled). SLOs are the
arXiv paper's, 10x the unloaded TTFT and 5x the unloaded TBT (measured through a Conductor of its
own first), and the Conductors are given the same ones (``--slo-ttft-s``, ``--slo-tbt-s``):
what they admit by is what the table judges by. Otherwise they run the shipped admission
settings, unless ``--conductor-args`` says so.

    python -m bench.conductors                      # 1, 2 and 4 Conductors
    python -m bench.conductors --conductors 1,2 --duration-s 20 --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from bench.disagg import derive_slos, ratio, summarize, unloaded_values
from bench.harness import INSTANCE_HELD, ServerProcess, launch_server, start_etcd, until
from bench.serving import RequestResult, compute_metrics, fetch_model, random_requests, send_request

SECRET = "bench conductors secret 0123456789"
ENV = {"MOONCAKE_CLUSTER_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
DEFAULT_OUT = Path("out") / "conductors.json"


def _progress(msg: str) -> None:
    print(f"[bench.conductors] {msg}", file=sys.stderr, flush=True)


def start_instances(etcd_url: str, args: argparse.Namespace, logs: Path) -> list[ServerProcess]:
    return [launch_server(["--role", role, "--etcd", etcd_url, "--threads", str(args.instance_threads),
                           "--pool-dram-gib", "0", "--log-level", "warning", *shlex.split(args.instance_args)],
                          logs / f"{role}.log", name=role, python=args.python, env=ENV, advertise=True)
            for role in ("prefill", "decode")]


def start_conductors(n: int, etcd_url: str, args: argparse.Namespace, logs: Path, flags: Sequence[str] = (),
                     name: str = "") -> list[ServerProcess]:
    conductors = [launch_server(["--prefill-instances", "0", "--decode-instances", "0", "--etcd", etcd_url,
                                 "--conductor-id", f"c{k}", "--log-level", "warning", *flags,
                                 *shlex.split(args.conductor_args)],
                                logs / f"{name}-conductor{k}.log", name=f"conductor c{k}", python=args.python, env=ENV)
                  for k in range(1, n + 1)]
    for c in conductors:
        c.wait_instances(2, args.health_timeout)
    return conductors


def idle(instances: list[ServerProcess], within_s: float) -> None:
    """Every instance holds nothing (the last run's requests ended or were released)."""
    def clean() -> bool:
        return all(not any(ServerProcess.instance_stats(p.base_url).get(k) for k in INSTANCE_HELD) for p in instances)

    until(clean, within_s, "the instances to finish and release the last run's requests", every_s=0.5)


async def offer(urls: list[str], args: argparse.Namespace, rate: float, seed: int) -> tuple[list[RequestResult], float]:
    """A seeded stream at ``rate`` req/s for ``--duration-s``, request k to ``urls[k % N]``: the
    same arrivals and lengths for every N, with prompts of their own (the instances' prefix caches
    still hold the last run's)."""
    n = max(1, round(rate * args.duration_s))
    reqs = random_requests(n, (args.prompt_len, args.prompt_len), (args.output_len, args.output_len),
                           rate=rate, seed=seed)
    fresh = random_requests(n, (args.prompt_len, args.prompt_len), (1, 1), seed=seed + 100 * len(urls))
    reqs = [dataclasses.replace(r, prompt=f.prompt) for r, f in zip(reqs, fresh)]
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout), trust_env=False) as client:
        model = await fetch_model(client, urls[0], None)
        start = time.perf_counter()
        tasks = []
        for k, req in enumerate(reqs):
            if (delay := start + req.arrival_s - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_request(client, urls[k % len(urls)], model, req)))
        results = list(await asyncio.gather(*tasks))
    return results, max(r.end_time for r in results) - start


async def unloaded(url: str, args: argparse.Namespace) -> dict:
    """Median TTFT and TBT of prompts like the load's, one at a time, after a warm-up."""
    reqs = random_requests(4, (args.prompt_len, args.prompt_len), (args.output_len, args.output_len), seed=args.seed + 1)
    # (seeds other than the load's: none of these prompts is cached when the load runs)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), trust_env=False) as client:
        model = await fetch_model(client, url, None)
        results = [await send_request(client, url, model, req) for req in reqs]
    return unloaded_values(results[1:])


def conductor_counts(conductors: list[ServerProcess]) -> dict[str, Any]:
    """From the Conductors' /stats: what they admitted and refused in all, each one's TTFT
    prediction factor at the end (how much slower than calibrated it found prefills live), and
    their admission probes (the live false-reject rate)."""
    stats = [c.stats() or {} for c in conductors]
    return {"accepted": sum(s.get("requests_accepted", 0) for s in stats),
            "rejected": sum(s.get("requests_rejected", 0) for s in stats),
            "ttft_prediction_factors": [s.get("ttft_prediction_factor") for s in stats],
            "admission_probes": sum(s.get("admission_probes", 0) for s in stats),
            "admission_probes_met_slo": sum(s.get("admission_probes_met_slo", 0) for s in stats),
            "rejections_by_reason": [s.get("rejections_by_reason") for s in stats]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="bench-conductors-"))
    _progress(f"logs in {logs}")
    etcd = start_etcd(logs / "etcd")
    procs: list[ServerProcess] = [etcd]
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "runs": {}}
    try:
        instances = start_instances(etcd.url, args, logs)
        procs += instances
        # The unloaded latency through a Conductor of its own, then the SLOs every count's
        # Conductors admit by and the table judges by: the same two numbers.
        (probe,) = start_conductors(1, etcd.url, args, logs, name="unloaded")
        try:
            base = asyncio.run(unloaded(probe.base_url, args))
        finally:
            probe.stop(10.0)
        slos = derive_slos(base, slo_ttft_ms=args.slo_ttft_ms, slo_tbt_ms=args.slo_tbt_ms,
                           source="through one Conductor")
        rate = args.load * 1000.0 / base["ttft_ms"]
        report.update(unloaded=base, slos=slos, rate=rate)
        _progress(f"unloaded TTFT {base['ttft_ms']:.0f} ms, TBT {base['tbt_ms']:.1f} ms: offering {rate:.2f} req/s "
                  f"({args.load:g}x) for {args.duration_s:g} s, {args.repeats} time(s) per count")
        slo_flags = ["--slo-ttft-s", f"{slos['ttft_ms'] / 1000:.4f}", "--slo-tbt-s", f"{slos['tbt_ms'] / 1000:.4f}"]
        idle(instances, 60.0)
        for n in args.conductors:
            results: list[RequestResult] = []
            duration, counts, sent_at = 0.0, [], []
            for repeat in range(args.repeats):
                conductors = start_conductors(n, etcd.url, args, logs, slo_flags, name=f"n{n}r{repeat}")
                try:
                    _progress(f"{n} Conductor(s), run {repeat + 1} of {args.repeats}")
                    got, took = asyncio.run(offer([c.base_url for c in conductors], args, rate, args.seed + repeat))
                    results += got
                    duration += took
                    counts.append(conductor_counts(conductors))
                    sent_at += [r.send_time - got[0].send_time for r in got]
                finally:
                    for c in conductors:
                        c.stop(10.0)
                idle(instances, 120.0)
            m = compute_metrics(results, duration, slo_ttft_ms=slos["ttft_ms"], slo_tbt_ms=slos["tbt_ms"])
            report["runs"][str(n)] = {**summarize(m), "conductors": counts, "requests": [
                {"sent_s": round(t, 3), "status": r.status, "ttft_s": None if r.ttft is None else round(r.ttft, 3)}
                for t, r in zip(sent_at, results)]}
    finally:
        for p in reversed(procs):
            p.stop(10.0)
    return report


def format_table(report: dict[str, Any]) -> str:
    runs = report["runs"]
    one = runs.get("1")
    slos = report["slos"]
    lines = [f"offered {report['rate']:.2f} req/s of {report['args']['prompt_len']}-token prompts "
             f"({report['args']['load']:g}x the unloaded TTFT's rate) for {report['args']['duration_s']:g} s; "
             f"x {report['args']['repeats']}; SLOs TTFT {slos['ttft_ms'] / 1000:.2f} s ({slos['ttft_from']}), "
             f"TBT {slos['tbt_ms']:.0f} ms ({slos['tbt_from']})",
             "",
             "| Conductors | sent | admitted | refused | failed | TTFT p50 s | TTFT p90 s | SLO attainment | "
             "goodput req/s | admitted / 1 | TTFT p90 / 1 | goodput / 1 | probes met SLO |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in runs.items():
        def x(key: str) -> str:
            v = ratio(r[key], one[key]) if one else None
            return "" if v is None else f"{v:.2f}x"
        probes = sum(c.get("admission_probes", 0) for c in r.get("conductors", []))
        met = sum(c.get("admission_probes_met_slo", 0) for c in r.get("conductors", []))
        lines.append(f"| {n} | {r['sent']} | {r['completed']} | {r['rejected']} | {r['failed']} | "
                     f"{(r['ttft_p50_ms'] or 0) / 1000:.2f} | {(r['ttft_p90_ms'] or 0) / 1000:.2f} | "
                     f"{r['slo_attainment']:.2f} | {r['goodput']:.2f} | {x('completed')} | {x('ttft_p90_ms')} | "
                     f"{x('goodput')} | {met} / {probes} |")
    return "\n".join(lines)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of counts, not {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("every count must be >= 1")
    return counts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.conductors", description=__doc__.split("\n\n")[0])
    p.add_argument("--conductors", type=_counts, default=[1, 2, 4], help="Conductor counts, in order (1 first)")
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--load", type=float, default=4.0, help="offered rate, in multiples of 1 / unloaded TTFT")
    p.add_argument("--duration-s", type=float, default=40.0, help="seconds of arrivals per count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs per count, seeds SEED.. (pooled in the table)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="instead of 10x the unloaded TTFT")
    p.add_argument("--slo-tbt-ms", type=float, default=None, help="instead of 5x the unloaded TBT")
    p.add_argument("--instance-threads", type=int, default=1)
    p.add_argument("--instance-args", default="", help="extra instance flags (shell-split)")
    p.add_argument("--conductor-args", default="", help="extra Conductor flags (shell-split), e.g. '--admission none'")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--health-timeout", type=float, default=300.0)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    print(format_table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    _progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
