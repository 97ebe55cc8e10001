"""Calibrating the Conductor's cost models on the instance itself, at start.

FAST'25 predicts TTFT with a prefill-time model fitted on offline profiling (§5.1); we profile
each instance when it starts, on its own engine, so the Conductor's predictions are in this
machine's seconds. Prefill: prompts of a few lengths, each from scratch and again behind a cached
prefix, timed as the engine step that computes them (``PrefillCostModel.fit``). Decode: steps of
batches of a few sizes and contexts (a least-squares fit of ``DecodeStepModel``).

Runs on the engine thread (``AsyncLLMEngine.call``) before the instance takes requests. Profile
prompts are random token ids; their blocks stay in the prefix cache as ordinary evictable blocks.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.cost_model import DecodeStepModel, PrefillCostModel
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class InstanceProfile:
    """An instance's measured time models (decode is None on a prefill-only instance)."""

    prefill: PrefillCostModel
    decode: DecodeStepModel | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill.__dict__,
            "decode": None if self.decode is None else self.decode.__dict__,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceProfile:
        decode = data.get("decode")
        return cls(PrefillCostModel(**data["prefill"]), None if decode is None else DecodeStepModel(**decode))


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _run_alone(engine: LLMEngine) -> float:
    """Seconds of the steps until the engine is idle (nothing else runs during calibration)."""
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def profile(engine: LLMEngine, seed: int = 0) -> InstanceProfile:
    if engine.has_unfinished() or engine.seqs:
        raise RuntimeError("calibrate an idle engine")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    budget = engine.config.max_num_batched_tokens
    limit = min(budget, engine.max_model_len - 2, engine.block_manager.num_blocks * engine.config.block_size // 2)
    lengths = sorted({max(8, n) for n in (32, limit // 4, limit // 2, limit)})
    ns, ps, ts = [], [], []
    _warm_up(engine, rng, vocab, one)
    for n in lengths:
        prompt = _prompt(rng, n, vocab)
        engine.add_request(prompt, one)
        ns.append(n), ps.append(0), ts.append(_run_alone(engine))
        # The same prompt's first half is now cached: a request sharing it computes the rest.
        half = n // 2
        engine.add_request(prompt[:half] + _prompt(rng, n - half, vocab), one)
        cached = engine.scheduler.num_prompt_tokens_hit
        t = _run_alone(engine)
        hit = engine.scheduler.num_prompt_tokens_hit - cached
        ns.append(n), ps.append(hit), ts.append(t)
    prefill = PrefillCostModel.fit(ns, ps, ts)

    decode = None
    if engine.config.role != "prefill":
        rows, times = [], []
        for batch in (1, 4, 16):
            for context in (32, min(256, limit)):
                if batch * (context + 8) > engine.block_manager.num_blocks * engine.config.block_size:
                    continue
                # One shared prompt but for its last token: the prefix cache keeps the prefills
                # cheap, and each sequence still attends over its whole context.
                shared = _prompt(rng, context - 1, vocab)
                for _ in range(batch):
                    engine.add_request(shared + _prompt(rng, 1, vocab), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                while any(s.num_output_tokens == 0 for s in engine.seqs.values()):
                    engine.step()  # the prefills
                step_times = []
                while engine.has_unfinished():
                    tokens = sum(s.num_tokens for s in engine.seqs.values())
                    start = time.perf_counter()
                    engine.step()
                    step_times.append(time.perf_counter() - start)
                    rows.append((1.0, batch, tokens))
                times.extend(step_times)
        coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=np.float64), np.asarray(times), rcond=None)
        base, per_seq, per_token = (float(max(c, 0.0)) for c in coef)
        capacity = engine.block_manager.num_blocks * engine.config.block_size
        decode = DecodeStepModel(base, per_seq, per_token, capacity)
    return InstanceProfile(prefill, decode)


def _warm_up(engine: LLMEngine, rng: random.Random, vocab: int, params: SamplingParams) -> None:
    # First steps pay for lazy allocations and kernel selection; keep them out of the fit.
    engine.add_request(_prompt(rng, 16, vocab), params)
    _run_alone(engine)
