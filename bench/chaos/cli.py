"""``python -m bench.chaos``: the command line, and a whole run (start, scenarios, stop)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.chaos.cluster import start_cluster, stop_cluster
from bench.chaos.config import FAMILIES, FULL_ONLY, ChaosConfig, progress
from bench.chaos.fuzz import generated_cases, handmade_cases
from bench.chaos.report import format_table
from bench.chaos.run import run_scenarios

def run_chaos(cfg: ChaosConfig) -> dict[str, Any]:
    """Start the cluster, run every scenario, stop the cluster (always); the report."""
    fuzz_cases = handmade_cases() + generated_cases(cfg.fuzz_examples, cfg.seed)
    cluster = start_cluster(cfg)
    progress(f"starting: {shlex.join(cluster.server.cmd)} (log: {cfg.log_path})")
    try:
        report = {"startup_s": round(cluster.server.wait_healthy(cfg.health_timeout_s), 1)}
        progress(f"healthy after {report['startup_s']} s")
        report.update(asyncio.run(run_scenarios(cfg, cluster, fuzz_cases)))
    finally:
        progress("stopping the cluster")
        stop_cluster(cluster)
    report.update(command=cluster.server.cmd, url=cluster.url, instance_pids=sorted(cluster.seen_pids))
    return report


def write_json(path: Path, report: dict[str, Any]) -> None:
    """The report, the table included, as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**report, "table": format_table(report)}, indent=1, default=str))


def _doc() -> str:
    import bench.chaos  # the package's docstring: its first paragraph

    return bench.chaos.__doc__ or ""


def build_parser() -> argparse.ArgumentParser:
    d = ChaosConfig()
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=_doc().split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter: smaller burst and fuzz, shorter pauses")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra server flag, repeatable (--server-arg=--instance-threads=1)")
    p.add_argument("--server-args", default="", help="extra server flags, shell-split ('--kv-cache-gib 0.5')")
    p.add_argument("--python", default=d.python, help="interpreter that runs the server (default: this one)")
    p.add_argument("--rate", type=float, default=None, help=f"steady stream req/s (default {d.rate}; quick 1.5)")
    p.add_argument("--max-tokens", type=int, default=None, help=f"tokens per request (default {d.max_tokens})")
    p.add_argument("--deadline-s", type=float, default=None, help=f"per request (default {d.deadline_s:g})")
    p.add_argument("--pause-s", type=float, default=None, help=f"between faults (default {d.pause_s:g})")
    p.add_argument("--stop-role", choices=["prefill", "decode", "both"], default=None, help=f"default {d.stop_role}")
    p.add_argument("--stop-s", type=float, default=None, help=f"SIGSTOP duration (default {d.stop_s:g})")
    p.add_argument("--long-clients", type=int, default=None, help=f"long-prompt clients (default {d.long_clients})")
    p.add_argument("--long-words", type=int, default=None, help=f"words per long prompt (default {d.long_words})")
    p.add_argument("--etcd-stop-s", type=float, default=None, help=f"default {d.etcd_stop_s:g}")
    p.add_argument("--no-etcd", action="store_true", help="the embedded metadata store (not stopped)")
    p.add_argument("--pool-stop-s", type=float, default=None, help=f"default {d.pool_stop_s:g}")
    p.add_argument("--no-pool-node", action="store_true", help="no pool node of the bench's own")
    p.add_argument("--burst", type=int, default=None, help=f"requests at once (default {d.burst})")
    p.add_argument("--fuzz-examples", type=int, default=None,
                   help=f"hypothesis-generated bodies (default {d.fuzz_examples})")
    p.add_argument("--stall-connections", type=int, default=None, help=f"default {d.stall_connections}")
    p.add_argument("--idle-connections", type=int, default=None, help=f"default {d.idle_connections}")
    p.add_argument("--slow-header-connections", type=int, default=None, help=f"default {d.slow_header_connections}")
    p.add_argument("--no-second-conductor", action="store_true", help="no second Conductor (killed) on the etcd")
    p.add_argument("--only", action="append", default=[], metavar="FAMILY[,FAMILY]",
                   help="run only these fault families, repeatable (default: all; --quick leaves out "
                        f"{', '.join(FULL_ONLY)}): {', '.join(FAMILIES)}")
    p.add_argument("--restarts", type=int, default=None, help=f"kill -9 restarts of one instance (default {d.restarts})")
    p.add_argument("--overload-s", type=float, default=None,
                   help=f"seconds at ten times the sustainable load (default {d.overload_s:g})")
    p.add_argument("--frozen-prompts", type=int, default=None,
                   help=f"fresh long prompts before and while the pool node is frozen (default {d.frozen_prompts}; "
                        "quick 0)")
    p.add_argument("--restart-timeout-s", type=float, default=None, help=f"default {d.restart_timeout_s:g}")
    p.add_argument("--drain-s", type=float, default=None, help=f"default {d.drain_s:g}")
    p.add_argument("--seed", type=int, default=None, help=f"default {d.seed}")
    p.add_argument("--log", type=Path, default=None, help=f"server log (default {d.log_path})")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    return p


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    cfg = ChaosConfig.quick() if args.quick else ChaosConfig()
    given = {"rate": args.rate, "max_tokens": args.max_tokens, "deadline_s": args.deadline_s,
             "pause_s": args.pause_s, "stop_role": args.stop_role, "stop_s": args.stop_s, "burst": args.burst,
             "fuzz_examples": args.fuzz_examples, "stall_connections": args.stall_connections,
             "restart_timeout_s": args.restart_timeout_s, "drain_s": args.drain_s, "seed": args.seed,
             "log_path": args.log, "long_clients": args.long_clients, "long_words": args.long_words,
             "etcd_stop_s": args.etcd_stop_s, "pool_stop_s": args.pool_stop_s,
             "etcd": False if args.no_etcd else None, "pool_node": False if args.no_pool_node else None,
             "idle_connections": args.idle_connections, "slow_header_connections": args.slow_header_connections,
             "second_conductor": False if args.no_second_conductor else None,
             "restarts": args.restarts, "frozen_prompts": args.frozen_prompts, "overload_s": args.overload_s,
             "families": _families(args.only) if args.only else None}
    return replace(cfg, python=args.python, server_args=[*args.server_arg, *shlex.split(args.server_args)],
                   **{k: v for k, v in given.items() if v is not None})


def _families(only: list[str]) -> tuple[str, ...]:
    """The families ``--only`` names (each value may list several, comma-separated)."""
    chosen = tuple(f.strip() for value in only for f in value.split(",") if f.strip())
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"error: unknown fault families {unknown}; choose from {', '.join(FAMILIES)}")
    return chosen


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        report = run_chaos(cfg)
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the cluster is already stopped (run_chaos's finally)
        return 130
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
        progress(f"wrote {args.json}")
    return 0 if report["ok"] else 1
