"""One bad request fails one request (issue 40): a step whose forward pass raises because of one
request in a busy batch ends that request alone, with ``RequestFailed``; its neighbours finish
with the tokens they would have had, and the engine goes on serving."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.engine_client import EngineError, RequestFailed
from engine.sampling_params import SamplingParams
from tiny_models import make_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = {f"n{i}": [5 + i, 6 + i, 7 + i, 8 + i] for i in range(5)}


def poison(client: AsyncLLMEngine, request_id: str) -> None:
    """Make every forward pass whose batch holds ``request_id`` raise, as a kernel failing on that
    request's shapes would (the engine thread reads ``runner.run`` at each step)."""
    runner = client._engine.runner
    real = runner.run

    def run(batch, *args):
        if any(s.seq.request_id == request_id for s in batch):
            raise RuntimeError(f"a kernel assertion on {request_id}'s rows")
        return real(batch, *args)

    runner.run = run


async def collect(client: AsyncLLMEngine, rid: str, prompt: list[int]) -> list[int] | BaseException:
    tokens: list[int] = []
    try:
        async for out in client.generate(rid, prompt, PARAMS):
            tokens += out.new_token_ids
    except Exception as e:  # noqa: BLE001 -- the test looks at what each request got
        return e
    return tokens


@pytest.mark.parametrize("poisoned_at", ["prefill", "decode"])
def test_a_poisoned_request_fails_alone_in_a_busy_batch(tmp_path, poisoned_at):
    model = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=False, seed=3)
    client = AsyncLLMEngine(EngineConfig(model=str(model), device="cpu", kv_cache_gib=0.01, threads=1,
                                         dtype="float32"))

    async def scenario() -> None:
        await client.start()
        assert await asyncio.get_running_loop().run_in_executor(None, client.wait_ready, 120)
        try:
            want = dict(zip(PROMPTS, await asyncio.gather(*(collect(client, r, p) for r, p in PROMPTS.items()))))
            if poisoned_at == "decode":
                # It prefills cleanly, then every decode step that holds it raises.
                real_step = client._engine.step

                def step(only=None):
                    outputs = real_step(only)
                    if any(o.request_id == "bad" for o in outputs):
                        poison(client, "bad")
                    return outputs

                client._engine.step = step
            else:
                poison(client, "bad")
            runs = [asyncio.create_task(collect(client, f"again-{r}", p)) for r, p in PROMPTS.items()]
            await asyncio.sleep(0.02)  # the neighbours are decoding when it joins
            bad = asyncio.create_task(collect(client, "bad", [9, 9, 9, 9]))
            got = await asyncio.gather(*runs)
            assert got == list(want.values())  # the neighbours' tokens, as without it
            failed = await bad
            assert isinstance(failed, RequestFailed) and "kernel assertion" in str(failed)
            stats = client.stats()
            assert stats["num_requests_failed"] == 1 and stats["num_step_errors"] >= 1
            # The engine goes on: a new request after it is served, and nothing is held.
            assert await collect(client, "after", PROMPTS["n0"]) == want["n0"]
            engine = client._engine
            assert not engine.has_unfinished() and engine.block_manager.pool.num_in_use == 0
            engine.block_manager.check_integrity()
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_a_step_that_fails_for_everyone_is_the_engines_failure_not_the_requests(tmp_path):
    """Bisected down to single requests that all fail, nobody stepped: not one bad request but a
    broken engine, which its callers must see as such (the Conductor marks the instance down)."""
    model = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=False, seed=3)
    client = AsyncLLMEngine(EngineConfig(model=str(model), device="cpu", kv_cache_gib=0.01, threads=1,
                                         dtype="float32"))

    async def scenario() -> None:
        await client.start()
        assert await asyncio.get_running_loop().run_in_executor(None, client.wait_ready, 120)
        try:
            def broken(batch, *args):
                raise RuntimeError("the kernel library is gone")

            client._engine.runner.run = broken
            got = await asyncio.gather(*(collect(client, r, p) for r, p in PROMPTS.items()))
            assert all(isinstance(e, EngineError) and not isinstance(e, RequestFailed) for e in got), got
            assert client.stats()["num_requests_failed"] == 0
        finally:
            await client.shutdown()

    asyncio.run(scenario())
