"""bench.conductors' table and flags (the run itself needs etcd and real processes: a benchmark's
job, python -m bench.conductors)."""

from __future__ import annotations

import argparse

import pytest

from bench.conductors import _counts, build_parser, format_table


def _run(sent: int, admitted: int, p90_ms: float, goodput: float, probes: tuple[int, int]) -> dict:
    return {"sent": sent, "completed": admitted, "rejected": sent - admitted, "failed": 0, "ttft_p50_ms": p90_ms / 2,
            "ttft_p90_ms": p90_ms, "slo_attainment": goodput / 10, "goodput": goodput,
            "conductors": [{"admission_probes": probes[0], "admission_probes_met_slo": probes[1]}]}


def test_the_table_gives_each_count_against_one_conductor_of_the_same_run():
    report = {"rate": 10.0, "args": {"prompt_len": 400, "load": 4.0, "duration_s": 40.0, "repeats": 3},
              "slos": {"ttft_ms": 3800.0, "tbt_ms": 110.0, "ttft_from": "10x unloaded", "tbt_from": "5x unloaded"},
              "runs": {"1": _run(400, 100, 4000.0, 2.0, (5, 3)), "2": _run(400, 125, 6000.0, 1.5, (4, 1))}}
    table = format_table(report)
    assert "SLOs TTFT 3.80 s (10x unloaded), TBT 110 ms (5x unloaded)" in table
    one, two = [line for line in table.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert one.endswith("| 1.00x | 1.00x | 1.00x | 3 / 5 |")
    assert two.endswith("| 1.25x | 1.50x | 0.75x | 1 / 4 |")  # admitted, TTFT p90, goodput against one


def test_counts_are_a_list_of_positive_integers():
    assert _counts("1,2,4") == [1, 2, 4]
    for bad in ("1,x", "0,2", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _counts(bad)
    args = build_parser().parse_args([])
    assert args.conductors == [1, 2, 4] and args.repeats == 3 and args.load == 4.0
