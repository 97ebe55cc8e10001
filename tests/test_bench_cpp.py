"""bench.cpp's report: the ratios and the two targets (the runs start two clusters and prefill
8k-token prompts, minutes on a CPU: ``python -m bench.cpp`` runs it whole)."""

from bench import cpp


def test_report_ratios_and_targets():
    results = {1: {256: 0.50, 8191: 80.0}, 2: {256: 0.48, 8191: 45.0}}
    text = cpp.report(results, [256, 8191])
    assert "1.78x" in text and "1.04x" in text
    assert "Target X=2 >= 1.6x faster at 8191 tokens: MET (1.78x)" in text
    assert "no slower than X=1 at 256 tokens: MET" in text
    results[2][8191], results[2][256] = 60.0, 0.55
    text = cpp.report(results, [256, 8191])
    assert "at 8191 tokens: MISSED (1.33x)" in text and "at 256 tokens: MISSED (0.91x)" in text
