"""Pipeline stages of the model: each stage holds a contiguous range of the layers (and their KV);
the stages chained, each on the hidden states of the one before, compute what the whole model
does, bit for bit, in a prefill and the decode step after it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cluster.protocol import StageStepCall
from engine.config import EngineConfig
from engine.hooks import PromptChunk, StageLoad
from engine.model import stage_layers
from engine.model_runner import ModelRunner, StageStep
from engine.scheduler import ScheduledSeq
from tests.tiny_models import make_tiny_model


def test_stage_layers_split_contiguously_and_evenly():
    assert [stage_layers(30, i, 2) for i in range(2)] == [range(0, 15), range(15, 30)]
    assert [stage_layers(3, i, 2) for i in range(2)] == [range(0, 1), range(1, 3)]
    assert [len(stage_layers(31, i, 4)) for i in range(4)] == [7, 8, 8, 8]
    with pytest.raises(ValueError):
        stage_layers(2, 0, 3)  # more stages than layers
    with pytest.raises(ValueError):
        EngineConfig(device="cpu", role="both", stage=(0, 2))  # only prefill instances are staged


def test_a_step_crosses_to_the_next_stage_with_its_chunks_and_loads():
    """A step's prompt chunks and KV loads travel as plain data and arrive typed, as they left."""
    step = StageStep(step_id=3, positions=[0, 1], slot_mapping=[0, 1], num_decodes=0, decode_block_tables=[],
                     decode_seq_lens=[], prefill_block_tables=[[0]], prefill_seq_lens=[2],
                     prefill_query_start_loc=[0, 2], rows=[1], chunks=[PromptChunk("r", [4, 5], 16, 18, 18)],
                     loads=[StageLoad("r", [4], 1)])
    wire = json.loads(json.dumps(StageStepCall(step.to_dict()).to_dict()))
    assert StageStep.from_dict(StageStepCall.from_dict(wire).step) == step


def _runner(model: Path, stage: tuple[int, int] | None) -> ModelRunner:
    config = EngineConfig(model=str(model), device="cpu", threads=1, kv_cache_gib=0.002,
                          role="prefill" if stage else "both", stage=stage)
    return ModelRunner(config, model, 256)


def _step(runners: list[ModelRunner], batch: list[ScheduledSeq]) -> torch.Tensor:
    """The logits of ``batch`` through ``runners`` in order (one runner: the whole model)."""
    hidden = None
    for runner in runners:
        input_ids, positions, meta, ordered = runner.prepare(batch)
        rows = [sum(s.num_new_tokens for s in ordered) - 1]
        with torch.inference_mode():
            out = runner.model(input_ids if hidden is None else None, positions, meta,
                               torch.tensor(rows), hidden=hidden)
        hidden = out
    return out


@pytest.mark.parametrize("arch,tie,stages", [("Qwen3ForCausalLM", False, 3), ("Qwen3ForCausalLM", True, 2),
                                             ("LlamaForCausalLM", True, 2)])
def test_chained_stages_equal_the_whole_model(tmp_path, arch, tie, stages):
    model = make_tiny_model(tmp_path / "m", arch, tie=tie, seed=5)
    whole = _runner(model, None)
    parts = [_runner(model, (i, stages)) for i in range(stages)]
    # Each stage holds only its layers' weights and KV; every stage has the same blocks.
    assert sum(p.kv_cache.shape[0] for p in parts) == whole.kv_cache.shape[0]
    assert len({p.num_blocks for p in parts}) == 1
    assert parts[0].model.embed is not None and parts[-1].model.embed is None
    assert parts[-1].model.norm is not None and parts[0].model.norm is None

    prompt = [(13 * i) % 200 + 3 for i in range(40)]
    seq = SimpleNamespace(token_ids=list(prompt), num_computed_tokens=0, num_tokens=len(prompt),
                          block_table=SimpleNamespace(block_ids=[2, 0, 1]))
    steps = [ScheduledSeq(seq, len(prompt))]
    for _ in range(2):  # the prefill, then one decode step on the KV it left
        want, got = _step([whole], steps), _step(parts, steps)
        assert torch.equal(want, got)
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(int(want.argmax()))
        seq.num_tokens += 1
        steps = [ScheduledSeq(seq, 1)]
    # The KV each stage holds in the prompt's blocks is the whole model's for its layers.
    used = seq.block_table.block_ids
    for p in parts:
        r = p.model.layer_range
        assert torch.equal(p.kv_cache[:, :, used], whole.kv_cache[r.start : r.stop, :, used])


