"""bench.faults (issue 40, items 1-2): the quick fault matrix against a real cluster, the verdicts
it gives, and the failpoints it arms (``cluster.failpoints``).

The quick run is what CI keeps: every fault of its rows must fire, and no 200 may carry other
text than the greedy reference; a later change that makes one of these faults silent fails it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

import cluster.instance.routes as routes_module
from bench.faults import ROWS, RowResult, format_table
from bench.faults.traffic import DIFFERS, ERROR, HUNG, IDENTICAL, Ask, Outcome
from cluster.failpoints import NAMES, Failpoints


@pytest.mark.processes
def test_the_quick_fault_matrix_fires_every_fault_and_no_200_differs(tmp_path):
    out = tmp_path / "faults.json"
    # float32, as every cluster test: a greedy answer there does not depend on the path either,
    # and its prefill is faster than the deterministic mode's (CI's time).
    proc = subprocess.run([sys.executable, "-m", "bench.faults", "--quick", "--precision", "float32", "--workdir",
                           str(tmp_path), "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "RESULT OK" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == [r.name for r in ROWS if r.quick]
    for r in rows:
        assert r["ok"] and r["fired"] >= 1 and r["counts"][DIFFERS] == 0 and r["counts"][HUNG] == 0, r
    # The corrupt KV was recomputed, not refused: the requests moved and came back identical.
    (flip,) = [r for r in rows if r["name"] == "kv-bit-flip"]
    assert flip["counters"].get("moved", 0) >= 1 and flip["counts"][IDENTICAL] > 0, flip


def _outcome(result: str) -> Outcome:
    return Outcome(Ask("a/0", "prompt", 4, False, "want"), result=result, status=200 if result != ERROR else 503,
                   text="other" if result == DIFFERS else "want", error="down" if result == ERROR else "")


def test_a_row_fails_on_a_differing_200_a_hang_or_a_fault_that_never_fired():
    fine = RowResult("r", "f", fired=1, outcomes=[_outcome(IDENTICAL), _outcome(ERROR)])
    assert fine.ok
    for bad in (RowResult("r", "f", fired=1, outcomes=[_outcome(IDENTICAL), _outcome(DIFFERS)]),
                RowResult("r", "f", fired=1, outcomes=[_outcome(HUNG)]),
                RowResult("r", "f", fired=0, outcomes=[_outcome(IDENTICAL)], problems=["never fired"])):
        assert not bad.ok
        assert "FAILED" in format_table([fine, bad]) and "| r | f | 1 | 2 | 1 |" in format_table([fine, bad])


def test_a_failpoint_fires_as_often_as_it_was_armed_and_counts_it():
    fp = Failpoints(True)
    assert not fp.fire("kv.flip_bit")
    fp.arm({"kv.flip_bit": 2, "pool.fail_read": 0})
    assert [fp.fire("kv.flip_bit") for _ in range(3)] == [True, True, False]
    assert not fp.fire("pool.fail_read")
    fp.note("kv.stale_write", "refused")
    assert fp.state() == {"armed": {}, "fired": {"kv.flip_bit": 2}, "outcomes": {"kv.stale_write:refused": 1}}
    for bad in ({"no.such.point": 1}, {"kv.flip_bit": -1}, {"kv.flip_bit": True}, {"kv.flip_bit": "2"}):
        with pytest.raises(ValueError):
            fp.arm({"kv.truncate": 5, **bad})
        assert not fp.fire("kv.truncate"), "a refused arm armed part of it"
    with pytest.raises(RuntimeError, match="MOONCAKE_FAILPOINTS"):
        Failpoints(False).arm({"kv.flip_bit": 1})
    assert "kv.flip_bit" in NAMES


@pytest.mark.parametrize("enabled", [False, True])
def test_the_failpoints_route_exists_only_in_a_process_started_with_them(monkeypatch, enabled):
    monkeypatch.setattr(routes_module, "FAILPOINTS", Failpoints(enabled))
    service = SimpleNamespace(config=SimpleNamespace(secret=b"failpoints route test secret", url="http://127.0.0.1:9"))
    paths = [r.path for r in routes_module.InstanceRoutes(service).routes()]
    assert ("/instance/failpoints" in paths) is enabled
