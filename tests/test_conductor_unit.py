"""The Conductor's pure parts: its configuration, the registry's snapshots for the policies, and
the JSON forms that travel between the Conductor and the instances."""

from __future__ import annotations

import pytest
import torch

from cluster.policies.cost_model import InstanceProfile
from cluster.conductor.conductor import ConductorConfig
from cluster.conductor.placement import PlacementConfig
from cluster.conductor.client import InstanceClient
from cluster.conductor.ledger import InstanceLoad, Ledger, RunningDecode
from cluster.conductor.registry import InstanceRecord, Registry
from cluster.policies.cost_model import DecodeStepModel, PrefillCostModel
from cluster.kv_stream import KVDestination
from cluster.messenger import RegionHandle
from cluster.protocol import (CacheDelta, Fence, InstanceInfo, InstanceState, ReserveRequest, output_from_dict,
                              output_to_dict)
from engine.kv_layout import KVLayout
from engine.outputs import RequestOutput
from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams
from tests.signed_answers import signed_transport

SECRET = b"0123456789abcdef0123"


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
    {"admission": "early"},  # no SLOs
    {"admission": "predictive", "slo_ttft_s": 1.0},
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

    profile = InstanceProfile(PrefillCostModel(1e-7, 2e-7, 1e-3, 0.05), None)
    layout = KVLayout(2, 2, 16, 8, "float32")
    answers = {"id": "one", "fatal": False, "keys": [b"k1"], "version": 3}
    seen_since = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/instance/info":
            if answers["fatal"]:
                return httpx.Response(503, json={"error": "model failed to load: boom", "fatal": True})
            info = InstanceInfo(answers["id"], "prefill", 1, 64, layout.to_dict(), profile.to_dict())
            return httpx.Response(200, json=info.to_dict())
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
        ledger.load(rec).running["r"] = RunningDecode(0.0, 5)
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

    profile = InstanceProfile(PrefillCostModel(1e-7, 2e-7, 1e-3, 0.05), None)
    layout = KVLayout(2, 2, 16, 8, "float32")
    fail = {"with": None}

    def handler(request: httpx.Request) -> httpx.Response:
        if fail["with"] is not None:
            raise httpx.ConnectError("could not connect") from fail["with"]
        if request.url.path == "/instance/info":
            return httpx.Response(200, json=InstanceInfo("one", "prefill", 1, 64, layout.to_dict(), profile.to_dict()).to_dict())
        return httpx.Response(200, json=InstanceState("one", CacheDelta(1, []), {}).to_dict())

    async def scenario():
        client = InstanceClient(SECRET, Fence("", 1), transport=signed_transport(handler, SECRET))
        reg = Registry(client)
        rec = reg.add("http://inst:1")
        await reg.poll(rec)
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
