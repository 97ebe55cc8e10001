"""Elastic roles, live (issue 32): an instance moves between prefill and decode without reloading.

Without processes: the instance's state machine (``cluster/instance/roles.py``), the engine's
switch (``KVHandoff.switch_role``: only once it holds nothing), and a real ``InstanceService``
on a tiny model, in this process, drained and switched both ways (its prefill side opened on
the first switch to prefill; a drain that outlasts its deadline gives up).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from cluster.conductor.supervisor import free_port
from cluster.instance.calibration import CACHE_ENV
from cluster.instance.roles import RoleState, Work
from cluster.instance.service import InstanceConfig, InstanceService
from cluster.protocol import BadRequest, Fence, InstanceBusy, NoKVRoom, WrongEpoch
from engine.config import EngineConfig
from engine.disaggregation import KVHandoff
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

FENCE = Fence("c", 2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "Qwen3ForCausalLM", tie=False, seed=3)


# -- the state machine -----------------------------------------------------------------------------

def test_a_draining_instance_refuses_new_work_and_counts_what_it_holds() -> None:
    roles = RoleState("prefill")
    with roles.work(Work.PREFILL):  # in flight before the switch
        assert roles.begin("decode", FENCE, now=0.0, drain_s=5.0)
        assert (roles.role, roles.switching_to, roles.deadline) == ("prefill", "decode", 5.0)
        assert roles.in_flight == 1
        with pytest.raises(InstanceBusy):
            with roles.work(Work.PREFILL):
                pass
        with pytest.raises(NoKVRoom):  # the Conductor tries the next decode instance
            with roles.work(Work.RESERVE):
                pass
        with roles.work(Work.PUSH):  # reads the cache only: still served
            assert roles.in_flight == 2
    assert roles.in_flight == 0
    assert not roles.begin("decode", Fence("other", 1), now=1.0, drain_s=5.0)  # the same switch: nothing new
    with pytest.raises(InstanceBusy):
        roles.begin("prefill", FENCE, now=1.0, drain_s=5.0)
    roles.finish(switched=True)
    assert (roles.role, roles.switching_to, roles.switches) == ("decode", None, 1)
    assert roles.reply().to_dict() == {"role": "decode", "switching_to": None}
    with roles.work(Work.RESERVE):
        pass


def test_a_drain_that_gives_up_keeps_the_old_role_and_no_call_stays_counted() -> None:
    roles = RoleState("decode")
    assert not roles.begin("decode", FENCE, now=0.0, drain_s=1.0)  # it serves decode already
    assert roles.begin("prefill", FENCE, now=0.0, drain_s=1.0)
    roles.finish(switched=False)
    assert (roles.role, roles.switching_to, roles.switches, roles.given_up) == ("decode", None, 0, 1)
    with pytest.raises(RuntimeError):
        roles.finish(switched=True)
    with pytest.raises(ValueError):
        with roles.work(Work.RESERVE):
            raise ValueError("the call failed")
    assert roles.in_flight == 0


def test_only_prefill_and_decode_instances_switch() -> None:
    with pytest.raises(BadRequest):
        RoleState("both").begin("decode", FENCE, 0.0, 1.0)
    with pytest.raises(BadRequest):
        RoleState("prefill").begin("both", FENCE, 0.0, 1.0)


# -- the engine ------------------------------------------------------------------------------------

def test_the_engine_switches_only_once_it_holds_nothing(model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", role="prefill", kv_cache_gib=0.01, threads=1))
    handoff = KVHandoff(engine)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request(list(range(5, 40)), params, request_id="p")
    assert not handoff.switch_role("decode")  # a prompt is waiting
    out = [o for _ in range(8) if engine.has_unfinished() for o in engine.step()]
    assert out[-1].finish_reason == "handoff"  # a prefill engine ends at the first token
    handoff.reserve("r", list(range(50, 90)), params)
    assert not handoff.switch_role("decode")  # a reservation is held
    handoff.drop("r")
    assert handoff.switch_role("decode") and engine.role == "decode"
    assert engine.config.role == "prefill"  # the setting it started with is not rewritten
    engine.add_request(list(range(5, 40)), params, request_id="d")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 4
    assert outs[-1].num_cached_tokens == 32  # the prefix cache outlived the switch: 2 of its blocks hit
    with pytest.raises(ValueError):
        handoff.switch_role("both")


# -- an instance, in this process ------------------------------------------------------------------

def _config(model: Path, role: str) -> InstanceConfig:
    return InstanceConfig(
        engine=EngineConfig(model=str(model), device="cpu", role=role, kv_cache_gib=0.01, threads=1,
                            max_num_batched_tokens=64),
        url=f"http://127.0.0.1:{free_port()}", secret=b"elastic roles test secret 01", staging_gib=0.01)


async def _until(what, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_an_instance_drains_switches_and_reports_its_new_role(model: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "calibration"))
    service = InstanceService(_config(model, "decode"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run() -> None:
        await service.start()
        try:
            await _until(lambda: service.ready or service.error is not None, 120)
            assert service.error is None, service.error
            assert service.prefiller is None and service.send is None  # a decode instance sends nothing
            await service.receiver.observe(FENCE)
            await service.receiver.reserve("held", list(range(5, 40)), params, FENCE)
            with pytest.raises(WrongEpoch):  # fenced like reservations
                service.switch_role("prefill", Fence("c", 1), 5.0)
            assert service.switch_role("prefill", FENCE, 30.0).switching_to == "prefill"
            assert service.state(None).switching_to == "prefill" and service.stats()["switching_to"] == "prefill"
            with pytest.raises(NoKVRoom):
                with service.roles.work(Work.RESERVE):
                    pass
            await asyncio.sleep(0.3)
            assert service.role == "decode"  # the reservation is still held
            await service.receiver.release("held", settled=True)
            await _until(lambda: service.role == "prefill")
            assert service.prefiller is not None and service.send is not None  # opened for the switch
            assert service.info().role == "prefill" and service.state(None).role == "prefill"
            assert service.stats()["role_switches"] == 1
            assert await service.client.call(lambda e: (e.role, len(e.seqs))) == ("prefill", 0)
            # And back: the prefill side stays open, the switch needs nothing new.
            prefiller = service.prefiller
            service.switch_role("decode", FENCE, 30.0)
            await _until(lambda: service.role == "decode")
            assert service.prefiller is prefiller and service.roles.switches == 2
            # A drain that outlasts its deadline gives up: the old role is served again.
            await service.receiver.reserve("held2", list(range(5, 40)), params, FENCE)
            service.switch_role("prefill", FENCE, 0.2)
            await _until(lambda: service.roles.switching_to is None)
            assert service.role == "decode" and service.roles.given_up == 1
            await service.receiver.release("held2", settled=True)
            assert len(service.receiver) == 0
            assert await service.client.call(lambda e: len(e.seqs)) == 0
        finally:
            await service.shutdown()

    asyncio.run(run())
