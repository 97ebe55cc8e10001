"""Prefill -> decode KV streaming inside one process: two engines, two Messengers, real transfers.

The decode engine reserves blocks and a staging range, the prefill engine streams each layer's
KV there as the layer finishes, and the decode engine scatters it into its pages and continues.
Checked: the KV that lands equals the KV the prefill computed (page by page), the continuation
equals a colocated engine's, prefix blocks the decode side already holds are not resent, and
every block and staging range is returned.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.kv_stream import KVDestination, KVSender, PrefillSink, PrefillSinks
from cluster.messenger.staging import StagingArea, StagingFull
from cluster.messenger import MessengerConfig, Messenger, TransferError
from engine.config import EngineConfig
from engine.disaggregation import KVCapacityError, KVHandoff
from engine.kv_layout import KVLayout
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

SECRET = b"kv stream test cluster secret"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "Qwen3ForCausalLM", tie=False, seed=3))


def _engine(model: str, role: str, num_blocks_gib: float = 0.01) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", role=role, kv_cache_gib=num_blocks_gib,
                                  threads=1, max_num_batched_tokens=64))


@pytest.fixture(params=["shm", "tcp"])
def pair(request, model):
    prefill, decode = _engine(model, "prefill"), _engine(model, "decode")
    tp = Messenger(MessengerConfig(secret=SECRET, transport=request.param))
    td = Messenger(MessengerConfig(secret=SECRET, transport=request.param))
    layout = KVLayout.of_cache(prefill.runner.kv_cache)
    send, recv = StagingArea(tp, 1 << 22), StagingArea(td, 1 << 22)
    sender = KVSender(tp, send, layout)
    prefill.kv_sinks.append(sender)
    yield prefill, decode, sender, recv, td, layout
    for e in (prefill, decode):
        assert not e.has_unfinished() and not e.seqs
        assert e.block_manager.pool.num_in_use == 0
        e.block_manager.check_integrity()
    assert send.num_allocated == 0 and recv.num_allocated == 0
    send.check(), recv.check()
    tp.close(), td.close()


def _handoff(prefill, decode, sender, recv, td, layout, rid, prompt, params):
    """Reserve on decode, prefill with streaming, admit on decode; returns the prefill output and
    the prefill's block ids (still cached there) and the decode's."""
    res = KVHandoff(decode).reserve(rid, prompt, params)
    n = len(res.block_ids) - res.cached_blocks
    staging = recv.allocate(layout.nbytes(n)) if n else None
    dest = KVDestination(td.address, recv.handle, staging.offset if staging else 0, res.cached_blocks, n)
    sender.expect(rid, dest)
    prefill.add_request(prompt, params, request_id=rid)
    prefill_blocks = []
    original = sender.layer_done

    def spy(layer, kv_cache, chunks):
        (chunk,) = chunks
        if layer == 0:
            chunk_log.append((chunk.start, chunk.end))
        if chunk.last and layer == 0:
            prefill_blocks.extend(chunk.block_ids)
        original(layer, kv_cache, chunks)
        written.append(len(sender._out[rid].batches))

    chunk_log: list[tuple[int, int]] = []
    written: list[int] = []
    sender.layer_done = spy
    outs = []
    while prefill.has_unfinished():
        outs.extend(prefill.step())
    sender.layer_done = original
    report = asyncio.run(sender.finish(rid, 10.0))
    assert report.bytes_sent == layout.nbytes(n)
    (out,) = outs
    assert out.finished and out.finish_reason == "handoff" and len(out.new_token_ids) == 1
    kv = recv.view(staging, decode.runner.kv_cache.dtype, layout.shape(n)) if staging else None
    KVHandoff(decode).admit(rid, kv, out.new_token_ids[0], out.sampler_state, out.num_cached_tokens)
    if staging:
        recv.release(staging)
    steps = len(written) // layout.num_layers
    # One or more writes in each step that completed a block, from the first (a cached prefix
    # goes with it) to the last, not all at the end.
    per_step = [written[(i + 1) * layout.num_layers - 1] - (written[i * layout.num_layers - 1] if i else 0)
                for i in range(steps)]
    for (start, end), w in zip(chunk_log, per_step):
        completes = end == len(prompt) or end // 16 > max(start // 16, res.cached_blocks)
        assert (w > 0) == (completes and n > 0), (chunk_log, per_step)
    return out, prefill_blocks, res


def _run(engine):
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def _assert_landed(prefill, decode, rid, prompt, p_blocks):
    """The KV that landed equals the KV the prefill computed, block by block, every layer."""
    d_blocks = decode.seqs[rid].block_table.block_ids
    pk, dk = prefill.runner.kv_cache, decode.runner.kv_cache
    full = len(prompt) // 16
    torch.testing.assert_close(dk[:, :, d_blocks[:full]], pk[:, :, p_blocks[:full]], rtol=0, atol=0)
    tail = len(prompt) % 16  # the partial block: only its first `tail` slots are the prompt's
    if tail:
        torch.testing.assert_close(dk[:, :, d_blocks[full], :, :tail], pk[:, :, p_blocks[full], :, :tail],
                                   rtol=0, atol=0)


def _continues_like_colocated(model, out, decode, rid, prompt, params):
    """The decode instance's continuation of ``rid`` is the colocated engine's."""
    decoded = [out.new_token_ids[0]] + _run(decode)[rid]
    colocated = _engine(model, "both")
    colocated.add_request(prompt, params, request_id="c")
    assert decoded == _run(colocated)["c"]


def test_received_kv_equals_computed_and_output_matches_colocated(pair, model):
    prefill, decode, sender, recv, td, layout = pair
    prompt = list(range(5, 5 + 53))  # 3 full blocks of 16 and a partial one
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out, p_blocks, res = _handoff(prefill, decode, sender, recv, td, layout, "r1", prompt, params)
    assert res.cached_blocks == 0 and len(res.block_ids) == 4
    _assert_landed(prefill, decode, "r1", prompt, p_blocks)

    _continues_like_colocated(model, out, decode, "r1", prompt, params)


@pytest.mark.parametrize("length", [63, 64, 65, 150, 256])
def test_a_long_prompt_streams_chunk_by_chunk_and_lands_bit_equal(pair, model, length):
    # The step budget is 64 tokens: one chunk, exactly one, one and a token, three, four.
    prefill, decode, sender, recv, td, layout = pair
    prompt = [(7 * i + length) % 250 + 3 for i in range(length)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out, p_blocks, _ = _handoff(prefill, decode, sender, recv, td, layout, "long", prompt, params)
    _assert_landed(prefill, decode, "long", prompt, p_blocks)
    _continues_like_colocated(model, out, decode, "long", prompt, params)


def test_chunks_after_prefix_hits_on_both_sides_land_bit_equal(pair, model):
    # The prefill instance caches 80 tokens of the prompt (5 blocks) and the decode instance 48
    # (3 blocks): the first chunk starts at token 80 and sends blocks 3 and 4 with its own.
    prefill, decode, sender, recv, td, layout = pair
    prompt = [(11 * i) % 240 + 5 for i in range(230)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prefill.add_request(prompt[:81], SamplingParams(max_tokens=1), request_id="warm-p")
    decode.add_request(prompt[:49], SamplingParams(max_tokens=1), request_id="warm-d")
    _run(prefill), _run(decode)
    out, p_blocks, res = _handoff(prefill, decode, sender, recv, td, layout, "hit", prompt, params)
    assert res.cached_blocks == 3 and out.num_cached_tokens == 80
    _assert_landed(prefill, decode, "hit", prompt, p_blocks)
    _continues_like_colocated(model, out, decode, "hit", prompt, params)


def test_cached_prefix_is_not_resent_and_seeded_sampling_continues(pair, model):
    prefill, decode, sender, recv, td, layout = pair
    shared = list(range(100, 100 + 48))
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)
    results = []
    for i, suffix in enumerate(([1, 2, 3, 4, 5], [9, 8, 7])):
        out, _, res = _handoff(prefill, decode, sender, recv, td, layout, f"s{i}", shared + suffix, params)
        results.append(((out.new_token_ids[0], *_run(decode)[f"s{i}"]), res))
    # The second request's three shared blocks were already on the decode instance: not sent.
    assert results[0][1].cached_blocks == 0 and results[1][1].cached_blocks == 3
    colocated = _engine(model, "both")
    for i, suffix in enumerate(([1, 2, 3, 4, 5], [9, 8, 7])):
        colocated.add_request(shared + suffix, params, request_id=f"c{i}")
    expected = _run(colocated)
    assert [list(r[0]) for r in results] == [expected["c0"], expected["c1"]]


def test_reserve_without_room_raises_and_leaks_nothing(pair, model):
    kv = pair[1].runner.kv_cache
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    decode = _engine(model, "decode", 20 * block_bytes / (1 << 30))  # a 20-block cache
    total = decode.block_manager.num_blocks
    assert total == 20
    half = [(7 * i) % 200 for i in range(16 * (total // 2 + 1))]  # more than half of the blocks
    held = KVHandoff(decode).reserve("held", half, SamplingParams(max_tokens=1))
    with pytest.raises(KVCapacityError):
        KVHandoff(decode).reserve("big", half[::-1], SamplingParams(max_tokens=1))
    assert "big" not in decode.seqs
    assert decode.block_manager.pool.num_in_use == len(held.block_ids)
    assert decode.abort("held")
    assert decode.block_manager.pool.num_in_use == 0


def test_staging_allocator_first_fit_merges_and_refuses():
    with Messenger(MessengerConfig(secret=SECRET, transport="tcp")) as te:
        area = StagingArea(te, 1024)
        a, b, c = area.allocate(100, owner="a"), area.allocate(200, owner="b"), area.allocate(300)
        assert (a.offset, b.offset, c.offset) == (0, 128, 384)
        assert [owner for owner, _ in area.holders()] == ["a", "b", ""]  # oldest first
        assert all(0 <= held_s < 60 for _, held_s in area.holders())
        with pytest.raises(StagingFull):
            area.allocate(400)
        area.release(b)
        assert [owner for owner, _ in area.holders()] == ["a", ""]
        assert area.allocate(150).offset == 128  # first fit reuses the hole
        area.release(a)
        with pytest.raises(ValueError):
            area.release(a)
        with pytest.raises(ValueError):
            area.allocate(2048)
        area.check()
        for r in list(area._used):
            area.release(type(a)(r, 1))
        area.check()
        assert area.num_free_bytes == 1024 and area.allocate(1024).offset == 0


def test_bench_kv_stream_runs_both_ways(model, capsys):
    from bench.kv_stream import main

    assert main(["--model", model, "--steps", "3", "--budget", "64", "--transports", "shm"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("shm")]
    assert [r[1] for r in rows] == ["per", "last"]  # streamed per chunk, and the baseline
    for r in rows:
        assert r[-8] == "192" and float(r[-3]) >= 0  # prompt tokens; in flight at the end, in chunks
    assert "Target: in flight at the end about one chunk's bytes" in out


class _Sink(PrefillSink):
    """Notes each call in ``log``; ``fails``: the call that raises."""

    def __init__(self, name: str, log: list[str], fails: str | None = None) -> None:
        self.name, self.log, self.fails = name, log, fails

    async def _call(self, what: str) -> None:
        self.log.append(f"{what} {self.name}")
        if what == self.fails:
            raise TransferError(f"{self.name} failed to {what}")

    async def expect(self) -> None:
        await self._call("expect")

    async def finish(self) -> None:
        await self._call("finish")

    async def abort(self) -> None:
        await self._call("abort")


def test_sinks_expect_finish_and_abort_as_one():
    async def run(fails: dict[str, str], then: str) -> tuple[list[str], str | None]:
        log: list[str] = []
        sinks = PrefillSinks([_Sink(n, log, fails.get(n)) for n in ("decode", "stages", "pool")])
        try:
            await sinks.expect()
            await (sinks.finish() if then == "finish" else sinks.abort())
        except TransferError as exc:
            return log, str(exc)
        return log, None

    assert asyncio.run(run({}, "finish")) == (
        ["expect decode", "expect stages", "expect pool", "finish decode", "finish stages", "finish pool"], None)
    assert asyncio.run(run({}, "abort"))[0][3:] == ["abort decode", "abort stages", "abort pool"]
    # A sink that cannot expect holds nothing: only the ones before it are aborted.
    assert asyncio.run(run({"stages": "expect"}, "finish")) == (
        ["expect decode", "expect stages", "abort decode"], "stages failed to expect")
    # A stream that did not land: the sinks after it are aborted (the pool stores nothing of it).
    assert asyncio.run(run({"decode": "finish"}, "finish")) == (
        ["expect decode", "expect stages", "expect pool", "finish decode", "abort stages", "abort pool"],
        "decode failed to finish")
