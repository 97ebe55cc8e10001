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

import numpy as np

from cluster.policies.cost_model import DecodeStepModel, InstanceProfile, PrefillCostModel
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _run_alone(engine: LLMEngine) -> tuple[float, list[RequestOutput]]:
    """Seconds of the steps until the engine is idle (nothing else runs during calibration), and
    what they produced."""
    outputs = []
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs += engine.step()
    return time.perf_counter() - start, outputs


def profile(engine: LLMEngine, seed: int = 0) -> InstanceProfile:
    """Calibrate through the engine's public API only: requests in, step outputs and statistics out."""
    if engine.has_unfinished():
        raise RuntimeError("calibrate an idle engine")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    budget = engine.config.max_num_batched_tokens
    capacity = engine.stats().num_blocks * engine.config.block_size
    limit = min(budget, engine.max_model_len - 2, capacity // 2)
    lengths = sorted({max(8, n) for n in (32, limit // 4, limit // 2, limit)})
    ns, ps, ts = [], [], []
    _warm_up(engine, rng, vocab, one)
    for n in lengths:
        prompt = _prompt(rng, n, vocab)
        engine.add_request(prompt, one)
        ns.append(n), ps.append(0), ts.append(_run_alone(engine)[0])
        # The same prompt's first half is now cached: a request sharing it computes the rest.
        half = n // 2
        engine.add_request(prompt[:half] + _prompt(rng, n - half, vocab), one)
        t, (out,) = _run_alone(engine)
        ns.append(n), ps.append(out.num_cached_tokens), ts.append(t)
    prefill = PrefillCostModel.fit(ns, ps, ts)

    decode = None
    if engine.config.role != "prefill":
        rows, times = [], []
        for batch in (1, 4, 16):
            for context in (32, min(256, limit)):
                if batch * (context + 8) > capacity:
                    continue
                # One shared prompt but for its last token: the prefix cache keeps the prefills
                # cheap, and each sequence still attends over its whole context.
                shared = _prompt(rng, context - 1, vocab)
                generated = {}  # request id -> tokens generated so far
                for _ in range(batch):
                    rid = engine.add_request(shared + _prompt(rng, 1, vocab),
                                             SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                    generated[rid] = 0
                while not all(generated.values()):
                    for out in engine.step():  # the prefills
                        generated[out.request_id] += len(out.new_token_ids)
                step_times = []
                while engine.has_unfinished():
                    tokens = sum(context + n for n in generated.values())
                    start = time.perf_counter()
                    outputs = engine.step()
                    step_times.append(time.perf_counter() - start)
                    rows.append((1.0, batch, tokens))
                    for out in outputs:
                        generated[out.request_id] += len(out.new_token_ids)
                times.extend(step_times)
        coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=np.float64), np.asarray(times), rcond=None)
        base, per_seq, per_token = (float(max(c, 0.0)) for c in coef)
        decode = DecodeStepModel(base, per_seq, per_token, capacity)
    return InstanceProfile(prefill, decode)


def _warm_up(engine: LLMEngine, rng: random.Random, vocab: int, params: SamplingParams) -> None:
    # First steps pay for lazy allocations and kernel selection; keep them out of the fit.
    engine.add_request(_prompt(rng, 16, vocab), params)
    _run_alone(engine)
