"""The Conductor's pure parts: its configuration, the registry's snapshots for the policies, and
the JSON forms that travel between the Conductor and the instances."""

from __future__ import annotations

import pytest
import torch

from cluster.policies.cost_model import InstanceProfile
from cluster.conductor.conductor import ConductorConfig
from cluster.conductor.placement import PlacementConfig, Placer, TTFTCorrection
from cluster.conductor.client import InstanceClient
from cluster.conductor.flow import RunningDecode
from cluster.conductor.ledger import InstanceLoad, Ledger
from cluster.conductor.registry import InstanceRecord, Registry
from cluster.policies.cost_model import DecodeStepModel, PrefillCostModel
from cluster.policies.snapshot import PrefillInstanceState, RequestInfo
from cluster.kv_stream import KVDestination
from cluster.messenger import RegionHandle
from cluster.instance.work import WorkBook
from cluster.protocol import (CacheDelta, ConductorWork, Fence, NotOwner, InstanceInfo, InstanceState, ReserveRequest, output_from_dict,
                              output_to_dict)
from engine.kv_layout import KVLayout
from engine.outputs import RequestOutput
from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams
from tests.signed_answers import signed_transport

SECRET = b"0123456789abcdef0123"


def _info(instance_id: str, role: str):
    """An instance's ``/instance/info`` as the mocked transports of the registry tests answer it."""
    import httpx

    profile = InstanceProfile(PrefillCostModel(1e-7, 2e-7, 1e-3, 0.05), None)
    info = InstanceInfo(instance_id, role, 1, 64, KVLayout(2, 2, 16, 8, "float32").to_dict(), profile.to_dict())
    return httpx.Response(200, json=info.to_dict())


async def _polled(handler) -> tuple[InstanceClient, Registry, InstanceRecord]:
    """A registry of one instance (``http://inst:1``) answered by ``handler``, polled once."""
    client = InstanceClient(SECRET, Fence("", 1), transport=signed_transport(handler, SECRET))
    reg = Registry(client)
    rec = reg.add("http://inst:1")
    await reg.poll(rec)
    return client, reg, rec


def _state(instance_id: str = "one"):
    """Its ``/instance/state``: no cached keys, no statistics."""
    import httpx

    return httpx.Response(200, json=InstanceState(instance_id, CacheDelta(1, []), {}).to_dict())


@pytest.mark.parametrize("bad", [
    {"secret": b"short"},
    {"poll_interval_s": 0},
    {"control_timeout_s": -1},
])
def test_conductor_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        ConductorConfig(**{"secret": SECRET, **bad})


@pytest.mark.parametrize("bad", [
    {"scheduler": "fastest"},
    {"admission": "sometimes"},
    {"admission": "predictive", "slo_ttft_s": 1.0},  # both SLOs or neither
    {"slo_tbt_s": 0.1},
    {"kvcache_balancing_threshold": 0.5},
    {"max_queued_prefills": 0},
    {"local_prefill": True, "slo_tbt_s": 0.1},  # local prefill needs both SLOs
    {"local_prefill": True, "slo_ttft_s": 1.0, "slo_tbt_s": 0.1, "local_prefill_chunk_tokens": 0},
])
def test_placement_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        PlacementConfig(**bad)


def test_placement_config_accepts_admission_with_slos():
    cfg = PlacementConfig(admission="early", slo_ttft_s=2.0, slo_tbt_s=0.2)
    assert cfg.scheduler == "global"


def test_prefill_snapshot_drains_the_oldest_request_first():
    rec, load = InstanceRecord("http://x"), InstanceLoad()
    assert load.prefill_state(0, 10.0, rec).queue_s == 0.0
    load.prefilling = {"a": (9.0, 3.0), "b": (9.5, 2.0)}
    # a started at 9.0 and has run 1 s of its predicted 3 s; b waits behind it.
    assert load.prefill_state(4, 10.0, rec).queue_s == pytest.approx(2.0 + 2.0)
    assert load.prefill_state(4, 10.0, rec).index == 4
    # An overdue prediction never makes the queue negative.
    assert load.prefill_state(0, 100.0, rec).queue_s == pytest.approx(2.0)


def test_decode_snapshot_counts_contexts_and_incoming_kv():
    load = InstanceLoad()
    load.running = {"a": RunningDecode(1.0, 100, generated=5), "b": RunningDecode(2.0, 50)}
    load.incoming = {"c": (3.5, 70)}
    s = load.decode_state(1, 4.0)
    assert s.batch_size == 2 and s.context_tokens == 105 + 51
    assert list(s.incoming_ready_s) == [3.5] and list(s.incoming_prompt) == [70]
    assert s.local_prefill_s == 0.0 and s.cache is None
    # A prompt it prefills itself (placed at 3.0, predicted 2 s): 1 s of it is left at 4.0.
    load.prefilling = {"d": (3.0, 2.0)}
    assert load.decode_state(1, 4.0).local_prefill_s == pytest.approx(1.0)


