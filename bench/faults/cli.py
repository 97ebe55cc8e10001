"""bench.faults: the command line."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.faults.matrix import ROWS
from bench.faults.run import PRECISIONS, FaultsConfig, main_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    p.add_argument("--quick", action="store_true", help="only the rows CI runs (" +
                   ", ".join(r.name for r in ROWS if r.quick) + "), fewer requests")
    p.add_argument("--only", action="append", default=[], metavar="ROW",
                   help="run this row (repeatable): " + ", ".join(r.name for r in ROWS))
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="deterministic",
                   help="the cluster's and the references' precision (default: deterministic)")
    p.add_argument("--requests", type=int, default=None, help="requests per row of fresh prompts (6; quick: 4)")
    p.add_argument("--sessions", type=int, default=2, help="two-turn sessions per pool row")
    p.add_argument("--costs", action="store_true", help="also measure what the checks cost (costs.py), first")
    p.add_argument("--workdir", type=Path, default=None, help="logs go here (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-faults-"))
    requests = args.requests if args.requests is not None else (4 if args.quick else 6)
    cfg = FaultsConfig(workdir, quick=args.quick, precision=args.precision, requests=requests,
                       sessions=args.sessions, only=tuple(args.only), json_path=args.json)
    if args.costs:
        from bench.faults.costs import print_costs

        print_costs()
    return main_run(cfg)
