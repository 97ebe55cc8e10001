"""Large bodies are parsed in the tokenizer process (``server/parse_worker.py``): the same answers
as inline parsing, the client's errors still 4xx, a dead worker replaced, and the event loop free
while a megabyte prompt is tokenized."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine.default_model import resolve_model
from engine.tokenizer import Tokenizer
from bench.parse_stall import longest_pause
from server.parse_worker import ParseBusy, ParseWorker
from server.protocol import ModelLimits, ProtocolError, parse_chat, parse_completion

pytestmark = pytest.mark.processes  # starts the worker process


@pytest.fixture(scope="module")
def limits() -> ModelLimits:
    tokenizer = Tokenizer(resolve_model(None))
    return ModelLimits("m", tokenizer, 8192, tokenizer.vocab_size)


@pytest.fixture
def worker(limits: ModelLimits):
    w = ParseWorker(limits.tokenizer, timeout_s=20.0)
    yield w
    w.close()


def test_the_worker_parses_as_inline_and_refuses_as_inline(worker: ParseWorker, limits: ModelLimits):
    async def run():
        body = {"prompt": ["The capital of France is", "Hello"], "max_tokens": 3, "n": 2, "stop": ["."]}
        assert await worker.parse("completion", body, limits) == parse_completion(body, limits)
        chat = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2}
        assert await worker.parse("chat", chat, limits) == parse_chat(chat, limits)
        with pytest.raises(ProtocolError) as refused:
            await worker.parse("completion", {"prompt": "x", "max_tokens": -1}, limits)
        assert refused.value.status == 400 and refused.value.param == "max_tokens"
        with pytest.raises(ProtocolError) as wrong_model:
            await worker.parse("chat", {"model": "other", "messages": []}, limits)
        assert wrong_model.value.status == 404

    asyncio.run(run())


def test_a_dead_worker_is_replaced(worker: ParseWorker, limits: ModelLimits):
    body = {"prompt": "Hello", "max_tokens": 1}

    async def run():
        first = await worker.parse("completion", body, limits)
        os.kill(worker._process.pid, signal.SIGKILL)
        worker._process.wait()
        assert await worker.parse("completion", body, limits) == first
        assert worker.restarts == 1

    asyncio.run(run())


def test_megabyte_prompts_do_not_stall_the_event_loop(worker: ParseWorker, limits: ModelLimits):
    """Four 1 MB prompts (each too long for the model: a 400, once all of it is tokenized) while a
    ticker measures the loop's longest pause; inline, each alone takes the loop for about half a
    second on these machines."""
    text = ("lorem ipsum dolor sit amet, consectetur adipiscing elit " * 20000)[: 1 << 20]

    results = []

    async def parse() -> None:
        try:
            await worker.parse("completion", {"prompt": text, "max_tokens": 1}, limits)
        except ProtocolError as e:
            results.append(e)

    async def run() -> float:
        await worker.parse("completion", {"prompt": "warm up", "max_tokens": 1}, limits)  # the process starts
        pause, _ = await longest_pause(4, parse)
        assert len(results) == 4 and all("this model's context is 8192 tokens" in r.message for r in results), results
        return pause

    longest = asyncio.run(run())
    assert longest < 0.3, f"the event loop paused {longest:.2f} s while the worker tokenized"


def test_the_parse_stall_bench_measures_both_ways():
    from bench.parse_stall import run

    rows = asyncio.run(run([2], 0.05))
    assert [(n, name) for n, name, _, _ in rows] == [(2, "inline"), (2, "tokenizer process")]
    assert all(pause > 0 and took > 0 for _, _, pause, took in rows)


def test_past_max_queued_a_body_is_refused_at_once(limits: ModelLimits):
    """Each waiting body is held in memory until its turn: the queue is bounded, and past it the
    server answers 429 (``ParseBusy``) instead of queueing without end."""
    w = ParseWorker(limits.tokenizer, timeout_s=20.0, max_queued=2)
    text = ("lorem ipsum dolor sit amet " * 40000)[: 1 << 20]

    async def parse() -> str:
        try:
            await w.parse("completion", {"prompt": text, "max_tokens": 1}, limits)
        except ProtocolError:
            return "parsed"  # too long for the model: a 400 once tokenized
        except ParseBusy:
            return "busy"
        return "parsed"

    async def run() -> None:
        got = await asyncio.gather(parse(), parse(), parse())
        assert sorted(got) == ["busy", "parsed", "parsed"]
        assert await parse() == "parsed"  # room again once they are answered

    try:
        asyncio.run(run())
    finally:
        w.close()
    with pytest.raises(ValueError):
        ParseWorker(limits.tokenizer, max_queued=0)
