"""Engine regressions on a tiny random checkpoint (fast on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

import mooncake_kernels as kernels
from engine import LLM, SamplingParams
from engine.disaggregation import KVHandoff
from engine.scheduler import ScheduledSeq
from tiny_models import MAX_POSITIONS, make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny"), "LlamaForCausalLM", tie=False, seed=0)
    return LLM(model=str(folder), threads=1, kv_cache_gib=0.01, block_size=16, dtype="float32")


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def assert_engine_idle(llm: LLM) -> None:
    engine = llm.engine
    assert engine.seqs == {} and not engine.has_unfinished()
    engine.block_manager.check_integrity()
    assert engine.block_manager.pool.num_in_use == 0


def test_generate_with_an_invalid_prompt_queues_none(llm: LLM) -> None:
    # The second prompt's max_tokens does not fit the context; the first was fine.
    batch = [params(4), SamplingParams(max_tokens=MAX_POSITIONS), params(4)]
    with pytest.raises(ValueError, match="exceeds the model's context"):
        llm.generate(["w5 w6 w7", "w8 w9", "w10 w11"], batch)
    assert_engine_idle(llm)
    generated = llm.engine.num_generated_tokens
    [out] = llm.generate("w12 w13", params(3))
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert llm.engine.num_generated_tokens - generated == 3  # nothing of the failed batch ran
    assert_engine_idle(llm)


def test_generate_interrupted_leaves_nothing_queued(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    step = engine.step
    calls = 0

    def failing_step():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["w5 w6 w7", "w8 w9"], params(8))
    monkeypatch.undo()
    assert_engine_idle(llm)
    [out] = llm.generate("w12 w13", params(2))
    assert len(out.token_ids) == 2


def test_decodes_past_the_decode_workspace_are_refused_before_the_kernel(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=False, seed=3)
    before = kernels.mode()
    kernels.set_mode("triton")  # the Triton path sizes a decode workspace by max_num_seqs
    try:
        engine = LLM(model=str(folder), threads=1, kv_cache_gib=0.002, block_size=16, max_num_seqs=2, dtype="float32").engine
    finally:
        kernels.set_mode(before)
    assert engine.runner.decode_workspace is not None
    batch = []
    for _ in range(3):
        seq = engine.new_sequence([5, 6, 7], params(4), None)
        engine.block_manager.grow(seq.block_table, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
        batch.append(ScheduledSeq(seq, 1))
    with pytest.raises(RuntimeError, match="max_num_seqs = 2"):
        engine.runner.prepare(batch)
    engine.runner.prepare(batch[:2])


def test_decode_instance_admitting_past_max_num_seqs_decodes_them_in_turns(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=False, seed=3)
    before = kernels.mode()
    kernels.set_mode("triton")  # decode attention through its workspace, sized by max_num_seqs
    try:
        engine = LLM(model=str(folder), threads=1, kv_cache_gib=0.002, block_size=16, max_num_seqs=2, dtype="float32",
                     role="decode").engine
        handoff = KVHandoff(engine)
        rids = [f"r{i}" for i in range(5)]
        for i, rid in enumerate(rids):
            handoff.reserve(rid, [5 + i, 6, 7], params(3))
            handoff.admit(rid, None, 9, None, 0)  # KV contents do not matter here
        finished = []
        while engine.has_unfinished():
            outs = engine.step()
            assert len(outs) <= 2
            finished += [o.request_id for o in outs if o.finished]
    finally:
        kernels.set_mode(before)
    assert sorted(finished) == rids
    assert not engine.seqs and engine.block_manager.pool.num_in_use == 0