class _ThreadedStages:
    """The stages after the first, each on its own thread, steps handed on in order (what the
    cluster's stage link does across processes). Records (stage, step id, start, end).

    The second stage holds each step k that samples nothing until the first stage has started
    step k + 1, so that whether they overlap depends on the first stage not waiting for step k, not
    on how the threads happen to be scheduled (a step that samples is waited for by the first
    stage, and a prompt's chunk that samples nothing always has a next one). The bound is only a
    guard: a first stage that waited for such a step would stall this one 10 s and fail the test."""

    def __init__(self, runners: list[ModelRunner]) -> None:
        import queue
        import threading

        self.events: list[tuple[int, int, str]] = []
        self._lock = threading.Condition()
        self._queues = [queue.SimpleQueue() for _ in runners]
        self._threads = [threading.Thread(target=self._loop, args=(i, r), daemon=True) for i, r in enumerate(runners)]
        for t in self._threads:
            t.start()

    def _note(self, stage: int, step: int, what: str) -> None:
        with self._lock:
            self.events.append((stage, step, what))
            self._lock.notify_all()

    def _loop(self, i: int, runner: ModelRunner) -> None:
        while True:
            item = self._queues[i].get()
            if item is None:
                return
            step, hidden, future = item
            self._note(i + 1, step.step_id, "start")
            if i == 0 and not step.rows:
                with self._lock:
                    self._lock.wait_for(lambda: (0, step.step_id + 1, "start") in self.events, timeout=10.0)
            try:
                out = runner.run_stage(step, hidden)
            except BaseException as exc:  # noqa: BLE001 -- the first stage gets it
                future.set_exception(exc)
                continue
            self._note(i + 1, step.step_id, "end")
            if i + 1 < len(self._queues):
                self._queues[i + 1].put((step, out, future))
            else:
                future.set_result(out if step.rows else None)

    def send(self, step, hidden):
        from concurrent.futures import Future

        future: Future = Future()
        self._queues[0].put((step, hidden, future))
        return future

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)


