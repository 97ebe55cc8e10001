"""Issue 23 §1-§3 without processes: a request's failure is not an instance's, requests move
instead of failing, and no instance's slowness holds up another's leases.

The real Conductor, RequestFlow and InstanceClient; the instances are an ``httpx.MockTransport``
scripted per test. What a move must keep: the client's stream goes on where it stopped (the
tokens it already has become part of the prompt placed again), its counts are the client's, an
instance is marked down only when it is unhealthy, and past ``max_request_moves`` (or with no
instance of the role left) the client gets a 503 naming the role.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

import cluster.conductor.conductor as conductor_module
from cluster.conductor.client import InstanceClient
from cluster.conductor.conductor import Conductor, ConductorConfig
from cluster.policies.cost_model import DecodeStepModel, InstanceProfile, PrefillCostModel
from cluster.protocol import CacheDelta, InstanceInfo, InstanceState, UnknownReservation, output_to_dict
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.disaggregation import KVCapacityError
from engine.engine_client import EngineError, EngineNotReady
from engine.engine_client import RequestFailed as EngineRequestFailed
from engine.kv_layout import KVLayout
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.signed_answers import signed_transport

SECRET = b"request moves test secret 0123"
LAYOUT = KVLayout(2, 2, 16, 8, "float32")
PROFILE = InstanceProfile(PrefillCostModel(1e-7, 2e-7, 1e-3, 0.05), DecodeStepModel(0.05, 0.002, 1e-5, 4096))
PREFILLS, DECODES = ["http://p0:1"], ["http://d0:1", "http://d1:1"]
PROMPT = list(range(10, 50))


def _url(request: httpx.Request) -> str:
    return f"{request.url.scheme}://{request.url.host}:{request.url.port}"


class Instances:
    """Scripted instances. A prefill samples ``next_token(prompt)`` (the prompt's last id + 1:
    a "model" whose greedy text a move must not change) and hands off; a decode streams the
    following tokens up to ``max_tokens``, unless ``decode_fault(url, attempt)`` names a fault:
    ``("cut", n)`` breaks the stream after n tokens, ``("gone", 0)`` answers that the reservation
    is unknown (it lapsed), ``("poisoned", 0)`` that the request failed inside the engine."""

    def __init__(self, decode_fault: Callable[[str, int], tuple[str, int] | None] = lambda url, n: None,
                 full_reserves: int = 0) -> None:
        self.decode_fault = decode_fault
        self.full_reserves = full_reserves  # reserves after the first answered 507 (no room now)
        self.reserves = 0
        self.calls: list[tuple[str, str, dict]] = []
        self.generates = 0
        self.renew_gate: dict[str, asyncio.Event] = {}
        self.gone: set[str] = set()  # reservation ids the next renewal answers as no longer held
        self.prefill_gate: asyncio.Event | None = None  # set by a test: the first prefill hangs
        self.prefill_started = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        url, path = _url(request), request.url.path
        body = {} if request.method == "GET" else json.loads(request.content)
        self.calls.append((url, path, body))
        role = "prefill" if url in PREFILLS else "decode"
        if path == "/instance/info":
            info = InstanceInfo(url, role, 1, 4096, LAYOUT.to_dict(), PROFILE.to_dict(), weights="w0", dtype="float32", quantization="none")
            return httpx.Response(200, json=info.to_dict())
        if path == "/instance/state":
            return httpx.Response(200, json=InstanceState(url, CacheDelta(0, [])).to_dict())
        if path == "/instance/reserve":
            self.reserves += 1
            if 1 < self.reserves <= 1 + self.full_reserves:
                return httpx.Response(507, json={"error": "no room for the KV", "code": "no_kv_room"})
            return httpx.Response(200, json={"dest": {"skip_blocks": 0, "num_blocks": 3}})
        if path == "/instance/renew":
            if url in self.renew_gate:
                await self.renew_gate[url].wait()
            gone = [r for r in body["request_ids"] if r in self.gone]
            self.gone.difference_update(gone)
            return httpx.Response(200, json={"gone": gone})
        if path == "/instance/abort":
            return httpx.Response(200, json={"aborted": body["request_id"]})
        if path == "/instance/prefill":
            ids = body["prompt_token_ids"]
            if self.prefill_gate is not None and body["request_id"] == "req":
                self.prefill_started.set()
                await self.prefill_gate.wait()  # its KV writes hang on a frozen decode instance
            out = RequestOutput(body["request_id"], [ids[-1] + 1], "", False, "handoff", len(ids), 1, 0)
            return httpx.Response(200, json={"output": output_to_dict(out)})
        if path == "/instance/generate":
            return self._generate(url, body)
        return httpx.Response(404, json={"error": f"unexpected {path}"})

    def _generate(self, url: str, body: dict) -> httpx.Response:
        attempt, self.generates = self.generates, self.generates + 1
        fault = self.decode_fault(url, attempt)
        if fault is not None and fault[0] == "gone":
            return httpx.Response(404, json={"error": "no KV reservation (released or expired)",
                                             "code": "unknown_reservation"})
        if fault is not None and fault[0] == "poisoned":
            return httpx.Response(500, json={"error": "internal error in the engine while computing this request",
                                             "code": "request_failed"})
        ids, first = body["prompt_token_ids"], body["prefilled"]["first_token"]
        left = body["params"]["max_tokens"] - 1
        rid = body["request_id"]

        async def lines() -> AsyncIterator[bytes]:
            for k in range(left):
                if fault is not None and fault[0] == "cut" and k == fault[1]:
                    raise httpx.RemoteProtocolError("peer closed connection")  # killed mid-stream
                last = k == left - 1
                out = RequestOutput(rid, [first + 1 + k], f" t{first + 1 + k}", last, "length" if last else None,
                                    len(ids), k + 2, 0)
                yield (json.dumps(output_to_dict(out)) + "\n").encode()

        return httpx.Response(200, content=lines())

    def prompts_prefilled(self) -> list[tuple[str, list[int], int]]:
        return [(b["request_id"], b["prompt_token_ids"], b["params"]["max_tokens"])
                for _, path, b in self.calls if path == "/instance/prefill"]

    def params_prefilled(self) -> list[dict]:
        return [b["params"] for _, path, b in self.calls if path == "/instance/prefill"]


async def _conductor(instances: Instances, monkeypatch, **config) -> Conductor:
    transport = signed_transport(instances, SECRET)
    monkeypatch.setattr(conductor_module, "InstanceClient", lambda *a, **k: InstanceClient(*a, **k, transport=transport))
    c = Conductor(ConductorConfig(secret=SECRET, instances=tuple(PREFILLS + DECODES), epoch=5, **config))
    c._tokenizer, c._vocab_size = object(), 1000  # token-id prompts only: no tokenizer needed
    for rec in c.registry.records:
        await c.registry.poll(rec)
    assert c._serving_mode() == "disaggregated"
    return c


async def _collect(c: Conductor, max_tokens: int) -> list[RequestOutput]:
    return [o async for o in c.generate("req", list(PROMPT), SamplingParams(temperature=0, max_tokens=max_tokens))]


def _up(c: Conductor) -> dict[str, bool]:
    return {r.url: r.up for r in c.registry.records}


def test_a_decode_instance_lost_mid_stream_moves_the_request_and_the_stream_goes_on(monkeypatch):
    instances = Instances(lambda url, attempt: ("cut", 3) if attempt == 0 else None)

    async def scenario():
        c = await _conductor(instances, monkeypatch)
        outs = await _collect(c, max_tokens=8)
        tokens = [t for o in outs for t in o.new_token_ids]
        # Undisturbed, the "model" counts on from the prompt's last id: so it does after the move.
        assert tokens == list(range(PROMPT[-1] + 1, PROMPT[-1] + 9))
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert all(o.request_id == "req" for o in outs)
        assert (outs[-1].num_prompt_tokens, outs[-1].num_output_tokens) == (len(PROMPT), 8)
        # Placed again with the 4 tokens the client had (1 from the prefill, 3 streamed) as prompt.
        (first, again) = instances.prompts_prefilled()
        assert first == ("req", PROMPT, 8)
        assert again == ("req~1", PROMPT + tokens[:4], 4)
        assert c.stats()["requests_moved"] == 1 and c.stats()["requests_failed"] == 0
        assert c.stats()["requests_accepted"] == 1  # one client request, admitted once: not per attempt
        assert not _up(c)[DECODES[0]], "the instance whose stream broke is marked down"
        await c.shutdown()

    asyncio.run(scenario())


def test_a_request_that_failed_inside_the_engine_ends_with_a_500_unmoved_and_the_instance_stays_up(monkeypatch):
    """Its step failed with it alone (issue 40): moved, it would fail the next instance's batch too."""
    instances = Instances(lambda url, attempt: ("poisoned", 0))

    async def scenario():
        c = await _conductor(instances, monkeypatch)
        with pytest.raises(EngineRequestFailed, match="failed on the decode instance"):
            await _collect(c, max_tokens=5)
        assert all(_up(c).values()), "a request's own failure marked an instance down"
        stats = c.stats()
        assert (stats["requests_moved"], stats["requests_failed"]) == (0, 1) and instances.generates == 1
        await c.shutdown()

    asyncio.run(scenario())


