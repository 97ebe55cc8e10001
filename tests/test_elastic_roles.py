"""Elastic roles, live (issue 32): an instance moves between prefill and decode without reloading.

Without processes: the instance's state machine (``cluster/instance/roles.py``), the engine's
switch (``KVHandoff.switch_role``: only once it holds nothing), and a real ``InstanceService``
on a tiny model, in this process, drained and switched both ways (its prefill side opened on
the first switch to prefill; a drain that outlasts its deadline gives up); the Conductor's side
(``cluster/conductor/elastic.py``) on scripted instances.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from cluster.conductor.elastic import DeciderLease, ElasticRoles, StepSlowdown
from cluster.conductor.ledger import Ledger
from cluster.conductor.registry import Registry
from cluster.conductor.supervisor import free_port
from cluster.instance.calibration import CACHE_ENV
from cluster.instance.roles import RoleState, Work
from cluster.instance.service import InstanceConfig, InstanceService
from cluster.policies.cost_model import DecodeStepModel
from cluster.metadata.local import LocalMetadata
from cluster.policies.early_rejection import SLO
from cluster.policies.elastic_roles import ElasticConfig, TBTPrediction, TTFTPrediction
from cluster.protocol import (MEMBERSHIP, BadRequest, CacheDelta, Fence, InstanceBusy, InstanceState, NoKVRoom,
                              SwitchRoleReply, WrongEpoch, derive_key)
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
        assert roles.begin("decode", now=0.0, drain_s=5.0)
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
    assert not roles.begin("decode", now=1.0, drain_s=5.0)  # the same switch: nothing new
    with pytest.raises(InstanceBusy):
        roles.begin("prefill", now=1.0, drain_s=5.0)
    roles.finish(switched=True)
    assert (roles.role, roles.switching_to, roles.switches) == ("decode", None, 1)
    assert roles.reply().to_dict() == {"role": "decode", "switching_to": None}
    with roles.work(Work.RESERVE):
        pass


def test_a_drain_that_gives_up_keeps_the_old_role_and_no_call_stays_counted() -> None:
    roles = RoleState("decode")
    assert not roles.begin("decode", now=0.0, drain_s=1.0)  # it serves decode already
    assert roles.begin("prefill", now=0.0, drain_s=1.0)
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
        RoleState("both").begin("decode", 0.0, 1.0)
    with pytest.raises(BadRequest):
        RoleState("prefill").begin("both", 0.0, 1.0)


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


# -- the Conductor's side ----------------------------------------------------------------------------

class _SwitchingClient:
    """Instances that switch when asked: the next poll shows the new role."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, float]] = []

    async def switch_role(self, url: str, role: str, drain_s: float) -> SwitchRoleReply:
        self.asked.append((url, role, drain_s))
        return SwitchRoleReply("prefill", role)


def test_the_conductor_moves_the_instance_the_policy_names_and_keeps_it_out_of_placement() -> None:
    registry = Registry(client=None)
    ledger = Ledger()
    recs = [registry.add(f"http://{role}{i}:1") for i, role in enumerate(["prefill", "prefill", "decode"])]
    for rec, role in zip(recs, ["prefill", "prefill", "decode"]):
        rec.up, rec.role = True, role
    step = DecodeStepModel(0.01, 0.002, 1e-5, 4096)
    client = _SwitchingClient()
    tasks: list[asyncio.Task] = []
    config = ElasticConfig(interval_s=1.0, horizon_s=100.0, min_dwell_s=0.0, switch_cost_s=1.0, decode_time_s=5.0)

    async def run() -> None:
        elastic = ElasticRoles(config, SLO(ttft_s=5.0, tbt_s=0.08), 5.0, client, registry, ledger, lambda: step,
                               lambda coro: tasks.append(asyncio.ensure_future(coro)) or tasks[-1])
        now = time.monotonic()
        for rec in recs:  # first seen long ago: settled in its role
            elastic._changed_at[elastic._number(rec)] = now - 1000.0
        # Decode breaks the TBT SLO (a step of 0.13 s; on two instances 0.07 s); prefill has room.
        for _ in range(50):
            elastic.log.add_tbt(now, TBTPrediction(1, 40, 4000))
            elastic.log.add_ttft(now, TTFTPrediction(elastic._number(recs[1]), 2, 0.1, 0.5))
        elastic.decide_once()
        (moved,) = [r for r in recs if r.moving_to is not None]
        assert moved.moving_to == "decode" and moved.role == "prefill"
        assert moved not in registry.up("prefill")  # no new work from the decision on
        elastic.decide_once()  # one switch at a time
        assert len(tasks) == 1
        await asyncio.sleep(0.3)
        assert client.asked == [(moved.url, "decode", pytest.approx(5.0, abs=0.5))]
        moved.role = "decode"  # as the registry's next poll reads it
        await asyncio.wait_for(tasks[0], 2.0)
        assert moved.moving_to is None and moved in registry.up("decode")
        assert elastic.describe() == {"role_switches": 1, "role_switches_given_up": 0, "role_switching": None,
                                      "decode_step_slowdown": 1.0}

    asyncio.run(run())


