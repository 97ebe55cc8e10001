"""bench.single's measurement on a tiny model and its report (``python -m bench.single`` runs the
default model in each precision, and llama.cpp when it is installed)."""

from __future__ import annotations

from bench import single
from tiny_models import make_tiny_model


def test_speeds_are_measured_and_reported_against_the_first(tmp_path):
    model = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=True, seed=2)
    speeds = single.ours(["float32", "bfloat16:int8"], 24, 4, threads=1, rounds=1, model=str(model))
    assert [s.name for s in speeds] == ["float32", "bfloat16:int8"]
    assert all(s.prefill_tok_s > 0 and s.decode_tok_s > 0 for s in speeds)
    text = single.report([single.Speed("ref", 100.0, 10.0), single.Speed("x", 300.0, 12.5)], single.Speed("ref", 100.0, 10.0))
    assert "3.00x" in text and "1.25x" in text