def test_a_lapsed_reservation_moves_the_request_without_marking_the_instance_down(monkeypatch):
    # The decode instance stalled (SIGSTOP) long enough for the lease to lapse: it answers 404.
    instances = Instances(lambda url, attempt: ("gone", 0) if attempt == 0 else None)

    async def scenario():
        c = await _conductor(instances, monkeypatch)
        outs = await _collect(c, max_tokens=5)
        assert [t for o in outs for t in o.new_token_ids] == list(range(PROMPT[-1] + 1, PROMPT[-1] + 6))
        assert all(_up(c).values()), "a request's failure marked an instance down"
        assert c.stats()["requests_moved"] == 1
        await c.shutdown()

    asyncio.run(scenario())


def test_a_moved_request_waits_for_room_instead_of_a_429_mid_stream(monkeypatch):
    """After the move no decode instance has room at first (507 on the next four reserves): the
    request waits and goes on once there is room; the client sees one stream, no refusal."""
    instances = Instances(lambda url, attempt: ("cut", 3) if attempt == 0 else None, full_reserves=4)

    async def scenario():
        c = await _conductor(instances, monkeypatch)
        outs = await _collect(c, max_tokens=8)
        assert [t for o in outs for t in o.new_token_ids] == list(range(PROMPT[-1] + 1, PROMPT[-1] + 9))
        stats = c.stats()
        assert (stats["requests_moved"], stats["moved_requests_waiting_for_room"]) == (1, 4)
        assert stats["requests_failed"] == 0 and stats["requests_rejected"] == 0  # no 429 reached the client
        # Each try for room under an id of its own (the instances may still hold the last one's).
        assert [rid for rid, _, _ in instances.prompts_prefilled()] == ["req", "req~5"]
        await c.shutdown()

    asyncio.run(scenario())


