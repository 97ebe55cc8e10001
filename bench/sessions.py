"""bench.sessions: the agentic trace live, with and without session hints (issue 42).

The simulator's generator (``bench/sim/sessions.py``) at the default model's scale: sessions that
start from a shared system prompt and run turns (a tool's output or a user's message appended,
the model's answer, a think time), beside one-shot prompts nobody sends again. Each turn is text
(the last turn's prompt, the answer the server gave, the new message), sent closed-loop: the
next turn leaves ``think_s`` after the last one's answer ended. The same seeded trace runs on a
fresh ``python -m server`` cluster (2 prefill instances, 1 decode instance, a KVCache pool on
their DRAM, small caches so that one-shots push sessions out) per configuration:

* LRU: no hints (what a client that names no session gets);
* sticky only: hints, ``--session-retention-s 0``;
* retention only: hints, ``--session-slack-s off``;
* both: hints, the shipped defaults;
* prestage (with ``--ssd``: a small pool DRAM over an SSD tier): both, and ``--session-prestage``.

Per configuration: next turns' hit rate (``cached_tokens`` over prompt tokens, the prefix cache
and the pool together), their TTFT p50 / p90, and goodput (requests, next turns and one-shots,
whose TTFT met ``--slo-ttft-s``, per second). Belady's optimum is the simulator's alone.

    python -m bench.sessions                    # the first four, ~12 minutes
    python -m bench.sessions --ssd              # both, with and without pre-staging
    python -m bench.sessions --duration-s 30 --configs lru,both
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.harness import launch_server
from bench.serving import BenchRequest, RequestResult, fetch_model, send_request
from bench.sim.sessions import AgenticConfig, AgenticTrace, agentic_trace

ENV = {"MOONCAKE_CLUSTER_SECRET": "bench sessions secret 0123456789", "OMP_NUM_THREADS": "1"}
DEFAULT_OUT = Path("out") / "sessions.json"
# The default model's scale: a few hundred tokens per message, seconds of thinking.
WORKLOAD = AgenticConfig(duration_s=90.0, session_rate=0.15, systems=3, system_tokens=256, first_tokens=(20, 60),
                         turns=(3, 6), tool_tokens=(40, 160), user_tokens=(10, 40), output_tokens=(16, 48),
                         tool_think_s=1.0, user_think_s=4.0, one_shot_rate=0.25, one_shot_tokens=(300, 700),
                         one_shot_output=8)
CONFIGS: dict[str, tuple[bool, tuple[str, ...]]] = {
    "lru": (False, ()),
    "sticky": (True, ("--session-retention-s", "0")),
    "retention": (True, ("--session-slack-s", "off")),
    "both": (True, ()),
    "prestage": (True, ("--session-prestage",)),
}
NAMES = {"lru": "LRU, no hints", "sticky": "sticky only", "retention": "retention only",
         "both": "sticky + retention (shipped)", "prestage": "sticky + retention + pre-staging"}
# --ssd: the pool's DRAM holds a few objects per node and the rest goes to an SSD tier, where a
# session's KV sits after a few seconds of one-shots: what pre-staging would bring back up.
SSD = ("--pool-dram-gib", "0.01", "--pool-ssd-gib", "0.5")
CLUSTER = ("--prefill-instances", "2", "--decode-instances", "1", "--kv-cache-gib", "0.04", "--pool-dram-gib", "0.02",
           "--pool-block-tokens", "64", "--log-level", "warning")


def _progress(msg: str) -> None:
    print(f"[bench.sessions] {msg}", file=sys.stderr, flush=True)


# Common words, one token each with the default tokenizer: a random run of them is a text of
# about as many tokens, and no other run shares more than a few of its first ones.
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education").split()


def _text(rng: random.Random, tag: str, tokens: int) -> str:
    """About ``tokens`` tokens of words, starting with ``tag`` (what it is: a tool's output...)."""
    return f" {tag}:" + "".join(" " + rng.choice(WORDS) for _ in range(tokens))


@dataclass
class Sent:
    session: int | None  # None: a one-shot
    turn: int
    result: RequestResult


async def replay(url: str, trace: AgenticTrace, hints: bool, seed: int) -> list[Sent]:
    """Every session and one-shot of ``trace``, closed-loop, against the server at ``url``."""
    rng = random.Random(seed)
    systems = [_text(rng, "system", trace.config.system_tokens) for k in range(trace.config.systems)]
    sent: list[Sent] = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        model = await fetch_model(client, url, None)

        async def ask(prompt: str, output: int, session: int | None, turn: int) -> RequestResult:
            extra = {"session_id": f"s{session}"} if hints and session is not None else {}
            result = await send_request(client, url, model, BenchRequest(prompt, output, 0.0), extra=extra)
            sent.append(Sent(session, turn, result))
            return result

        async def session(s) -> None:
            await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t0)))
            words = random.Random(f"session {seed} {s.id}")
            prompt = systems[s.system] + _text(words, "user", s.first)
            for k, turn in enumerate(s.turns):
                if k:
                    prompt += _text(words, turn.kind, turn.appended)
                result = await ask(prompt, turn.output, s.id, k)
                if not result.success:
                    return  # a refused turn ends its session: the client gave up
                prompt += result.text
                await asyncio.sleep(turn.think_s)

        async def one_shot(o) -> None:
            await asyncio.sleep(max(0.0, o.arrival_s - (time.perf_counter() - t0)))
            await ask(_text(random.Random(f"one-shot {seed} {o.id}"), "document", o.tokens), o.output, None, 0)

        await asyncio.gather(*(session(s) for s in trace.sessions), *(one_shot(o) for o in trace.one_shots))
    return sent


