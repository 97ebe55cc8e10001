"""engine.core_share: the cores of one host follow the load between its engines (issue 39), and
the Supervisor hands each instance it starts a slot of one budget (``--share-cores``)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.conductor.supervisor import CORE_SHARE_ENV, Supervisor
from engine import core_share
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.core_share import CoreShare
from engine.sampling_params import SamplingParams
from server.cli import parse_args
from server.launch import engine_config
from tiny_models import make_tiny_model


def test_busy_engines_split_the_cores_and_an_idle_one_gives_its_share_back(tmp_path):
    path = core_share.create(tmp_path / "cores", cores=4, slots=3)
    a, b, c = (CoreShare(path, i) for i in range(3))
    assert a.busy() == 4  # alone
    assert b.busy() == 2  # a is still busy
    assert c.busy() == 1 and a.busy() == 1  # three on four cores: never below one
    c.idle()
    assert a.busy() == 2 and b.busy() == 2
    b.close()  # a closed slot is idle
    assert a.busy() == 4
    a.close()
    c.close()


def test_an_engine_turning_busy_waits_until_the_others_give_up_its_cores(tmp_path, monkeypatch):
    """Two threads of one engine's step on two cores, plus one of a newcomer's, would stall the
    step at every barrier: the newcomer waits for the other's next step, which shrinks it."""
    monkeypatch.setattr(core_share, "HANDOVER_WAIT_S", 30.0)
    path = core_share.create(tmp_path / "cores", cores=2, slots=2)
    decode, prefill = CoreShare(path, 0), CoreShare(path, 1)
    assert decode.busy() == 2  # alone: both cores, mid-step
    got = []
    newcomer = threading.Thread(target=lambda: got.append(prefill.busy()))
    newcomer.start()
    time.sleep(0.2)
    assert not got  # still waiting: decode's step holds both cores
    assert decode.busy() == 1  # its next step: it sees the newcomer and shrinks
    newcomer.join(5)
    assert got == [1]


def test_an_engine_with_long_steps_keeps_to_its_even_share(tmp_path):
    """A long step on the idle one's cores would hold them long after it turned busy."""
    path = core_share.create(tmp_path / "cores", cores=4, slots=2)
    prefill, decode = CoreShare(path, 0), CoreShare(path, 1)
    assert prefill.busy(last_step_s=0.5) == 2  # alone, but 0.5 s steps: its even share
    prefill.idle()
    # Its last step timed at its last threads (1 at the start): 0.08 s on 1 thread is ~0.02 s on 4.
    assert decode.busy(last_step_s=0.08) == 4  # short steps: the idle one's cores too
    assert decode.busy(last_step_s=0.04) == 4  # on those 4
    assert decode.busy(last_step_s=0.08) == 2  # a step of 0.08 s on 4: back to its even share


def test_the_wait_for_cores_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(core_share, "HANDOVER_WAIT_S", 0.2)
    path = core_share.create(tmp_path / "cores", cores=2, slots=2)
    stuck, newcomer = CoreShare(path, 0), CoreShare(path, 1)
    stuck.busy()  # and no next step within the wait
    started = time.monotonic()
    assert newcomer.busy() == 1
    assert 0.2 <= time.monotonic() - started < 5


def test_a_busy_mark_lapses_so_a_dead_engine_holds_no_cores(tmp_path, monkeypatch):
    path = core_share.create(tmp_path / "cores", cores=2, slots=2)
    monkeypatch.setattr(core_share, "LEASE_S", 0.2)
    dead, live = CoreShare(path, 0), CoreShare(path, 1)
    dead.busy()  # and never idles: its process died mid-step
    assert live.busy() == 1
    time.sleep(0.3)
    assert live.busy() == 2


def test_bad_budgets_and_slots_are_refused(tmp_path):
    path = core_share.create(tmp_path / "cores", cores=2, slots=2)
    with pytest.raises(ValueError, match="slots 0..1, not 2"):
        CoreShare(path, 2)
    junk = tmp_path / "junk"
    junk.write_bytes(b"\0" * 40)
    with pytest.raises(ValueError, match="not a core share"):
        CoreShare(junk, 0)
    with pytest.raises(ValueError, match="at least one core"):
        core_share.create(tmp_path / "none", cores=0, slots=1)


def test_an_engine_steps_at_the_threads_the_budget_gives(tmp_path):
    """Its steps take all four cores while the other slot is idle, two while it is busy; idle,
    its own slot is free again; and it starts (and would calibrate) at its own ``threads``."""
    model = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=False, seed=3)
    path = core_share.create(tmp_path / "cores", cores=4, slots=2)
    other = CoreShare(path, 1)
    client = AsyncLLMEngine(EngineConfig(model=str(model), device="cpu", kv_cache_gib=0.01, threads=1,
                                         dtype="float32", core_share=str(path), core_slot=0))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def threads_of_one_request(rid: str) -> int:
        async for _ in client.generate(rid, [5, 6, 7], params):
            pass
        return client.stats()["threads"]

    async def scenario() -> None:
        await client.start()
        assert await asyncio.get_running_loop().run_in_executor(None, client.wait_ready, 120)
        try:
            assert client.stats()["threads"] == 1
            assert await threads_of_one_request("alone") == 4
            other.busy()
            assert await threads_of_one_request("shared") == 2
            other.idle()
            assert await threads_of_one_request("alone again") == 4
            deadline = time.monotonic() + 5
            while other.busy() != 4:  # the engine marks itself idle before it waits
                other.idle()
                assert time.monotonic() < deadline, "the idle engine still holds its share"
                await asyncio.sleep(0.01)
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_a_missing_budget_is_a_load_error_not_a_silent_fallback(tmp_path):
    model = make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", tie=False, seed=3)
    client = AsyncLLMEngine(EngineConfig(model=str(model), device="cpu", kv_cache_gib=0.01, threads=1,
                                         dtype="float32", core_share=str(tmp_path / "gone"), core_slot=0))

    async def scenario() -> None:
        await client.start()
        assert not await asyncio.get_running_loop().run_in_executor(None, client.wait_ready, 120)
        assert "core share" in client.load_error and "gone" in client.load_error

    asyncio.run(scenario())


REPORT_ENV = "import os, sys, time; open(sys.argv[1], 'w').write(os.environ.get(%r, '')); time.sleep(60)" % CORE_SHARE_ENV


@pytest.mark.processes
def test_the_supervisor_gives_each_instance_a_slot_of_one_budget(tmp_path, monkeypatch):
    def command(role: str, port: int) -> list[str]:
        return [sys.executable, "-c", REPORT_ENV, str(tmp_path / f"{port}.env")]

    sup = Supervisor(["prefill", "decode"], "http://127.0.0.1:1", "secret", 1, command=command, share_cores=2,
                     poll_interval_s=0.01)
    sup.start()
    try:
        files = [tmp_path / f"{url.rsplit(':', 1)[1]}.env" for url in sup.instances]
        deadline = time.monotonic() + 30
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline, "the instances did not report"
            time.sleep(0.02)
        given = [f.read_text() for f in files]
        assert given == [f"{sup.core_share}:0", f"{sup.core_share}:1"]
        monkeypatch.setenv(CORE_SHARE_ENV, given[1])  # as the instance's command line reads it
        config = engine_config(parse_args(["--role", "decode"]), "decode")
        assert (config.core_share, config.core_slot) == (str(sup.core_share), 1)
        assert CoreShare(config.core_share, config.core_slot).cores == 2
    finally:
        sup.stop()
    assert not Path(given[0].rsplit(":", 1)[0]).exists()  # the budget goes with the Supervisor
