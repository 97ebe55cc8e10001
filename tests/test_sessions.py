"""Issue 42: sessions. Sticky placement with its load term (``cluster/policies/sessions.py`` as
the Placer applies it), and the Conductor carrying a session's hint to every instance its turns
run on, keeping the next turn where the last one ran and placing it elsewhere once that instance
is gone. (Hints on the HTTP API: tests/test_server.py; retention: tests/test_paged_kv.py and
tests/test_pool_unit.py; a live cluster: tests/test_pool_cluster.py.)"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

import httpx

from cluster.conductor.placement import Placement, PlacementConfig, Placer
from cluster.policies.cost_model import DecodeStepModel, InstanceProfile, PrefillCostModel
from cluster.policies.prefix_index import PrefixView
from cluster.policies.sessions import Affinity, prestage_delay, sticky_decode
from cluster.policies.snapshot import DecodeInstanceState, PrefillInstanceState, RequestInfo
from engine.sampling_params import SamplingParams
from engine.session import SessionHint
from tests.test_request_moves import DECODES, PROMPT, Instances, _conductor

PROFILE = InstanceProfile(PrefillCostModel(1e-7, 2e-7, 1e-3, 0.05), DecodeStepModel(0.05, 0.002, 1e-5, 4096))
SLO_TTFT, SLO_TBT = 2.0, 0.1
REQUEST = RequestInfo(0, 400, [])


class _Empty(PrefixView):
    def match_len(self, keys) -> int:
        return 0


def _placer(**config) -> Placer:
    config = PlacementConfig(admission="none", slo_ttft_s=SLO_TTFT, slo_tbt_s=SLO_TBT, **config)
    return Placer(config, PROFILE.prefill, PROFILE.decode, 16, 64)


def _decode(index: int, batch: int) -> DecodeInstanceState:
    return DecodeInstanceState(index, [0.0] * batch, [400] * batch, 400 * batch, [], [])


def _place(prefill_queues: list[float], decode_batches: list[int], affinity: Affinity = Affinity(),
           **config) -> Placement:
    prefills = [PrefillInstanceState(i, q, _Empty()) for i, q in enumerate(prefill_queues)]
    decodes = [_decode(i, b) for i, b in enumerate(decode_batches)]
    result = _placer(**config).place(0.0, REQUEST, prefills, [0] * len(prefills), decodes, affinity=affinity)
    assert isinstance(result, Placement)
    return result


def test_the_sessions_prefill_instance_is_kept_while_it_costs_little_and_meets_the_slo():
    assert _place([0.0, 0.5], [0]).plan.instance == 0  # no session: the quicker one
    slack = PlacementConfig().session_slack_s
    assert _place([0.0, slack / 2], [0], Affinity(prefill=1)).plan.instance == 1  # within the slack: kept
    assert _place([0.0, 0.5], [0], Affinity(prefill=1)).plan.instance == 0  # 0.5 s more: moved
    unbounded = dict(session_slack_s=float("inf"))  # the SLO alone bounds it
    assert _place([0.0, 0.5], [0], Affinity(prefill=1), **unbounded).plan.instance == 1
    assert _place([0.0, 2.5], [0], Affinity(prefill=1), **unbounded).plan.instance == 0  # past the SLO
    assert _place([0.0, 0.01], [0], Affinity(prefill=1), session_slack_s=None).plan.instance == 0  # off


def test_the_sessions_decode_instance_goes_first_until_its_tbt_would_miss_the_slo():
    step = PROFILE.decode.step_s
    assert step(4, 4 * 400) <= SLO_TBT < step(21, 21 * 400)  # with the request joined
    assert _place([0.0], [0, 3]).decode_order[0] == 0  # no session: the least loaded
    assert _place([0.0], [0, 3], Affinity(decode=1)).decode_order == [1, 0]
    assert _place([0.0], [0, 20], Affinity(decode=1)).decode_order == [0, 1]
    assert _place([0.0], [0, 3], Affinity(decode=1), session_slack_s=None).decode_order == [0, 1]


def test_sticky_decode_without_an_slo_or_a_known_instance_keeps_the_order():
    assert sticky_decode([0, 1], 1, lambda i: 0.0, None) == [0, 1]
    assert sticky_decode([0, 1], 3, lambda i: 0.0, 1.0) == [0, 1]
    assert sticky_decode([0, 1], None, lambda i: 0.0, 1.0) == [0, 1]


async def _turn(c, rid: str, session: SessionHint | None) -> None:
    """One request, its stream closed at its last output, as the HTTP layer does."""
    async with aclosing(c.generate(rid, list(PROMPT), SamplingParams(temperature=0, max_tokens=3), session)) as outs:
        async for out in outs:
            if out.finished:
                return
    raise AssertionError("the stream ended without a finished output")


def test_a_session_is_carried_to_its_instances_kept_there_and_moved_when_its_instance_dies(monkeypatch):
    asyncio.run(_session_scenario(monkeypatch))


async def _session_scenario(monkeypatch) -> None:
    instances = Instances()
    c = await _conductor(instances, monkeypatch)
    try:
        prefill = c.registry.up("prefill")[0]
        d0, d1 = (next(r for r in c.registry.records if r.url == u) for u in DECODES)
        session = SessionHint("agent-7", priority=3)
        # The last turn ran on d1 (both are idle: the balancer alone would pick d0).
        c.sessions.placed(session.session_id, Affinity(), prefill, d1, 0.0)
        await _turn(c, "turn-2", session)
        sent = [(url, path, body) for url, path, body in instances.calls if body.get("request_id") == "turn-2"]
        assert [(url, path) for url, path, _ in sent] == [
            (d1.url, "/instance/reserve"), (prefill.url, "/instance/prefill"), (d1.url, "/instance/generate")]
        assert all(body["session"] == {"session_id": "agent-7", "priority": 3} for _, _, body in sent)
        await _turn(c, "plain", None)  # no hint: no session field, the balancer's choice
        plain = [(url, body) for url, path, body in instances.calls if body.get("request_id") == "plain"]
        assert plain[0][0] == d0.url and all("session" not in body for _, body in plain)
        # The session's decode instance dies: its next turn is placed on what is up, and stays there.
        c.registry.mark_down(d1, "killed by the test")
        await _turn(c, "turn-3", session)
        await _turn(c, "turn-4", session)
        for rid in ("turn-3", "turn-4"):
            (reserved,) = [url for url, path, b in instances.calls if path == "/instance/reserve" and b["request_id"] == rid]
            assert reserved == d0.url
        stats = c.stats()
        # 4 turns: the one the test placed by hand, then 3 that each followed one.
        assert (stats["sessions"], stats["session_turns"], stats["session_turns_followed"]) == (1, 4, 3)
        assert stats["session_turns_kept"] == 3  # the prefill instance: the only one, kept each turn
    finally:
        await c.shutdown()


def test_prestaging_waits_half_the_shortest_recent_think():
    assert prestage_delay([]) is None
    assert prestage_delay([8.0, 3.0, 5.0]) == 1.5


class _PooledInstances(Instances):
    """The scripted instances, in a KVCache pool, answering pre-stagings."""

    def __init__(self) -> None:
        super().__init__()
        self.prestaged: list[dict] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/instance/info":
            r = await super().__call__(request)
            info = r.json()
            info["pool"] = {"namespace": "ns", "blocks_per_object": 1}
            return httpx.Response(200, json=info)
        if request.url.path == "/instance/prestage":
            self.prestaged.append(json.loads(request.content))
            return httpx.Response(200, json={"promoted": 2})
        return await super().__call__(request)


class _NoPool:
    def lookup(self, keys) -> list:
        return []


def test_a_sessions_next_turn_is_pre_staged_after_half_its_shortest_think_unless_it_comes_first(monkeypatch):
    asyncio.run(_prestage_scenario(monkeypatch))


async def _prestage_scenario(monkeypatch) -> None:
    instances = _PooledInstances()
    c = await _conductor(instances, monkeypatch, session_prestage=True)
    c._pool = _NoPool()
    try:
        session = SessionHint("thinker")
        await _turn(c, "t1", session)
        await asyncio.sleep(0.4)  # it thinks 0.4 s: its next turn is pre-staged 0.2 s after it ends
        await _turn(c, "t2", session)
        assert not instances.prestaged
        await asyncio.sleep(0.5)
        (asked,) = instances.prestaged
        # Its prompt and the output that has KV (the prefill's token and the decode's first one).
        assert asked == {"token_ids": PROMPT + [PROMPT[-1] + 1, PROMPT[-1] + 2],
                         "session": {"session_id": "thinker", "priority": 0}}
        assert (c.stats()["session_prestages"], c.stats()["session_prestaged_objects"]) == (1, 2)
        await _turn(c, "t3", session)  # now it comes back quickly: before its pre-staging
        await _turn(c, "t4", session)
        await asyncio.sleep(0.3)
        assert len(instances.prestaged) == 1 + 1  # t4's (t3's was overtaken by t4)
    finally:
        await c.shutdown()