def summarize(sent: list[Sent], slo_ttft_s: float) -> dict[str, Any]:
    nxt = [s.result for s in sent if s.session is not None and s.turn > 0 and s.result.success]
    ttft = [r.ttft for r in nxt]
    done = [s.result for s in sent if s.result.success]
    span = max(r.end_time for r in done) - min(r.send_time for r in done) if done else 0.0
    met = sum(r.ttft <= slo_ttft_s for r in done)
    errors = Counter(s.result.error[:80] for s in sent if not s.result.success)
    return {
        "requests": len(sent), "failed": sum(not s.result.success for s in sent), "errors": dict(errors),
        "next_turns": len(nxt),
        "next_turn_hit": sum(r.cached_tokens for r in nxt) / max(sum(r.prompt_tokens or 0 for r in nxt), 1),
        "next_turn_ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "next_turn_ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None,
        "goodput_rps": met / span if span else None, "slo_met": met / max(len(sent), 1),
    }


def run_config(name: str, args: argparse.Namespace, trace: AgenticTrace, logs: Path) -> dict[str, Any]:
    hints, flags = CONFIGS[name]
    ssd = [*SSD, "--pool-ssd-dir", str(logs / f"{name}-ssd")] if args.ssd else []
    server = launch_server([*CLUSTER, *ssd, *flags, *args.server_args], logs / f"{name}.log", name=name, env=ENV)
    try:
        server.wait_instances(3, 600)
        _progress(f"{name}: cluster up, replaying {len(trace.sessions)} sessions and {len(trace.one_shots)} one-shots")
        sent = asyncio.run(replay(server.base_url, trace, hints, args.seed))
        stats = server.stats() or {}
        row = summarize(sent, args.slo_ttft_s)
        pool = stats.get("pool", {})
        row.update(config=NAMES[name], session_turns_kept=stats.get("session_turns_kept"),
                   pool_evictions=pool.get("evictions"), pool_retained_evictions=pool.get("retained_evictions"),
                   pool_promotions=pool.get("promotions"), pool_demotions=pool.get("demotions"),
                   session_prestages=stats.get("session_prestages"),
                   session_prestaged_objects=stats.get("session_prestaged_objects"))
        _progress(f"{name}: {row}")
        return row
    finally:
        server.stop(30.0)


def format_table(report: dict[str, Any]) -> str:
    head = ["config", "next-turn hit", "TTFT p50 (s)", "p90 (s)", "goodput (req/s)", "SLO met", "failed"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for row in report["rows"]:
        cells = [row["config"], f"{row['next_turn_hit']:.3f}", f"{row['next_turn_ttft_p50_s']:.3f}",
                 f"{row['next_turn_ttft_p90_s']:.3f}", f"{row['goodput_rps']:.2f}", f"{row['slo_met']:.3f}",
                 str(row["failed"])]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None,
                   help=f"of {', '.join(CONFIGS)} (default: all but prestage; with --ssd: both,prestage)")
    p.add_argument("--ssd", action="store_true", help="a small pool DRAM over an SSD tier (pre-staging's case)")
    p.add_argument("--duration-s", type=float, default=WORKLOAD.duration_s, help="sessions start within this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="what goodput counts as met")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more flags for every cluster")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = (args.configs or ("both,prestage" if args.ssd else "lru,sticky,retention,both")).split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        raise SystemExit(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    trace = agentic_trace(replace(WORKLOAD, seed=args.seed, duration_s=args.duration_s))
    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as tmp:
        rows = [run_config(name, args, trace, Path(tmp)) for name in names]
    report = {"workload": WORKLOAD.__dict__ | {"duration_s": args.duration_s, "seed": args.seed},
              "cluster": list(CLUSTER) + (list(SSD) if args.ssd else []), "slo_ttft_s": args.slo_ttft_s, "rows": rows}
    print(format_table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    _progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
