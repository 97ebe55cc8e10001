"""bench.pool_trace: the slice and its scaling (pure), the capacity arithmetic, and a --quick run
of the live cluster with and without the pool (two server starts, about 2 minutes on 2 cores)."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import pool_trace
from bench.trace import TraceEntry

TRACE = pool_trace.DEFAULT_TRACE


def entries_by_hand():
    # Conversations (0, 10) and (0, 20) have two turns each; (0, 30) only one.
    return [
        TraceEntry(0, 3 * 512 + 100, 40, [0, 10, 11, 12]),
        TraceEntry(0, 2 * 512, 40, [0, 30]),
        TraceEntry(1000, 2 * 512 + 7, 80, [0, 20, 21]),
        TraceEntry(9000, 5 * 512 + 1, 600, [0, 10, 11, 12, 13, 14]),
        TraceEntry(9500, 4 * 512, 5, [0, 20, 21, 22]),
        TraceEntry(9600, 512, 5, [0, 20]),
    ]


def test_select_slice_takes_conversations_with_several_turns_in_trace_order():
    e = entries_by_hand()
    assert pool_trace.select_slice(e, 3, "head") == e[:3]
    got = pool_trace.select_slice(e, 4, "conversations", max_turns=2)
    assert got == [e[0], e[2], e[3], e[4]]
    got = pool_trace.select_slice(e, 10, "conversations", max_turns=3)
    assert got == [e[0], e[2], e[3], e[4], e[5]]
    assert pool_trace.select_slice(e, 3, "conversations", max_turns=4) == [e[0], e[2], e[3]]
    with pytest.raises(ValueError):
        pool_trace.select_slice(e, 3, "nope")


def test_scaled_prompts_share_exactly_the_prefixes_their_hash_ids_share():
    bs = 16
    s = pool_trace.scale_slice(entries_by_hand(), bs, max_blocks=4, max_output=8)
    lens = [len(r.prompt) for r in s.requests]
    assert lens == [3 * bs + 3, 2 * bs, 2 * bs, 4 * bs, 4 * bs, bs]  # 100/32 rounds to 3; cut to 4 blocks
    assert [r.output_len for r in s.requests] == [1, 1, 2, 8, 1, 1]  # 600/32 -> 19 -> cut to 8
    for r, sim in zip(s.requests, s.sim_entries):
        assert sim.input_length == len(r.prompt) and sim.output_length == r.output_len
        assert len(sim.hash_ids) == len(r.prompt) // bs
    p = [r.prompt for r in s.requests]
    assert p[0][: 3 * bs] == p[3][: 3 * bs] and p[0][3 * bs:] != p[3][3 * bs: 3 * bs + 3]
    assert p[2][: 2 * bs] == p[4][: 2 * bs] and p[5] == p[2][:bs]
    assert p[0][:bs] == p[1][:bs] and p[0][bs: 2 * bs] != p[1][bs:]


def test_capacity_counts_whole_objects_below_the_high_water_mark():
    stats = {"segments": {"a": {"dram_bytes": 1280}, "b": {"dram_bytes": 1280}}}
    assert pool_trace.capacity_blocks(stats, 128, 0.9) == 2 * 9  # 1152 bytes below the mark
    assert pool_trace.capacity_blocks(stats, 100, 0.9) == 2 * 9  # ranges are 64-byte aligned
    assert pool_trace.capacity_blocks(stats, 129, 0.9) == 2 * 6
    assert pool_trace.object_bytes(16, {"objects": 4, "bytes": 400}) == 100
    assert pool_trace.within(0.5, 0.46) and not pool_trace.within(0.5, 0.44)
    assert pool_trace.within(0.0, 0.0) and not pool_trace.within(math.nan, 0.3)


ROW = re.compile(r"^(pool|no-pool)\s+(\d+)/(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)")


@pytest.mark.processes
@pytest.mark.skipif(not TRACE.exists(), reason=f"no trace at {TRACE}")
def test_quick_run_prints_sane_rows_and_a_prediction(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.pool_trace", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=420, cwd=Path(__file__).resolve().parents[1])
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in out.glob("server_*.log"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    rows = {m.group(1): m for line in proc.stdout.splitlines() if (m := ROW.match(line))}
    assert set(rows) == {"pool", "no-pool"}, proc.stdout
    for name, m in rows.items():
        ok, sent, prompt, cached = (int(m.group(i)) for i in (2, 3, 4, 5))
        hit, ttft_mean, ttft_p50 = float(m.group(6)), float(m.group(7)), float(m.group(8))
        assert ok == sent == pool_trace.QUICK["requests"]
        assert 0 <= cached <= prompt and 0.0 <= hit <= 1.0
        assert hit == pytest.approx(cached / prompt, abs=1e-3)
        assert ttft_mean > 0 and ttft_p50 > 0
    assert rows["pool"].group(4) == rows["no-pool"].group(4)  # the same prompts in both runs
    pred = re.search(r"^prefix\s+(\S+)\s+(\S+)\s+(\S+)", proc.stdout, re.M)
    assert pred, proc.stdout
    measured, predicted, unbounded = (float(pred.group(i)) for i in (1, 2, 3))
    assert 0.0 <= predicted <= unbounded <= 1.0 and measured == float(rows["pool"].group(6))
    assert re.search(r"^target \(measured within 10% of predicted\): (met|NOT met)$", proc.stdout, re.M)
    data = json.loads((out / "pool_trace.json").read_text())
    pool = data["runs"]["pool"]["pool"]
    assert pool is not None and pool["stores"] > 0 and len(pool["segments"]) == 3
    assert data["prediction"]["capacity_blocks"] > 0
    assert data["runs"]["no-pool"]["pool"] is None
