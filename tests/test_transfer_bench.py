"""bench.transfer: the report's table and target lines, and a small run of our engine's rows."""

from __future__ import annotations

from bench import transfer as bt

KiB, MiB = 1 << 10, 1 << 20


def test_report_table_and_targets_against_measured_mooncake():
    sizes = [64 * KiB, MiB]
    results = {("copy_", "-", s): 10.0 for s in sizes}
    results.update({("raw socket", "write", 64 * KiB): 2.0, ("raw socket", "write", MiB): 2.5})
    for direction in ("write", "read"):
        results.update({("mooncake tcp", direction, 64 * KiB): 0.5, ("mooncake tcp", direction, MiB): 1.0})
        results.update({("tcp", direction, 64 * KiB): 1.5, ("tcp", direction, MiB): 2.0})
        results.update({("shm", direction, 64 * KiB): 5.0, ("shm", direction, MiB): 9.0})
    text = bt.report(results, sizes, None)
    lines = text.splitlines()
    assert lines[0].split() == ["transport", "direction", "64", "KiB", "GiB/s", "1", "MiB", "GiB/s"]
    assert any(line.split()[:2] == ["mooncake", "tcp"] for line in lines)
    assert "(measured 0.50): 3.00x PASS" in text
    assert "tcp write 1 MiB >= 80% of raw socket: 80% PASS" in text
    assert "shm 64 KiB >= 60% of copy_: 50% MISS" in text
    assert "shm 1 MiB >= 60% of copy_: 90% PASS" in text


def test_report_without_mooncake_uses_the_issue_figure_and_says_why():
    sizes = [64 * KiB]
    results = {("copy_", "-", 64 * KiB): 10.0, ("raw socket", "write", 64 * KiB): 2.0}
    for direction in ("write", "read"):
        results.update({("tcp", direction, 64 * KiB): 1.0, ("shm", direction, 64 * KiB): 7.0})
    text = bt.report(results, sizes, "mooncake-transfer-engine-non-cuda unavailable (no module)")
    assert "Mooncake: mooncake-transfer-engine-non-cuda unavailable" in text
    assert "(issue's figure 0.60): 1.67x MISS" in text
    assert "mooncake tcp" not in text.split("Mooncake:")[0]


def test_our_rows_on_a_small_run():
    results = bt.ours(4 * MiB, [64 * KiB, MiB], repeat=1, streams=2)
    assert set(results) == {(t, d, s) for t in ("tcp", "shm") for d in ("write", "read") for s in (64 * KiB, MiB)}
    assert all(v > 0 for v in results.values())
