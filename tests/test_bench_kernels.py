"""bench.kernels helpers (bytes, tables) and its no-CUDA path; no GPU needed."""

import pytest
import torch

from bench import kernels as bk


def test_bytes_helpers():
    # decode: K and V, bf16, batch 2 x 1024 tokens x 4 heads x 128.
    kv = 2 * 2 * 1024 * 4 * 128 * 2
    assert bk.decode_kv_bytes(2, 1024, 4, 128, 2) == kv
    assert bk.decode_bytes(2, 1024, 32, 4, 128, 2, block_size=16) == kv + 2 * 2 * 32 * 128 * 2 + 2 * 64 * 4 + 2 * 4
    assert bk.copy_bytes(100) == 200
    assert bk.store_kv_bytes(3, 4, 128, 2) == 4 * 3 * 4 * 128 * 2 + 24
    assert bk.rms_norm_bytes(10, 64, 2) == 2 * 10 * 64 * 2 + 64 * 2
    assert bk.rms_norm_bytes(10, 64, 2, residual=True, weight_elem=4) == 4 * 10 * 64 * 2 + 64 * 4
    assert bk.rope_bytes(5, 8, 128, 2) == 2 * 5 * 8 * 128 * 2 + 5 * 128 * 4
    assert bk.silu_and_mul_bytes(4, 100, 2) == 3 * 4 * 100 * 2
    page = 8 * 16 * 128 * 2
    assert bk.kv_transfer_bytes(32, 256, 8, 16, 128, 2) == 2 * 32 * 2 * 256 * page
    assert bk.gbps(2_000_000_000, 1000.0) == pytest.approx(2.0)
    assert bk.fits(60, 100) and not bk.fits(61, 100)


def test_format_table():
    text = bk.format_table(["name", "GB/s"], [["a", 1234.5678], ["bbbbbb", 0.5]])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "GB/s"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["a", "1234.57"] and lines[3].split() == ["bbbbbb", "0.500"]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert bk.format_table(["x"], []).splitlines()[0].strip() == "x"


def test_report_renders_and_marks_targets():
    elementwise = [{"kernel": "rms_norm", "size": "8x64", "us": 3.0, "GB/s": 100.0, "of_copy": 0.02}]
    decode = [
        {"batch": 64, "context": 8192, "us": 10.0, "GB/s": 4000.0, "of_copy": 0.9, "sdpa_us": 15.0,
         "gather_sdpa_us": 50.0, "x_sdpa": 1.5, "x_gather_sdpa": 5.0},
        {"batch": 1, "context": 8192, "us": 10.0, "GB/s": 100.0, "of_copy": 0.1, "sdpa_us": 15.0,
         "gather_sdpa_us": 50.0, "x_sdpa": 1.5, "x_gather_sdpa": 5.0},
    ]
    transfer = [{"op": "gather", "layers": "all", "blocks": 256, "MiB": 1.0, "us": 2.0, "GB/s": 3.0, "of_copy": 0.85}]
    text = bk.report(4400.0, elementwise, decode, transfer)
    assert "4400.0 GB/s" in text and "ok/ok" in text and "MISS/ok" in text
    assert "decode attention" not in bk.report(4400.0, elementwise, None, transfer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_main_without_cuda_measures_the_cpu_kernels(capsys):
    """Without CUDA the bench measures the native CPU kernels against the roofline: every table,
    the default (deterministic) and --no-deterministic steps side by side, and the targets."""
    args = ["--rows", "1", "16", "--context", "40", "--attn-seqs", "2", "--repeats", "1", "--threads", "1"]
    assert bk.main(args) == 0
    out = capsys.readouterr().out
    assert "roofline: read " in out and "GFLOP/s float32" in out and "G int8 multiply-adds/s" in out
    assert "native GEMM " in out and "ATen " in out
    assert "3072x576" in out and "49152x576" in out and "a step's linears" in out and "2 x 40 tokens, bfloat16" in out
    steps = [line.split() for line in out.splitlines() if line.lstrip().startswith(("default ", "--no-deterministic "))]
    assert {(s[0], s[1]) for s in steps if s[1] in ("1", "16")} == {
        (name, rows) for name in ("default", "--no-deterministic") for rows in ("1", "16")}
    assert "target: a step's linears at 16 rows >= 1.3x the float32 matmul: " in out
    assert "target: 1 row >= 50% of read bandwidth: " in out