def test_a_pipelined_engine_answers_as_the_whole_model_and_overlaps_chunks(tmp_path):
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    model = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=False, seed=9)

    def engine(stage):
        return LLMEngine(EngineConfig(model=str(model), device="cpu", threads=1, kv_cache_gib=0.002, role="prefill",
                                      max_num_batched_tokens=32, stage=stage))

    whole, first = engine(None), engine((0, 3))
    stages = _ThreadedStages([_runner(model, (i, 3)) for i in (1, 2)])
    first.runner.downstream = stages
    recorded = []
    original = first.runner.model.forward

    def spy(*args, **kwargs):  # the first stage's own layers, one step each
        step = first.runner._steps  # the step being sent on: numbered before the model runs
        stages._note(0, step, "start")
        out = original(*args, **kwargs)
        stages._note(0, step, "end")
        return out

    first.runner.model.forward = spy
    try:
        prompts = {"short": [5, 9, 13], "long": [(7 * i) % 200 + 3 for i in range(150)],
                   "mid": [(3 * i) % 190 + 4 for i in range(40)]}
        for params in (SamplingParams(temperature=0, max_tokens=1),
                       SamplingParams(temperature=0.9, seed=4, max_tokens=1)):
            for e in (whole, first):
                for rid, prompt in prompts.items():
                    e.add_request(prompt, params, request_id=rid)
            got = {}
            for e, into in ((whole, {}), (first, got)):
                while e.has_unfinished():
                    for o in e.step():
                        into.setdefault(o.request_id, []).extend(o.new_token_ids)
                recorded.append(into)
        assert recorded[0] == recorded[1] and recorded[2] == recorded[3]  # first tokens, greedy and seeded
    finally:
        stages.close()
    # Some step k ran on stage 1 while the first stage already computed step k + 1.
    order = {ev: i for i, ev in enumerate(stages.events)}
    overlapped = [k for stage, k, what in stages.events if stage == 1 and what == "end" and (0, k + 1, "end") in order
                  and order[(1, k, "start")] < order[(0, k + 1, "end")]
                  and order[(0, k + 1, "start")] < order[(1, k, "end")]]
    assert overlapped, stages.events  # the whole list: which steps sampled, and who waited


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_stages_linked_by_the_messenger_answer_as_the_whole_model(tmp_path, transport):
    from cluster.cpp.stage import StageLink, StageWorker
    from cluster.messenger import MessengerConfig, Messenger
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    model = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=True, seed=11)
    secret = b"stage link test secret 0123456789"
    engines = [Messenger(MessengerConfig(secret=secret, transport=transport)) for _ in range(3)]

    def engine(stage):
        return LLMEngine(EngineConfig(model=str(model), device="cpu", threads=1, kv_cache_gib=0.002, role="prefill",
                                      max_num_batched_tokens=32, stage=stage))

    whole, first = engine(None), engine((0, 3))
    link = StageLink(engines[0], 1 << 20)
    workers = [StageWorker(_runner(model, (i, 3)), engines[i], 1 << 20) for i in (1, 2)]
    link.next, workers[0].next, workers[1].first = workers[0].peer, workers[1].peer, link.peer
    first.runner.downstream = link
    try:
        prompts = {"short": [5, 9, 13], "long": [(7 * i) % 200 + 3 for i in range(150)]}
        for params in (SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0.9, seed=4, max_tokens=1)):
            got = []
            for e in (whole, first):
                for rid, prompt in prompts.items():
                    e.add_request(prompt, params, request_id=rid)
                tokens = {}
                while e.has_unfinished():
                    for o in e.step():
                        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                got.append(tokens)
            assert got[0] == got[1]
    finally:
        for w in workers:
            w.close()
        for t in engines:
            t.close()


def test_a_step_the_next_stage_cannot_take_fails_naming_that_stage(tmp_path):
    """The request's error names the stage as the group's watcher does ("pipeline stage 1"),
    whichever of the two sees a dead stage first."""
    from cluster.cpp.stage import StageLink, StageWorker
    from cluster.messenger import MessengerConfig, Messenger
    from cluster.messenger.errors import TransferError

    model = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=True, seed=11)
    ends = [Messenger(MessengerConfig(secret=b"stage link test secret 0123456789", transport="tcp"))
            for _ in range(2)]
    link = StageLink(ends[0], 1 << 20, timeout_s=2.0)
    worker = StageWorker(_runner(model, (1, 2)), ends[1], 1 << 20)
    link.next, link.followers = worker.peer, [worker.peer]
    worker.close()
    ends[1].close()  # the later stage is gone
    try:
        step = StageStep(step_id=7, positions=[0], slot_mapping=[0], num_decodes=0, decode_block_tables=[],
                         decode_seq_lens=[], prefill_block_tables=[[0]], prefill_seq_lens=[1],
                         prefill_query_start_loc=[0, 1], rows=[0])
        with pytest.raises(TransferError, match=r"pipeline stage 1 \(.+\) did not take step 7"):
            link.send(step, (torch.zeros(1, 8), torch.zeros(1, 8))).result(10)
    finally:
        ends[0].close()


