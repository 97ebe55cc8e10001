"""bench.cpp's report: the ratios and the two targets (the runs start two clusters and prefill
8k-token prompts, minutes on a CPU: ``python -m bench.cpp`` runs it whole)."""

import pytest

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


def test_a_stretched_model_runs_prompts_past_its_original_context(tmp_path):
    import json

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from tests.tiny_models import MAX_POSITIONS, make_tiny_model

    model = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=True, seed=3)
    stretched = cpp.stretched_model(model, 2, tmp_path / "s")
    config = json.loads((stretched / "config.json").read_text())
    assert config["max_position_embeddings"] == 2 * MAX_POSITIONS
    assert config["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert (stretched / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    engine = LLMEngine(EngineConfig(model=str(stretched), device="cpu", threads=1, kv_cache_gib=0.01))
    prompt = [(5 * i) % 90 + 3 for i in range(MAX_POSITIONS + 10)]  # longer than the original context
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2), request_id="r")
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert len(out) == 2
    with pytest.raises(ValueError):
        cpp.stretched_model(stretched, 2, tmp_path / "again")  # it scales its RoPE already
