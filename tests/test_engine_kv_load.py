"""Layer-wise KV loads into the engine (the KVCache pool's way in), on a tiny random checkpoint.

A prompt's prefix KV computed by one engine is handed to another through ``KVHandoff.add_loading``
with a stand-in ``KVLoad`` that serves it layer by layer: the output must equal computing it, the
layers must be taken in order before each layer runs, and a load that fails mid-way must end the
attempt cleanly with nothing published.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.disaggregation import KVHandoff
from tiny_models import make_tiny_model

BS = 16
PROMPT = [(7 * i + 3) % 200 + 10 for i in range(80)]  # 5 blocks; the last one always computes


class FakeLoad:
    def __init__(self, chunks: list[torch.Tensor], fail_at: int | None = None) -> None:
        self.chunks = chunks
        self.fail_at = fail_at
        self.layers: list[int] = []
        self.closed: list[bool] = []

    def layer(self, i: int) -> list[torch.Tensor] | None:
        self.layers.append(i)
        if i == self.fail_at:
            return None
        return [c[i : i + 1] for c in self.chunks]

    def close(self, used: bool) -> None:
        self.closed.append(used)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "LlamaForCausalLM", tie=False, seed=1)


def _engine(model: Path):
    return LLM(model=str(model), threads=1, kv_cache_gib=0.01, block_size=BS).engine


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(engine, rid: str):
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.fixture(scope="module")
def reference(model: Path):
    """The greedy tokens of PROMPT, and its first 4 blocks' KV as two 2-block chunks."""
    engine = _engine(model)
    engine.add_request(PROMPT, _params(), request_id="ref")
    tokens = [t for o in _run(engine, "ref") for t in o.new_token_ids]
    handoff = KVHandoff(engine)
    chunks = []
    for start in (0, 2):
        out = torch.empty(handoff.layout.shape(2), dtype=handoff.layout.torch_dtype)
        handoff.export_prefix(PROMPT, start, 2, out)
        chunks.append(out)
    return tokens, chunks


def _assert_idle(engine) -> None:
    assert not engine.seqs and not engine.has_unfinished()
    engine.block_manager.check_integrity()
    assert engine.block_manager.pool.num_in_use == 0


def test_loaded_prefix_gives_the_computed_output(model, reference):
    tokens, chunks = reference
    engine = _engine(model)
    handoff = KVHandoff(engine)
    load = FakeLoad(chunks)
    handoff.add_loading("r", PROMPT, _params(), 0, 4, load)
    outs = _run(engine, "r")
    assert [t for o in outs for t in o.new_token_ids] == tokens
    assert outs[-1].num_cached_tokens == 4 * BS  # what the pool served counts as cached
    assert load.layers == list(range(engine.model_config.num_layers)) and load.closed == [True]
    assert handoff.cached_prefix_blocks(PROMPT) == 5  # loaded blocks are published once in place
    _assert_idle(engine)


def test_load_skips_blocks_cached_meanwhile(model, reference):
    tokens, chunks = reference
    engine = _engine(model)
    handoff = KVHandoff(engine)
    engine.add_request(PROMPT[: 2 * BS + 1], _params(), request_id="warm")  # caches blocks 0-1
    _run(engine, "warm")
    assert handoff.cached_prefix_blocks(PROMPT) == 2
    # Poison the part of the load that is cached already: it must not be written.
    poisoned = [torch.full_like(chunks[0], float("nan")), chunks[1]]
    load = FakeLoad(poisoned)
    handoff.add_loading("r", PROMPT, _params(), 0, 4, load)
    outs = _run(engine, "r")
    assert [t for o in outs for t in o.new_token_ids] == tokens and load.closed == [True]
    _assert_idle(engine)


def test_failed_load_ends_the_attempt_and_publishes_nothing(model, reference):
    _, chunks = reference
    engine = _engine(model)
    handoff = KVHandoff(engine)
    load = FakeLoad(chunks, fail_at=1)
    handoff.add_loading("r", PROMPT, _params(), 0, 4, load)
    outs = _run(engine, "r")
    assert [(o.finished, o.finish_reason, o.new_token_ids) for o in outs] == [(True, "kv_load_failed", [])]
    assert load.layers == [0, 1] and load.closed == [False]
    assert handoff.cached_prefix_blocks(PROMPT) == 0  # nothing half-loaded is ever a hit
    _assert_idle(engine)


def test_load_that_cannot_attach_is_closed_unused_and_the_prompt_computes(model, reference):
    tokens, chunks = reference
    engine = _engine(model)
    handoff = KVHandoff(engine)
    load = FakeLoad(chunks[1:])  # blocks 2-3, but blocks 0-1 are not cached here
    handoff.add_loading("r", PROMPT, _params(), 2, 2, load)
    assert load.closed == [False]
    outs = _run(engine, "r")
    assert [t for o in outs for t in o.new_token_ids] == tokens and load.layers == []
    _assert_idle(engine)


def test_aborted_request_closes_its_load(model, reference):
    _, chunks = reference
    engine = _engine(model)
    load = FakeLoad(chunks)
    KVHandoff(engine).add_loading("r", PROMPT, _params(), 0, 4, load)
    assert engine.abort("r") and load.closed == [False]
    _assert_idle(engine)


def test_a_load_must_leave_the_last_token_to_compute(model, reference):
    _, chunks = reference
    engine = _engine(model)
    load = FakeLoad(chunks)
    with pytest.raises(ValueError):
        KVHandoff(engine).add_loading("r", PROMPT[: 4 * BS], _params(), 0, 4, load)
    assert load.closed == [False]
    _assert_idle(engine)