def test_the_ledger_adds_what_the_instance_reports_of_the_other_conductors_work():
    """Issue 41: each Conductor books its own requests exactly and adds the others' work from the
    instance's report, never its own twice."""
    profile = InstanceProfile(PrefillCostModel(0.0, 0.0, 1e-3), DecodeStepModel(0.01, 0.0, 0.0, 10_000))
    rec = InstanceRecord("http://x", profile=profile)
    ledger = Ledger("c1")
    ledger.book("mine").placed(rec, 9.0, 3.0)
    ledger.book("m2").decoding(rec, 100, generated=5).start_s = 8.0
    rec.state_at = 10.0
    rec.state = InstanceState("i", CacheDelta(0), {}, {
        # Its own work as reported is left out: the ledger has it exactly.
        "c1": ConductorWork([(1.0, 400, 0)], [(2.0, 100, 105)], [50]),
        # Another Conductor's: a 400-token prompt (0.4 s), 100 of them cached (0.3 s left to
        # compute), queued 0.5 s ago; a decode 4 s old with 80 of context; a reservation's KV coming.
        "c2": ConductorWork([(0.5, 400, 100)], [(4.0, 60, 80)], [70])})
    assert ledger.queued(rec) == 2
    # The oldest (this Conductor's, started at 9.0, 3 s predicted) has run 1 s of it.
    assert ledger.prefill_state(rec, 3, 10.0).queue_s == pytest.approx(2.0 + 0.3)
    d = ledger.decode_state(rec, 0, 10.0)
    assert d.batch_size == 2 and d.context_tokens == 105 + 80
    assert sorted(d.running_start_s) == [6.0, 8.0] and list(d.incoming_prompt) == [70]
    assert list(d.incoming_ready_s) == [10.0]  # the others' KV is taken as landing now
    # Without a report (or for the only Conductor), exactly the ledger's own bookings.
    rec.state = None
    assert ledger.queued(rec) == 1 and ledger.prefill_state(rec, 0, 10.0).queue_s == pytest.approx(2.0)


def test_an_instance_reports_each_conductors_work_and_refuses_another_owner():
    book = WorkBook()
    book.claim("p", "c1", prompt_tokens=400, cached_tokens=500)
    book.claim("d", "c2", prompt_tokens=30, cached_tokens=30, prefilling=False)
    with pytest.raises(NotOwner):
        book.claim("p", "c2")
    with pytest.raises(NotOwner):
        book.check("d", "c1")
    book.check("d", "c2")
    book.check("unknown", "c1")
    book.decoding("d", 2)
    book.decoding("d", 1)
    work = book.report({"c2": [12], "c3": [7, 8]})
    assert set(work) == {"c1", "c2", "c3"}
    (age, n, cached), = work["c1"].prefills
    assert 0 <= age < 5 and n == 400 and cached == 400  # never more cached than the prompt
    assert [(n, ctx) for _, n, ctx in work["c2"].decodes] == [(30, 33)] and work["c2"].incoming == [12]
    assert work["c3"].incoming == [7, 8] and not work["c3"].prefills
    book.let_go("p")
    assert "c1" not in book.report({}) and len(book) == 1


def test_record_matches_the_leading_run_of_cached_keys():
    rec = InstanceRecord("http://x")
    rec.cached = {b"k0", b"k1", b"k3"}
    assert rec.match_len([b"k0", b"k1", b"k2", b"k3"]) == 2
    assert rec.match_len([b"k3"]) == 1 and rec.match_len([b"k9"]) == 0
    assert hash(rec) != hash(InstanceRecord("http://x"))  # identity: usable as a dict key


def test_wire_round_trips():
    params = SamplingParams(temperature=0.7, top_k=5, stop=["\n"], seed=3, logprobs=2, max_tokens=9)
    assert ReserveRequest.from_dict(ReserveRequest("r", [1], params).to_dict()).params == params
    with pytest.raises(ValueError):
        ReserveRequest.from_dict({"request_id": "r", "prompt_token_ids": [1], "params": {"temperature": 0.5, "bogus": 1}})
    out = RequestOutput("r", [5], "hi", True, "handoff", 3, 1, 0,
                        [Logprobs(5, -0.1, [(5, -0.1), (7, -2.5)])], sampler_state=b"\x00\x01\xff")
    assert output_from_dict(output_to_dict(out)) == out