class _Paused:
    """A process's view of a shared store that stops answering while ``paused`` (SIGSTOP, a long
    GC): its calls hang until it is resumed."""

    def __init__(self, store: LocalMetadata) -> None:
        self.store, self.resumed = store, threading.Event()
        self.resumed.set()

    def __getattr__(self, name: str):
        call = getattr(self.store, name)

        def paused_call(*args, **kwargs):
            self.resumed.wait()
            return call(*args, **kwargs)
        return paused_call


def test_one_of_two_conductors_decides_and_the_other_takes_over_only_after_the_first_stopped() -> None:
    """Issue 41 item 4: two Conductors with elastic roles on one store; exactly one decides; when
    it is paused past its lease the other takes over, and at no moment do both decide. The
    paused one, back, sees its key gone and stays out; a decider that is not deciding switches
    nothing."""
    store, ttl = LocalMetadata(), 0.6
    a_view = _Paused(store)
    pool = ThreadPoolExecutor(4)
    key = derive_key(b"s" * 32, MEMBERSHIP)
    a, b = DeciderLease(a_view, "a", pool, key, ttl), DeciderLease(store, "b", pool, key, ttl)
    both: list[float] = []

    async def run() -> None:
        tasks = [asyncio.create_task(a.run_forever())]
        await asyncio.sleep(0.1)  # a asks first
        tasks.append(asyncio.create_task(b.run_forever()))

        async def watch(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if a.decides() and b.decides():
                    both.append(time.monotonic())
                await asyncio.sleep(0.01)

        await watch(1.0)
        assert a.decides() and not b.decides() and b.holder() == "a"
        a_view.resumed.clear()  # a stops: its keepalives hang
        await watch(3 * ttl)  # its lease runs out in the store within one TTL: b asks every third
        assert not a.decides() and b.decides()
        a_view.resumed.set()
        await watch(3 * ttl)
        assert not a.decides() and b.decides() and a.holder() == "b"
        # Not deciding, a's elastic roles start no switch however the view looks.
        registry = Registry(client=None)
        for k, role in enumerate(["prefill", "prefill", "prefill"]):
            rec = registry.add(f"http://p{k}:1")
            rec.up, rec.role = True, role
        config = ElasticConfig(interval_s=1.0, horizon_s=100.0, min_dwell_s=0.0, switch_cost_s=1.0, decode_time_s=5.0)
        step = DecodeStepModel(0.01, 0.002, 1e-5, 4096)
        spawned = []
        for lease, expect in ((a, 0), (b, 1)):
            elastic = ElasticRoles(config, SLO(5.0, 0.08), 5.0, None, registry, Ledger(), lambda: step,
                                   lambda coro: spawned.append(coro.close()) or None, lease)
            elastic.decide_once()  # no decode instance at all: the decider refills the role
            assert len(spawned) == expect and sum(r.moving_to == "decode" for r in registry.records) == expect
        for t in tasks:
            t.cancel()

    try:
        asyncio.run(run())
    finally:
        a.close(), b.close()
        pool.shutdown(wait=False)
    assert not both, "two Conductors decided at once"


def test_a_decider_record_written_without_the_secret_is_neither_believed_nor_kept() -> None:
    """Issue 52: the decider key was unsigned: anyone with write access to etcd could name a
    decider (or hold the key with no lease, so that no Conductor ever decided again)."""
    from cluster.metadata.membership import ELASTIC_DECIDER, decider, hold_decider

    store, key = LocalMetadata(), derive_key(b"s" * 32, MEMBERSHIP)
    store.put(ELASTIC_DECIDER, '{"conductor": "evil"}')  # no lease, no MAC
    assert decider(store, key) is None
    held = hold_decider(store, key, "a", 5.0)
    try:
        assert held is not None and decider(store, key) == "a"
        assert decider(store, derive_key(b"t" * 32, MEMBERSHIP)) is None  # another cluster's key
        assert hold_decider(store, key, "b", 5.0) is None  # a signed holder is kept
    finally:
        held.close()


def _counted(rec, steps: int, seconds: float, seqs: int, context: int) -> None:
    """The decode step counters, as the registry's next poll of ``rec`` reads them."""
    rec.state = InstanceState("i", CacheDelta(0, []), {"decode_steps": steps, "decode_step_seconds": seconds,
                                                       "decode_step_seqs": seqs, "decode_step_context_tokens": context})


def test_the_step_slowdown_is_live_seconds_over_the_models_for_the_same_batches() -> None:
    model = DecodeStepModel(0.01, 0.002, 1e-5, 4096)
    registry = Registry(client=None)
    a, b = registry.add("http://d0:1"), registry.add("http://d1:1")
    slowdown = StepSlowdown()
    _counted(a, 100, 50.0, 1000, 100_000)
    _counted(b, 10, 1.0, 10, 1000)
    assert slowdown.update(model, [a, b]) == 1.0  # first readings: nothing to compare yet
    # a: 30 steps of 10 sequences and 1,000 tokens (0.04 s each by the model) took 3.6 s; b: 10
    # steps of 1 sequence and 100 tokens (0.013 s) took 0.39 s: 3.99 s against 1.33 s.
    _counted(a, 130, 53.6, 1300, 130_000)
    _counted(b, 20, 1.39, 20, 2000)
    assert slowdown.update(model, [a, b]) == pytest.approx(3.99 / 1.33)
    _counted(a, 135, 54.0, 1350, 135_000)  # 5 steps: too few to say; the factor stays
    assert slowdown.update(model, [a, b]) == pytest.approx(3.99 / 1.33)
    _counted(a, 3, 0.1, 3, 300)  # a restarted engine counts afresh: no comparison across it
    a.state.stats.pop("decode_step_seqs")
    _counted(b, 40, 1.65, 40, 4000)  # 20 steps of 0.013 s in 0.26 s: as the model says
    assert slowdown.update(model, [a, b]) == pytest.approx(1.0)


def test_a_slowdown_the_calibrated_model_does_not_show_moves_an_instance_to_decode() -> None:
    """Batches of 25 on one decode instance: 0.06 s a step by the calibrated model, within the TBT
    SLO (0.08 s), so no switch; its steps measured at twice that break it, and the policy, given
    the model times the slowdown, moves a prefill instance (two decode instances: 0.06 s)."""
    registry = Registry(client=None)
    ledger = Ledger()
    recs = [registry.add(f"http://{role}{i}:1") for i, role in enumerate(["prefill", "prefill", "decode"])]
    for rec, role in zip(recs, ["prefill", "prefill", "decode"]):
        rec.up, rec.role = True, role
    step = DecodeStepModel(0.01, 0.002, 0.0, 4096)
    config = ElasticConfig(interval_s=1.0, horizon_s=100.0, min_dwell_s=0.0, switch_cost_s=1.0, decode_time_s=5.0)
    tasks: list[asyncio.Task] = []

    async def run() -> None:
        elastic = ElasticRoles(config, SLO(ttft_s=5.0, tbt_s=0.08), 5.0, _SwitchingClient(), registry, ledger,
                               lambda: step, lambda coro: tasks.append(asyncio.ensure_future(coro)) or tasks[-1])
        now = time.monotonic()
        for rec in recs:
            elastic._changed_at[elastic._number(rec)] = now - 1000.0
        for _ in range(50):
            elastic.log.add_tbt(now, TBTPrediction(1, 25, 0))
            elastic.log.add_ttft(now, TTFTPrediction(elastic._number(recs[1]), 2, 0.1, 0.5))
        _counted(recs[2], 0, 0.0, 0, 0)
        elastic.decide_once()
        assert not [r for r in recs if r.moving_to is not None] and elastic.describe()["decode_step_slowdown"] == 1.0
        _counted(recs[2], 50, 50 * 0.12, 50 * 25, 0)  # 0.12 s a step where the model says 0.06 s
        elastic.decide_once()
        (moved,) = [r for r in recs if r.moving_to is not None]
        assert moved.moving_to == "decode" and elastic.describe()["decode_step_slowdown"] == 2.0
        for task in tasks:
            task.cancel()

    asyncio.run(run())


# -- a cluster, under load -------------------------------------------------------------------------

# 1 prefill + 2 decode instances with the engine settings of tests/test_cluster.py (their
# calibrated profiles are shared). --elastic-roles with an interval longer than the test: the
# test switches the instance itself, where it wants it (a call signed as a Conductor's, under an
# id of its own), and the Conductor follows through its polls.
FLAGS = ("--prefill-instances", "1", "--decode-instances", "2", "--no-pool", "--max-num-batched-tokens", "128",
         "--elastic-roles", "--slo-ttft-s", "30", "--slo-tbt-s", "5", "--elastic-interval-s", "600")


@pytest.mark.processes
def test_a_decode_instance_switched_under_load_drains_then_prefills(tmp_path: Path, colocated) -> None:
    from bench.harness import sse_events, until
    from clusters import CONTROL_AUTH, Cluster, complete_concurrently

    cluster = Cluster(FLAGS, 3, tmp_path)
    try:
        prompt = "Tell me a long story about a dragon."
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
        others = [f"Question {k}: what is {k} plus {k}?" for k in range(4)]
        with cluster.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received = [next(lines) for _ in range(4)]  # decoding on one of the two decode instances
            (victim,) = [i for i in cluster.instances("decode") if i["running"]]
            answer = httpx.post(victim["url"] + "/instance/role", json={"role": "prefill", "drain_s": 60.0},
                                auth=CONTROL_AUTH, headers={"X-Conductor-Epoch": "elastic-test/1"}, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"role": "decode", "switching_to": "prefill"}
            # While it drains, new requests decode on the other instance (a reservation there is
            # refused as "no room", or the Conductor already keeps it out of placement).
            got = asyncio.run(complete_concurrently(cluster.url, [{"prompt": p, "max_tokens": 8, "temperature": 0}
                                                          for p in others[:2]]))
            rest = list(lines)
        stream = sse_events(received + rest)
        assert stream.done and stream.error is None, stream.error
        text = stream.text
        (want,) = colocated.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        assert text == want.text
        until(lambda: [i for i in cluster.instances("prefill") if i["url"] == victim["url"]], 15,
              "the drained instance to serve prefill")
        computed = cluster.instance_stats(victim["url"])["num_prompt_tokens_computed"]
        # Two prefill instances now: concurrent arrivals spread over both.
        got += asyncio.run(complete_concurrently(cluster.url, [{"prompt": p, "max_tokens": 8, "temperature": 0}
                                                       for p in others[2:] + others[:2]]))
        want = colocated.generate(others[:2] + others[2:] + others[:2], SamplingParams(temperature=0, max_tokens=8))
        assert [g["choices"][0]["text"] for g in got] == [w.text for w in want]
        stats = cluster.instance_stats(victim["url"])
        assert stats["role"] == "prefill" and stats["role_switches"] == 1
        assert stats["num_prompt_tokens_computed"] > computed  # it prefilled once it switched
        conductor = cluster.stats()
        assert conductor["requests_failed"] == 0 and conductor["requests_rejected"] == 0
        (role,) = [line for line in cluster.http.get("/metrics").text.splitlines()
                   if line.startswith("mooncake:instance_role{") and f'instance="{victim["url"]}"' in line]
        assert 'role="prefill"' in role and role.endswith(" 1.0")
        cluster.assert_clean()
    finally:
        cluster.close()