def test_a_moved_request_that_finds_no_room_in_time_gets_a_503(monkeypatch):
    instances = Instances(lambda url, attempt: ("cut", 3) if attempt == 0 else None, full_reserves=10**6)

    async def scenario():
        c = await _conductor(instances, monkeypatch, move_wait_s=0.5)
        with pytest.raises(EngineNotReady, match="no room for the moved request within 0.5 s"):
            await _collect(c, max_tokens=8)
        assert c.stats()["requests_failed"] == 1
        await c.shutdown()

    asyncio.run(scenario())


def test_a_scoring_request_moved_before_its_first_token_keeps_its_prompt_logprobs(monkeypatch):
    """The prompt's logprobs travel with the first token: a request moved before it (its decode
    instance lost while the prefill ran) still asks for them."""
    instances = Instances()

    async def scenario():
        instances.prefill_gate, instances.prefill_started = asyncio.Event(), asyncio.Event()
        c = await _conductor(instances, monkeypatch)
        params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
        task = asyncio.create_task(_drain(c.generate("req", list(PROMPT), params)))
        await asyncio.wait_for(instances.prefill_started.wait(), 5)
        (reserved_on,) = [url for url, path, _ in instances.calls if path == "/instance/reserve"]
        c.registry.mark_down(next(r for r in c.registry.records if r.url == reserved_on), "poll: TimedOut")
        await asyncio.wait_for(task, 5)
        assert c.stats()["requests_moved"] == 1
        assert [p.get("prompt_logprobs") for p in instances.params_prefilled()] == [1, 1]
        instances.prefill_gate.set()
        await c.shutdown()

    asyncio.run(scenario())


