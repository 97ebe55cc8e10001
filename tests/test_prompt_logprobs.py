"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the engine scores every prompt token.

Against an independent float64 dense forward (tests/tiny_models.py) on the tiny models and the
default model; equal with and without a prefix-cache hit, whatever the chunking and batching;
only the requests that ask pay for them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.default_model import resolve_model
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tiny_models import dense_reference_logits, make_tiny_model

torch.set_num_threads(2)

ATOL = 1e-4
MODELS = {
    "llama": dict(arch="LlamaForCausalLM", tie=False, seed=21),
    "qwen2": dict(arch="Qwen2ForCausalLM", tie=True, seed=22),
    "qwen3": dict(arch="Qwen3ForCausalLM", tie=False, seed=23),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_model(root / name, **spec) for name, spec in MODELS.items()}


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _engine(model: Path | str | None, **kw) -> LLMEngine:
    # float32 unless asked: these compare with a float64 forward at a tight tolerance.
    return LLMEngine(EngineConfig(model=None if model is None else str(model), device="cpu", threads=2,
                                  kv_cache_gib=kw.pop("kv_cache_gib", 0.01), dtype=kw.pop("dtype", "float32"), **kw))


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: dict[str, SamplingParams]) -> dict[str, dict]:
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params[rid], request_id=rid)
    got: dict[str, dict] = {rid: {"prompt": None, "cached": 0} for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert got[out.request_id]["prompt"] is None, "prompt logprobs come once"
                got[out.request_id]["prompt"] = out.prompt_logprobs
            got[out.request_id]["cached"] = out.num_cached_tokens
    return got


def _assert_like_reference(scored, prompt: list[int], reference: torch.Tensor, k: int, atol: float) -> None:
    """``scored[i]``: the logprob of prompt[i] given prompt[:i], and the k most likely tokens there."""
    assert len(scored) == len(prompt) and scored[0] is None
    want = reference.log_softmax(-1)  # row p scores token p + 1
    for i in range(1, len(prompt)):
        lp = scored[i]
        assert lp.token_id == prompt[i]
        assert lp.logprob == pytest.approx(want[i - 1, prompt[i]].item(), abs=atol)
        top_ids = [t for t, _ in lp.top]
        assert len(top_ids) == k
        assert [v for _, v in lp.top] == pytest.approx(want[i - 1, top_ids].tolist(), abs=atol)
        if k:
            assert want[i - 1, top_ids[0]] == pytest.approx(want[i - 1].max().item(), abs=atol)


@pytest.mark.parametrize("name", list(MODELS))
def test_prompt_logprobs_equal_a_float64_dense_forward(model_dirs, name):
    model = model_dirs[name]
    prompts = {"long": _prompt(1, 90), "short": _prompt(2, 7), "plain": _prompt(3, 40)}
    params = {"long": SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
              "short": SamplingParams(temperature=0.7, seed=1, max_tokens=2, prompt_logprobs=0,
                                      repetition_penalty=1.3),  # raw: no penalty, no temperature
              "plain": SamplingParams(temperature=0, max_tokens=2)}
    # Chunks of 32 tokens: the long prompt is scored over three steps, beside the others.
    got = _run(_engine(model, max_num_batched_tokens=32), prompts, params)
    for rid in ("long", "short"):
        k = params[rid].prompt_logprobs
        _assert_like_reference(got[rid]["prompt"], prompts[rid], dense_reference_logits(model, prompts[rid]), k, ATOL)
    assert got["plain"]["prompt"] is None  # not asked: not computed


def test_a_prefix_cache_hit_does_not_lose_prompt_logprobs(model_dirs):
    model = model_dirs["llama"]
    prompt = _prompt(5, 70)
    engine = _engine(model, max_num_batched_tokens=32)
    warm = _run(engine, {"warm": prompt}, {"warm": SamplingParams(temperature=0, max_tokens=1)})
    assert warm["warm"]["prompt"] is None
    asked = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    # A second request shares the prefix while the first of them computes it.
    hit = _run(engine, {"hit": prompt, "partial": prompt[:50] + [7, 8]}, {"hit": asked, "partial": asked})
    fresh = _run(_engine(model, max_num_batched_tokens=32), {"hit": prompt}, {"hit": asked})
    assert hit["hit"]["cached"] == 0  # every position ran again here: none came from the cache
    for mine, theirs in zip(hit["hit"]["prompt"][1:], fresh["hit"]["prompt"][1:]):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    _assert_like_reference(hit["partial"]["prompt"], prompt[:50] + [7, 8],
                           dense_reference_logits(model, prompt[:50] + [7, 8]), 1, ATOL)
    # The one that did not ask still hits the cache the others filled.
    again = _run(engine, {"again": prompt}, {"again": SamplingParams(temperature=0, max_tokens=1)})
    assert again["again"]["cached"] > 0


def test_a_request_preempted_before_its_first_token_scores_each_token_once(model_dirs):
    model = model_dirs["qwen3"]
    prompts = {f"r{i}": _prompt(30 + i, 60) for i in range(4)}
    params = {rid: SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0) for rid in prompts}
    # A KV cache too small for all four at once: some are preempted and recomputed.
    engine = _engine(model, max_num_batched_tokens=48, kv_cache_gib=0.00023, block_size=16)
    got = _run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        _assert_like_reference(got[rid]["prompt"], prompt, dense_reference_logits(model, prompt), 0, ATOL)


def test_the_default_models_prompt_logprobs_equal_a_float64_dense_forward():
    engine = _engine(None, kv_cache_gib=0.05)
    prompt = engine.tokenize("The capital of France is Paris, and the capital of Italy is")
    got = _run(engine, {"r": prompt}, {"r": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)})
    # A float32 model over 30 layers: agreement to a few 1e-3 nats.
    _assert_like_reference(got["r"]["prompt"], prompt, dense_reference_logits(resolve_model(None), prompt), 1, 3e-3)
