"""bench.pool: the report's tables, and a quick throughput run of the real command.

The TTFT part starts two 2-prefill + 1-decode clusters and prefills a prompt of 1,024 tokens
several times: minutes on a CPU, so only its report is tested here (``python -m bench.pool
--quick --only ttft`` runs it whole).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import pool as bp

KiB, MiB = 1 << 10, 1 << 20
REPO = Path(__file__).resolve().parents[1]
NUMBER = r"\d+(?:\.\d+)?"


def _rates(size: int, put_mbps: float, get_mbps: float, n: int = 10) -> bp.Rates:
    return bp.Rates(size, n, n * size / (put_mbps * bp.MB), n * size / (get_mbps * bp.MB))


def test_layer_size_is_one_layer_of_one_pool_object_of_the_default_model():
    # 256 tokens x 3 KV heads x head_dim 64 x (K and V) x 2 bytes (bfloat16 KV on CPU with the
    # native kernels).
    assert bp.pool_layer_bytes() == 256 * 3 * 64 * 2 * 2 == 192 * KiB
    assert [bp.size_name(s) for s in (64 * KiB, MiB, 192 * KiB)] == ["64 KiB", "1 MiB", "192 KiB"]


def test_throughput_report_ratios_and_target():
    sizes = [64 * KiB, MiB]
    results = {
        bp.OURS_AUTO: {64 * KiB: _rates(64 * KiB, 300, 400), MiB: _rates(MiB, 900, 1000)},
        bp.OURS_TCP: {64 * KiB: _rates(64 * KiB, 200, 100), MiB: _rates(MiB, 800, 600)},
        bp.MOONCAKE: {64 * KiB: _rates(64 * KiB, 100, 200), MiB: _rates(MiB, 400, 500)},
    }
    text = bp.throughput_report(results, sizes, None, "shm")
    ratios = next(line for line in text.splitlines() if line.split()[:2] == ["64", "KiB"] and "x" in line)
    assert ratios.split()[2:] == ["2.00x", "0.50x", "3.00x", "2.00x"]  # tcp put/get, shm put/get
    assert "MISSED at get 64 KiB" in text and "get 1 MiB" not in text.split("MISSED")[1]
    results[bp.OURS_TCP][64 * KiB] = _rates(64 * KiB, 200, 300)
    assert "(tcp): MET" in bp.throughput_report(results, sizes, None, "shm")


def test_throughput_report_without_mooncake_says_why():
    results = {bp.OURS_AUTO: {MiB: _rates(MiB, 900, 1000)}, bp.OURS_TCP: {MiB: _rates(MiB, 800, 600)}}
    text = bp.throughput_report(results, [MiB], "mooncake-transfer-engine-non-cuda unavailable (no module)", "shm")
    row = next(line for line in text.splitlines() if line.split()[:2] == ["mooncake", "store"])
    assert row.split()[-4:] == ["n/a"] * 4
    assert "mooncake store: mooncake-transfer-engine-non-cuda unavailable" in text
    assert "not checked" in text


def test_ttft_report():
    results = [bp.TtftResult("pool", [bp.TtftRound(30.0, 4.0, 14, 3.0)]),
               bp.TtftResult("no-pool", [bp.TtftRound(31.0, 30.0, None)])]
    text = bp.ttft_report(results, 4096, 4096, 3686, 256)
    assert "first 3686 tokens (90%)" in text and "14 pool objects of 256 tokens" in text
    assert "recompute / pool = 7.50x; target >= 5x: MET" in text
    assert ("own prefix cache: 3.00 s (3680 tokens reused, 416 computed; the pool hit reused 3584, computed 512: "
            "+1.00 s)") in text
    failed = bp.ttft_report([results[0], bp.TtftResult("no-pool", [], "TimeoutError: x")], 4096, 4096, 3686, 256)
    assert "failed: TimeoutError: x" in failed and "not checked" in failed


@pytest.mark.processes
def test_quick_throughput_run(tmp_path):
    cmd = [sys.executable, "-m", "bench.pool", "--quick", "--only", "throughput", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows: dict[tuple[str, ...], list[float]] = {}
    section = None
    for line in proc.stdout.splitlines():
        if line.endswith("object per call:") or " objects per call " in line:
            section = line.split()[0]  # "one", or the batch size
        m = re.fullmatch(rf"\s*(ours|mooncake store)\s+(shm|tcp)\s+(\d+ [KM]iB)\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})"
                         rf"\s+({NUMBER})\s*", line)
        if m:
            rows[section, m.group(1), m.group(2), m.group(3)] = [float(v) for v in m.groups()[3:]]
    sizes = ("64 KiB", "1 MiB", bp.size_name(bp.pool_layer_bytes()))  # the last: one layer of one pool object
    for section in ("one", "16"):  # single-object calls, then calls of 16 objects
        for transport in ("shm", "tcp"):  # "auto" is shared memory between two processes of one host
            for size in sizes:
                assert all(v > 0 for v in rows[(section, "ours", transport, size)]), proc.stdout
    if bp.mooncake_unavailable() is not None:  # not a test dependency: its row says why
        assert "mooncake store: " in proc.stdout and "Mooncake Store (same transport): not checked" in proc.stdout
        return
    for section in ("one", "16"):
        for size in sizes:
            assert all(v > 0 for v in rows[(section, "mooncake store", "tcp", size)]), proc.stdout + proc.stderr[-3000:]
    verdicts = re.findall(r"Target ours >= Mooncake Store on the same transport \(tcp\): (MET|MISSED)", proc.stdout)
    assert len(verdicts) == 2, proc.stdout