def test_a_scoring_request_moved_after_its_first_token_does_not_ask_for_them_again(monkeypatch):
    """Moved once the client has its first token (and with it the prompt's logprobs), the
    request's prompt is the client's plus what was streamed: it does not ask for them again."""
    instances = Instances(lambda url, attempt: ("gone", 0) if attempt == 0 else None)

    async def scenario():
        c = await _conductor(instances, monkeypatch)
        params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
        await _drain(c.generate("req", list(PROMPT), params))
        assert c.stats()["requests_moved"] == 1
        assert [p.get("prompt_logprobs") for p in instances.params_prefilled()] == [1, None]
        await c.shutdown()

    asyncio.run(scenario())


async def _drain(outs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in outs]


def test_a_decode_instance_lost_during_the_prefill_moves_the_request_at_once(monkeypatch):
    """Its KV writes would fail only after the transfer timeout (30 s by default): the loss of
    the instance the KV goes to ends the prefill call as soon as the registry sees it."""
    instances = Instances()

    async def scenario():
        instances.prefill_gate, instances.prefill_started = asyncio.Event(), asyncio.Event()
        c = await _conductor(instances, monkeypatch)
        task = asyncio.create_task(_collect(c, max_tokens=3))
        await asyncio.wait_for(instances.prefill_started.wait(), 5)
        (reserved_on,) = [url for url, path, _ in instances.calls if path == "/instance/reserve"]
        c.registry.mark_down(next(r for r in c.registry.records if r.url == reserved_on), "poll: TimedOut")
        outs = await asyncio.wait_for(task, 5)
        assert [t for o in outs for t in o.new_token_ids] == list(range(PROMPT[-1] + 1, PROMPT[-1] + 4))
        reserves = [url for url, path, _ in instances.calls if path == "/instance/reserve"]
        assert reserves[1] != reserved_on and c.stats()["requests_moved"] == 1
        aborted = [(url, b["request_id"]) for url, path, b in instances.calls if path == "/instance/abort"]
        for _ in range(100):  # the aborts run as tasks of their own
            if ("http://p0:1", "req") in aborted:
                break
            await asyncio.sleep(0.01)
            aborted = [(url, b["request_id"]) for url, path, b in instances.calls if path == "/instance/abort"]
        assert ("http://p0:1", "req") in aborted, "the abandoned prefill was not aborted"
        instances.prefill_gate.set()
        await c.shutdown()

    asyncio.run(scenario())


def test_a_reservation_its_renewal_says_is_gone_stops_the_prefill_and_moves_the_request(monkeypatch):
    """Issue 41 item 6: the ``gone`` list a renewal answers acts at once. The decode instance
    stalled past the lease and dropped the reservation: the prefill (which would compute KV
    nobody takes, then fail its writes after the transfer timeout) is abandoned and aborted, and
    the request is placed again, with nobody marked down."""
    instances = Instances()

    async def scenario():
        instances.prefill_gate, instances.prefill_started = asyncio.Event(), asyncio.Event()
        c = await _conductor(instances, monkeypatch, renew_interval_s=0.05, renew_timeout_s=0.5)
        await c.start()
        task = asyncio.create_task(_collect(c, max_tokens=3))
        await asyncio.wait_for(instances.prefill_started.wait(), 5)
        instances.gone.add("req")
        outs = await asyncio.wait_for(task, 5)
        assert [t for o in outs for t in o.new_token_ids] == list(range(PROMPT[-1] + 1, PROMPT[-1] + 4))
        reserves = [url for url, path, _ in instances.calls if path == "/instance/reserve"]
        assert len(reserves) == 2 and c.stats()["requests_moved"] == 1
        assert all(_up(c).values()), "a lapsed reservation is not a dead instance"
        for _ in range(100):  # the aborts run as tasks of their own
            if ("http://p0:1", "req") in [(u, b.get("request_id")) for u, p, b in instances.calls if p == "/instance/abort"]:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the abandoned prefill was not aborted")
        instances.prefill_gate.set()
        await c.shutdown()

    asyncio.run(scenario())


def test_a_renewal_sent_before_a_reservation_was_granted_does_not_move_it(monkeypatch):
    """A renewal that left before the grant may answer the id as gone (the instance had not
    reserved it yet): that says nothing about the reservation granted since."""
    from cluster.conductor.flow import RequestFlow

    flow = RequestFlow(client=None, registry=None, counters=None, spawn=lambda coro: None)  # type: ignore[arg-type]

    async def scenario():
        lapsed = asyncio.Event()
        flow._granted["r"] = (100.0, lapsed)
        assert flow.reservations_gone(["r", "unknown"], asked_at=99.0) == 0 and not lapsed.is_set()
        assert flow.reservations_gone(["r"], asked_at=101.0) == 1 and lapsed.is_set()
        assert flow.reservations_gone(["r"], asked_at=102.0) == 0  # once

    asyncio.run(scenario())