def test_kv_layout_and_destination():
    cache = torch.zeros(3, 2, 10, 2, 16, 8, dtype=torch.float16)
    layout = KVLayout.of_cache(cache)
    assert layout.page_bytes == 2 * 16 * 8 * 2
    assert layout.nbytes(4) == 3 * 2 * 4 * layout.page_bytes
    assert layout.shape(4) == (3, 2, 4, 2, 16, 8)
    assert KVLayout.from_dict(layout.to_dict()) == layout
    dest = KVDestination("127.0.0.1:1", RegionHandle("e", "127.0.0.1:1", 2, 4096, True), 128, 1, 3)
    assert KVDestination.from_dict(dest.to_dict()) == dest
    with pytest.raises(ValueError):
        KVDestination.from_dict({"address": "x"})


def test_instance_profile_round_trip():
    profile = InstanceProfile(PrefillCostModel(1e-7, 2e-7, 1e-3, 0.05), DecodeStepModel(0.05, 0.002, 1e-5, 4096))
    assert InstanceProfile.from_dict(profile.to_dict()) == profile
    prefill_only = InstanceProfile(profile.prefill, None)
    assert InstanceProfile.from_dict(prefill_only.to_dict()) == prefill_only


def test_registry_poll_marks_up_reports_fatal_starts_and_restarts():
    import asyncio

    import httpx

    answers = {"id": "one", "fatal": False, "keys": [b"k1"], "version": 3}
    seen_since = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/instance/info":
            if answers["fatal"]:
                return httpx.Response(503, json={"error": "model failed to load: boom", "fatal": True})
            return _info(answers["id"], "prefill")
        seen_since.append(request.url.params.get("since"))
        unchanged = request.url.params.get("since") == str(answers["version"])
        cache = CacheDelta(answers["version"], None if unchanged else answers["keys"])
        return httpx.Response(200, json=InstanceState(answers["id"], cache, {"num_running": 1}).to_dict())

    async def scenario():
        ledger = Ledger()
        client = InstanceClient(SECRET, Fence("", 1), transport=signed_transport(handler, SECRET))
        reg = Registry(client, on_new_incarnation=ledger.forget)
        rec = reg.add("http://inst:1/")
        assert reg.add("http://inst:1") is rec and rec.url == "http://inst:1"
        answers["fatal"] = True
        await reg.poll(rec)
        assert not rec.up and rec.failed_to_start and "boom" in rec.last_error
        answers["fatal"] = False
        await reg.poll(rec)
        assert rec.up and not rec.failed_to_start and rec.cached == {b"k1"} and rec.state.stats["num_running"] == 1
        assert reg.up("prefill") == [rec] and reg.up("decode") == []
        await reg.poll(rec)  # unchanged key set: not sent again, the old one kept
        assert seen_since == [None, "3"] and rec.cached == {b"k1"}
        ledger.book("r").decoding(rec, 5)
        assert ledger.load(rec).running
        answers["id"] = "two"  # the process restarted behind the same URL
        await reg.poll(rec)
        assert not rec.up and rec.last_error == "restarted" and rec.lost.is_set()
        await reg.poll(rec)
        assert rec.up and rec.instance_id == "two" and not ledger.load(rec).running and not rec.lost.is_set()
        await client.close()

    asyncio.run(scenario())


def test_a_local_out_of_descriptors_marks_no_instance_down(caplog):
    """Issue 31: an EMFILE in the Conductor's own process made every poll fail, and so every
    instance was marked down. Now a call that fails for want of our own descriptors or memory is
    our fault: the instance keeps its state, and a request gets 503 with Retry-After."""
    import asyncio
    import errno

    import httpx

    from cluster.conductor.client import OwnResourcesExhausted

    fail = {"with": None}

    def handler(request: httpx.Request) -> httpx.Response:
        if fail["with"] is not None:
            raise httpx.ConnectError("could not connect") from fail["with"]
        if request.url.path == "/instance/info":
            return _info("one", "prefill")
        return _state()

    async def scenario():
        client, reg, rec = await _polled(handler)
        assert rec.up
        fail["with"] = OSError(errno.EMFILE, "Too many open files")
        await reg.poll(rec)
        assert rec.up and not rec.lost.is_set()  # not the instance's fault
        with pytest.raises(OwnResourcesExhausted, match="out of resources") as info:
            await client.state(rec.url, None, 1.0)
        assert info.value.retry_after == 1.0
        fail["with"] = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        await reg.poll(rec)
        assert not rec.up and "Unreachable" in rec.last_error  # the instance's: marked down
        await client.close()

    asyncio.run(scenario())
    assert any("could not poll instance http://inst:1" in r.getMessage() for r in caplog.records)


def test_the_conductor_drops_idle_connections_before_an_instance_would():
    """A call sent on a connection the instance is closing at that moment breaks (ReadError), and
    the Conductor marks a healthy instance down: it keeps an idle connection for less time than
    an instance's server does (uvicorn's keep-alive, and the front door's head deadline)."""
    import uvicorn

    from cluster.conductor.client import KEEPALIVE_EXPIRY_S
    from server.front_door import FrontDoor

    server_idle_close = min(uvicorn.Config(app=None).timeout_keep_alive, FrontDoor().header_timeout_s)
    assert KEEPALIVE_EXPIRY_S <= server_idle_close / 2, (KEEPALIVE_EXPIRY_S, server_idle_close)


