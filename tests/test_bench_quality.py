"""bench.quality's scoring on a tiny model (``python -m bench.quality`` runs the default model in
each precision; seconds each, but a model load each)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from bench import quality
from engine import LLM
from tiny_models import dense_reference_logits, make_tiny_model


def test_the_bundled_sets_are_well_formed():
    questions = quality.load_questions()
    assert len(questions) == 32 and all(len(q["choices"]) == 4 for q in questions)
    assert len({q["answer"] for q in questions}) == 4  # the right answer is not always in one place
    assert len((quality.DATA / "held_text.txt").read_text().split()) > 400


def test_scores_are_the_answers_log_likelihoods(tmp_path):
    model = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=True, seed=5)
    llm = LLM(str(model), threads=1, kv_cache_gib=0.01, dtype="float32")
    questions = [{"question": "a b c", "choices": ["d", "e f", "g"], "answer": 1},
                 {"question": "h", "choices": ["i", "j"], "answer": 0}]
    got = quality.evaluate(llm, "float32", questions, "k l m n o p")
    tok = llm.tokenizer
    for qi, q in enumerate(questions):
        context = tok.encode(f"Question: {q['question']}\nAnswer:")
        sums = []
        for choice in q["choices"]:
            answer = tok.encode(" " + choice, add_special_tokens=False)
            ids = context + answer
            lp = dense_reference_logits(model, ids).log_softmax(-1)
            sums.append(sum(lp[p - 1, ids[p]].item() for p in range(len(context), len(ids))))
        assert got.choices[qi] == max(range(len(sums)), key=sums.__getitem__)
    held = tok.encode("k l m n o p")
    lp = dense_reference_logits(model, held).log_softmax(-1)
    want = [lp[p - 1, held[p]].item() for p in range(1, len(held))]
    assert got.text_logprobs == pytest.approx(want, abs=1e-4)
    assert got.perplexity == pytest.approx(math.exp(-sum(want) / len(want)), rel=1e-4)
    text = quality.report([got, got])
    assert "1.0000" in text and "float32" in text


def test_cold_and_warm_counts_the_questions_whose_answers_differ(monkeypatch):
    questions = [{"question": q, "choices": ["d", "e"], "answer": 0}
                 for q in ("What is the capital of France?", "Is ice cold?", "Name a colour.")]
    llm = LLM(threads=1, kv_cache_gib=0.05, deterministic=True)
    prompts = quality.one_row_prompts(llm, questions)
    assert all(len(p) % llm.engine.config.block_size == 1 for p in prompts)
    assert quality.cold_and_warm(llm, questions, max_tokens=4) == 0
    with pytest.raises(RuntimeError, match="fresh"):
        quality.cold_and_warm(llm, questions, max_tokens=4)  # now cached: no cold run left

    class Drifting:
        """An engine whose warm answer to the second question is another."""
        def __init__(self):
            self.calls = 0

        def generate(self, prompts, params):
            self.calls += 1
            return [SimpleNamespace(num_cached_tokens=0 if self.calls == 1 else len(p) - 1,
                                    token_ids=[1, 3] if i == 1 and self.calls == 2 else [1, 2])
                    for i, p in enumerate(prompts)]

    monkeypatch.setattr(quality, "one_row_prompts", lambda llm, qs: [[7] * 17 for _ in qs])
    assert quality.cold_and_warm(Drifting(), questions) == 1