def test_past_the_bound_the_client_gets_a_503_naming_the_role(monkeypatch):
    instances = Instances(lambda url, attempt: ("gone", 0))

    async def scenario():
        c = await _conductor(instances, monkeypatch, max_request_moves=2)
        with pytest.raises(EngineNotReady, match="decode instance") as e:
            await _collect(c, max_tokens=5)
        assert e.value.retry_after and e.value.retry_after >= 1
        assert len(instances.prompts_prefilled()) == 3  # the first placement and two moves
        s = c.stats()
        assert (s["requests_moved"], s["requests_failed"]) == (2, 1)
        await c.shutdown()

    asyncio.run(scenario())


def test_with_no_instance_of_the_role_left_the_request_fails_at_once_naming_it(monkeypatch):
    instances = Instances(lambda url, attempt: ("cut", 0))  # every decode instance dies

    async def scenario():
        c = await _conductor(instances, monkeypatch, max_request_moves=5)
        with pytest.raises(EngineNotReady, match="no decode instance is up"):
            await _collect(c, max_tokens=5)
        assert len(instances.prompts_prefilled()) == 2  # d0, then d1; then none is left
        await c.shutdown()

    asyncio.run(scenario())


def test_one_stalled_instance_does_not_hold_up_the_other_instances_renewals(monkeypatch):
    instances = Instances()
    instances.renew_gate[DECODES[0]] = asyncio.Event()  # d0 never answers a renewal

    async def scenario():
        c = await _conductor(instances, monkeypatch, renew_interval_s=0.05, renew_timeout_s=0.2)
        held = c.ledger.book("held")
        for url in DECODES:
            held.reserving(next(r for r in c.registry.records if r.url == url))
        await c.start()
        await asyncio.sleep(1.0)
        renews = [url for url, path, _ in instances.calls if path == "/instance/renew"]
        # d1 is renewed every interval; d0 has one call at a time (each gives up after 0.2 s).
        assert renews.count(DECODES[1]) >= 10, renews.count(DECODES[1])
        assert 2 <= renews.count(DECODES[0]) <= 6, renews.count(DECODES[0])
        assert all(_up(c).values()), "a slow renewal is not a dead instance: the polls judge that"
        await c.shutdown()

    asyncio.run(scenario())


def test_the_lease_must_span_three_renewal_rounds():
    config = ConductorConfig(secret=SECRET, renew_interval_s=1.0, renew_timeout_s=2.0)
    config.check_lease(9.0)
    with pytest.raises(ValueError, match="at least 3 x"):
        config.check_lease(8.9)
    with pytest.raises(ValueError):
        ConductorConfig(secret=SECRET, max_request_moves=-1)


def test_the_shipped_defaults_keep_the_lease_rule():
    from server.cli import parse_args

    args = parse_args([])
    ConductorConfig(secret=SECRET, renew_interval_s=args.renew_interval_s,
                    renew_timeout_s=args.renew_timeout_s).check_lease(args.reservation_lease_s)


@pytest.mark.parametrize("error", [UnknownReservation("no KV reservation for 'x' (released or expired)"),
                                   KVCapacityError("no room")])
def test_the_engine_hands_a_requests_own_failure_through_unwrapped(tmp_path, error):
    """A decode instance's engine used to wrap a lapsed reservation into "engine failed to add the
    request" (an EngineError: HTTP 500, and the Conductor marked the instance down)."""
    model = make_tiny_model(tmp_path, "Qwen3ForCausalLM", tie=False, seed=3)
    client = AsyncLLMEngine(EngineConfig(model=str(model), device="cpu", kv_cache_gib=0.01, threads=1))

    def start(_engine):
        raise error

    def bug(_engine):
        raise KeyError("a bug")

    async def scenario():
        await client.start()
        assert await asyncio.get_running_loop().run_in_executor(None, client.wait_ready, 120)
        try:
            with pytest.raises(type(error)):
                async for _ in client.stream("r1", start):
                    pass
            with pytest.raises(EngineError):  # a KeyError is a bug, not the request's fault
                async for _ in client.stream("r2", bug):
                    pass
        finally:
            await client.shutdown()

    asyncio.run(scenario())