def test_the_ttft_correction_learns_how_much_slower_prefills_run_live():
    corr = TTFTCorrection(weight=0.5)
    for _ in range(30):  # every first token 1.5x later than predicted with the factor then
        f = corr.factor
        corr.observe(0.4 * f, 0.6, f)
    assert corr.factor == pytest.approx(1.5, rel=1e-3)
    corr.observe(0.01, 5.0, corr.factor)  # a tiny prompt's TTFT is fixed costs: it says nothing
    assert corr.factor == pytest.approx(1.5, rel=1e-3)
    for _ in range(30):
        corr.observe(0.1, 100.0, corr.factor)  # a stalled cluster: bounded
    assert corr.factor == TTFTCorrection.BOUNDS[1]
    # Placement predicts with it: the same queue, 4x the prefill seconds.
    placed = [Placer(PlacementConfig(admission="none"), PrefillCostModel(0.0, 0.0, 1e-3), None, 16, 64,
                     prefill_factor=f).place(0.0, RequestInfo(0, 400, []), [PrefillInstanceState(0, 0.0, InstanceRecord("http://p"))], [0])
              for f in (1.0, corr.factor)]
    assert placed[1].plan.prefill_s == pytest.approx(4 * placed[0].plan.prefill_s)


def test_a_call_that_times_out_marks_down_only_an_instance_the_probe_finds_down():
    """Issue 52: a loaded decode instance was marked down because one call to it timed out; it
    was up 0.2 s later. A timeout now makes the registry poll at once, and the poll decides."""
    import asyncio

    import httpx

    polls = {"answer": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/instance/info":
            return _info("one", "decode")
        if not polls["answer"]:
            raise httpx.ReadTimeout("no answer")
        return _state()

    async def scenario():
        client, reg, rec = await _polled(handler)
        assert rec.up
        reg.suspect(rec, "generate: ReadTimeout")
        reg.suspect(rec, "generate: ReadTimeout")  # one probe at a time
        assert len(reg._probes) == 1
        await asyncio.gather(*reg._probes.values())
        assert rec.up and not rec.lost.is_set() and reg.suspicions == 1  # slow, not down
        polls["answer"] = False
        reg.suspect(rec, "generate: ReadTimeout")
        await asyncio.gather(*reg._probes.values())
        assert not rec.up and "ReadTimeout" in rec.last_error and rec.lost.is_set()
        await client.close()

    asyncio.run(scenario())


def test_a_pause_of_the_conductor_is_noted_and_told_apart_from_slow_instances():
    """Issue 52: after a 20 s SIGSTOP a Conductor refused every request for 30 s; the TTFTs it
    timed across its own pause read as instances four times slower than predicted. The pause
    watch notes the gap, and at once (before its own next tick) says a first token timed across
    it is not to be learned from."""
    import asyncio
    import time

    from cluster.conductor.upkeep import Upkeep

    async def scenario():
        upkeep = Upkeep(None, None, None, None, None, None, None)
        watch = asyncio.create_task(upkeep.watch_pauses())
        await asyncio.sleep(0.3)
        assert not upkeep.paused_between(time.monotonic() - 0.3, time.monotonic())
        t0 = time.monotonic()
        time.sleep(1.5)  # the whole loop stops, as under SIGSTOP
        t1 = time.monotonic()
        assert upkeep.paused_between(t0, t1)  # before the watch's next tick
        await asyncio.sleep(0.3)
        assert len(upkeep.pauses) == 1 and upkeep.paused_s > 1.0
        assert upkeep.paused_between(t0 + 0.5, t0 + 0.6) and not upkeep.paused_between(t1 + 0.05, time.monotonic())
        watch.cancel()

    asyncio.run(scenario())


def test_after_a_pause_the_instances_are_polled_once_before_any_placement():
    """Issue 52 item 5: admission after a gap uses fresh reports only. ``refresh`` polls every
    instance whose state is older than the gap's end, once for all the requests waiting."""
    import asyncio
    import time

    import httpx

    states = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/instance/info":
            return _info("one", "decode")
        states.append(time.monotonic())
        return _state()

    async def scenario():
        client, reg, rec = await _polled(handler)
        before = rec.state_at
        resumed = time.monotonic()
        await asyncio.gather(*(reg.refresh(resumed) for _ in range(5)))  # five requests after the pause
        assert len(states) == 2 and rec.state_at > resumed > before
        await reg.refresh(resumed)  # fresh now: no poll
        assert len(states) == 2
        await client.close()

    asyncio.run(scenario())