class _LastChunkBlocks:
    """A KV sink that notes the blocks of a prompt's last chunk."""

    blocks: list[int] = []

    def wants(self, request_id: str) -> bool:
        return True

    def layer_done(self, layer, kv_cache, chunks) -> None:
        for chunk in chunks:
            if chunk.last:
                self.blocks = chunk.block_ids


def test_every_stage_streams_its_layers_to_the_decode_instance(tmp_path):
    import asyncio

    from cluster.kv_stream import KVDestination, KVSender
    from cluster.cpp.stage import StageLink, StageWorker
    from cluster.messenger.staging import StagingArea
    from cluster.messenger import MessengerConfig, Messenger
    from engine.disaggregation import KVHandoff
    from engine.kv_layout import KVLayout
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    model = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=False, seed=13)
    secret = b"stage link test secret 0123456789"
    transfers = [Messenger(MessengerConfig(secret=secret, transport="shm")) for _ in range(4)]

    def engine(role, stage=None):
        return LLMEngine(EngineConfig(model=str(model), device="cpu", threads=1, kv_cache_gib=0.002, role=role,
                                      max_num_batched_tokens=32, stage=stage))

    first, decode = engine("prefill", (0, 3)), engine("decode")
    wire = KVLayout.of_cache(decode.runner.kv_cache)  # every layer: what the decode instance receives
    layers = [stage_layers(wire.num_layers, i, 3) for i in range(3)]
    senders = [KVSender(t, StagingArea(t, 1 << 22), wire, layers=r) for t, r in zip(transfers, layers)]
    first.kv_sinks.append(senders[0])
    link = StageLink(transfers[0], 1 << 20)
    workers = [StageWorker(_runner(model, (i, 3)), transfers[i], 1 << 20, sender=senders[i]) for i in (1, 2)]
    link.next, workers[0].next, workers[1].first = workers[0].peer, workers[1].peer, link.peer
    link.followers = [w.peer for w in workers]
    first.runner.downstream = link
    recv = StagingArea(transfers[3], 1 << 22)
    try:
        prompt = [(7 * i) % 200 + 3 for i in range(100)]  # four chunks of 32 tokens
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        res = KVHandoff(decode).reserve("r", prompt, params)
        n = len(res.block_ids) - res.cached_blocks
        staging = recv.allocate(wire.nbytes(n))
        dest = KVDestination(transfers[3].address, recv.handle, staging.offset, res.cached_blocks, n)
        senders[0].expect("r", dest)
        link.expect("r", dest)
        first.kv_sinks.append(spy := _LastChunkBlocks())
        first.add_request(prompt, params, request_id="r")
        outs = []
        while first.has_unfinished():
            outs.extend(first.step())
        report = asyncio.run(senders[0].finish("r", 10.0))
        link.finish("r")
        assert report.bytes_sent == len(layers[0]) * wire.layer_bytes(n)
        (out,) = outs
        kv = recv.view(staging, wire.torch_dtype, wire.shape(n))
        # Each stage's layers landed where the whole model's go: the received KV is each stage's
        # own cache (the whole model's, test above), layer for layer, block for block.
        caches = [first.runner.kv_cache] + [w.runner.kv_cache for w in workers]
        for r, cache in zip(layers, caches):
            assert torch.equal(kv[r.start : r.stop], cache[:, :, spy.blocks])
        KVHandoff(decode).admit("r", kv, out.new_token_ids[0], out.sampler_state, out.num_cached_tokens)
        recv.release(staging)
        decoded = [out.new_token_ids[0]]
        while decode.has_unfinished():
            for o in decode.step():
                decoded.extend(o.new_token_ids)
        colocated = engine("both")
        colocated.add_request(prompt, params, request_id="c")
        want = []
        while colocated.has_unfinished():
            for o in colocated.step():
                want.extend(o.new_token_ids)
        assert decoded == want
    finally:
        for w in workers:
            w.close()
        for t in transfers:
            t.close()
