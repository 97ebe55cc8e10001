"""Weight-only int8 (``EngineConfig.quantization="int8"``) against the float32 reference.

The tolerance is stated on the default model over a fixed prompt set: the prompt tokens'
logprobs (every position of every prompt) stay within a mean absolute difference of 0.15 nats
of float32's, and the greedy continuations mostly agree.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.quantization import Int8Weight, linear, model_bytes, quantize_model
from prompts import PROMPTS
from tiny_models import make_tiny_model

torch.set_num_threads(2)


def test_int8_weights_round_to_their_row_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * torch.linspace(0.01, 3.0, 96)[:, None]  # rows of every scale
    q = Int8Weight(w)
    assert q.q.dtype == torch.int8 and q.shape == w.shape
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(5, 64, generator=g)
    want = torch.nn.functional.linear(x.bfloat16().float(), q.dequantize())
    assert torch.allclose(linear(x, q), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert linear(x, q).dtype == x.dtype


def test_a_quantized_tiny_model_keeps_its_logits_close(tmp_path):
    model = make_tiny_model(tmp_path / "m", "Qwen2ForCausalLM", tie=True, seed=4)
    prompts = [[(7 * i + j) % 200 + 3 for i in range(40)] for j in range(4)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    got = {}
    for q in (None, "int8"):
        llm = LLM(str(model), threads=2, kv_cache_gib=0.01, quantization=q)
        got[q] = [[lp.logprob for lp in r.prompt_logprobs[1:]] for r in llm.generate(prompts, params)]
        if q is not None:
            runner = llm.engine.runner
            assert isinstance(runner.model.layers[0].attn.qkv_weight, Int8Weight)
            assert isinstance(runner.model.lm_head, Int8Weight)  # a tied head gets its own int8 copy
            assert "qkv_weight" not in dict(runner.model.layers[0].attn.named_parameters())
    diff = torch.tensor(got[None]) - torch.tensor(got["int8"])
    assert diff.abs().mean() < 0.05


def test_the_default_model_in_int8_stays_within_the_stated_tolerance():
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0)
    runs = {}
    for q in (None, "int8"):
        llm = LLM(threads=2, kv_cache_gib=0.1, quantization=q)
        runs[q] = llm.generate(PROMPTS, params)
        if q is not None:
            assert model_bytes(llm.engine.runner.model) < 0.5 * float32_bytes  # the float embedding stays
        else:
            float32_bytes = model_bytes(llm.engine.runner.model)
    diffs = [abs(a.logprob - b.logprob) for ra, rb in zip(runs[None], runs["int8"])
             for a, b in zip(ra.prompt_logprobs[1:], rb.prompt_logprobs[1:])]
    assert sum(diffs) / len(diffs) < 0.15
    same = sum(a.token_ids == b.token_ids for a, b in zip(runs[None], runs["int8"]))
    assert same >= 0.6 * len(PROMPTS), [(a.text, b.text) for a, b in zip(runs[None], runs["int8"])]


def test_int8_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError):
        EngineConfig(device="cpu", quantization="int4")
    with pytest.raises(ValueError):
        quantize_model(torch.nn.Linear(2, 2), "int4")


def test_many_rows_take_the_dequantized_matmul_and_agree():
    from engine.quantization import INT8_MM_MAX_ROWS

    g = torch.Generator().manual_seed(1)
    q = Int8Weight(torch.randn(64, 32, generator=g))
    x = torch.randn(INT8_MM_MAX_ROWS + 8, 32, generator=g)
    few, many = linear(x[:INT8_MM_MAX_ROWS], q), linear(x, q)  # one way each
    assert torch.allclose(many[:INT8_MM_MAX_ROWS], few, rtol=2e-2, atol=5e-2)
