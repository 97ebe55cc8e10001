"""cluster/protocol/: every message round-trips through its one to_dict/from_dict pair (and
through JSON), a malformed body is a BadRequest naming the field, and each error travels as one
status the client maps back to the same class."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from starlette.applications import Starlette

from cluster.conductor.client import InstanceClient
from cluster.conductor.routes import registration_route
from cluster.conductor.conductor import Conductor, ConductorConfig
from cluster.instance.routes import _as_protocol_error
from cluster.messenger import TransferError
from cluster.policies.cost_model import InstanceProfile, PrefillCostModel
from cluster.protocol import (
    CONTROL, ERRORS, INSTANCE, Fence, AbortReply, AbortRequest, AdoptReply, AdoptRequest, BadRequest, CacheDelta,
    ConductorWork, ControlAuth,
    GenerateRequest, InstanceBusy, InstanceFailed, InstanceInfo, InstanceNotReady, InstanceState, InstanceUnavailable,
    KVWriteFailed, NoKVRoom, PoolNaming, Prefilled, PrefillReply, PrefillRequest, PrefixNotCached, PushReply,
    PushRequest, RegisterReply, RegisterRequest, RenewReply, RenewRequest, RequestError, RequestFailed, ReserveReply,
    ReserveRequest, ForgedAnswer,
    SwitchRoleReply, SwitchRoleRequest, StageExpect, StageFinish, StageFinishReply, StageJoin, StageLinks, StageLogits, StagePing, StagePoolLoad,
    StagePoolLoadReply, StagePoolStore, StagePoolStoreEnd, StagePoolStoreEndReply, StagePoolStoreReply,
    StagePoolUnload, StageSpec, StageSpecReply, StageStepCall, TensorSlot, TimedOut, Unauthorized,
    UnknownReservation, Unreachable, WrongEpoch, derive_key, error_from, read_stream_line, stream_line)
from engine.disaggregation import KVCapacityError
from engine.kv_layout import KVLayout
from engine.engine_client import EngineError, EngineOverloaded
from engine.engine_client import RequestFailed as EngineRequestFailed
from engine.outputs import Logprobs, RequestOutput
from engine.sampling_params import SamplingParams
from tests.signed_answers import signed_transport

PARAMS = SamplingParams(temperature=0.7, top_k=5, stop=["\n"], seed=3, logprobs=2, max_tokens=9)
DEST = {"address": "127.0.0.1:1", "region": {"engine_id": "e"}, "offset": 0, "skip_blocks": 1, "num_blocks": 2}
PEER = {"address": "127.0.0.1:2", "region": {"engine_id": "s"}}
OUT = RequestOutput("r", [5], "hi", False, None, 3, 1, 0, [Logprobs(5, -0.1, [(5, -0.1), (7, -2.5)])],
                    sampler_state=b"\x00\x01\xff")
SPEC = StageSpec({"model": "m", "stage": [0, 2]}, 1024, 2048, 3.0, [4, 8192])
INFO = InstanceInfo("i1", "prefill", 7, 4096, {"block_size": 16}, {"prefill": {"c_0": 0.1}}, PoolNaming("ns", 4),
                    "0f" * 16, "float32", "int4")
STATE = InstanceState("i1", CacheDelta(3, [b"\x01\x02", b"k"]), {"num_running": 1, "role": "prefill",
                                                                  "pool_client": {"reads": 2}},
                      {"c2": ConductorWork([(0.5, 400, 16)], [(2.0, 30, 45)], [12])})
SLOT = TensorSlot([2, 3], "bfloat16", 64)

MESSAGES = [
    ReserveRequest("r", [1, 2, 3], PARAMS), ReserveReply(DEST),
    RenewRequest(["a", "b"]), RenewReply(["b"]),
    AbortRequest("r", writes_done=True), AbortReply("r"),
    PrefillRequest("r", [1, 2, 3], PARAMS, DEST), PrefillReply(OUT),
    GenerateRequest("r", [1, 2], PARAMS), GenerateRequest("r", [1, 2], PARAMS, Prefilled(9, 16, b"\x07")),
    ReserveRequest("r", [1, 2, 3], SamplingParams(cache_salt="key 0a1b\nmine")),
    Prefilled(9), PushRequest("m", [1, 2], DEST), PushRequest("m", [1, 2], DEST, "salt"), PushReply(2), AdoptRequest("m", True), AdoptReply(2),
    SPEC, StageJoin("g", 1, 2), StageJoin("g", 1, 2, PEER), StageSpecReply(SPEC),
    StageLinks(PEER), StageLinks(PEER, PEER),
    INFO, InstanceInfo("i1", "decode", 7, 4096, {}, {}), InstanceInfo("i2", "both", 7, 64, {}, {}, deterministic=True),
    PoolNaming("ns", 4),
    CacheDelta(3, [b"k"]), CacheDelta(4, None, [b"a"], [b"b", b"c"]), CacheDelta(4), STATE,
    RegisterRequest("http://h:1", "i1"), RegisterReply("http://h:1", True),
    SwitchRoleRequest("decode", 30.0), SwitchRoleReply("prefill", "decode"), SwitchRoleReply("decode", None),
    SLOT, StageStepCall({"step_id": 1, "rows": [0]}, [SLOT, SLOT]), StageLogits(1, [SLOT]),
    StageLogits(2, error="boom"),
    StageExpect("r", DEST), StageFinish("r", 3.0), StageFinishReply(), StageFinishReply("lost"),
    StagePoolLoad("r", {"grants": []}), StagePoolLoadReply(2), StagePoolUnload("r"),
    StagePoolStore("r", {"objects": []}, [0, 4]), StagePoolStoreReply(True), StagePoolStoreEnd("r", True),
    StagePoolStoreEndReply([[1, 2], [3]]), StagePoolStoreEndReply(), StagePing(),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json(message):
    wire = json.loads(json.dumps(message.to_dict()))
    assert type(message).from_dict(wire) == message


@pytest.mark.parametrize("cls, body, field", [
    (ReserveRequest, [], "JSON object"),
    (ReserveRequest, {"prompt_token_ids": [1], "params": {}}, "request_id"),
    (ReserveRequest, {"request_id": "r", "prompt_token_ids": [], "params": {}}, "prompt_token_ids"),
    (ReserveRequest, {"request_id": "r", "prompt_token_ids": [1, -2], "params": {}}, "prompt_token_ids"),
    (ReserveRequest, {"request_id": "r", "prompt_token_ids": [1], "params": {"bogus": 1}}, "params"),
    (ReserveRequest, {"request_id": "r", "prompt_token_ids": [1], "params": {"max_tokens": 0}}, "params"),
    (ReserveRequest, {"request_id": "r", "prompt_token_ids": [1], "params": {"cache_salt": ""}}, "cache_salt"),
    (PushRequest, {"request_id": "r", "prompt_token_ids": [1], "dest": DEST, "cache_salt": 7}, "cache_salt"),
    (PushRequest, {"request_id": "r", "prompt_token_ids": [1], "dest": DEST, "cache_salt": "s" * 1025}, "cache_salt"),
    (RenewRequest, {"request_ids": ["a", 1]}, "request_ids"),
    (AbortRequest, {"request_id": "r", "writes_done": "yes"}, "writes_done"),
    (PrefillRequest, {"request_id": "r", "prompt_token_ids": [1], "params": {}}, "dest"),
    (PrefillRequest, {"request_id": "r", "prompt_token_ids": [1], "params": {}, "dest": {"num_blocks": "2"}}, "dest"),
    (GenerateRequest, {"request_id": "r", "prompt_token_ids": [1], "params": {}, "prefilled": 3}, "prefilled"),
    (GenerateRequest, {"request_id": "r", "prompt_token_ids": [1], "params": {}, "prefilled": {}}, "first_token"),
    (Prefilled, {"first_token": 1, "sampler_state": "not base64!"}, "sampler_state"),
    (PrefillReply, {"output": {"request_id": "r"}}, "malformed output"),
    (AdoptRequest, {"request_id": "r", "ok": 1}, "ok"),
    (StageJoin, {"group": "g", "stage": "1", "stages": 2}, "stage"),
    (StageSpec, {"engine": {}, "buffer_bytes": 1, "staging_bytes": 1, "timeout_s": 1, "pool": [1]}, "pool"),
    (StageLinks, {"next": None}, "first"),
    (InstanceInfo, {**INFO.to_dict(), "role": "leader"}, "role"),
    (InstanceInfo, {**INFO.to_dict(), "pid": "7"}, "pid"),
    (InstanceInfo, {**INFO.to_dict(), "layout": None}, "layout"),
    (InstanceInfo, {**INFO.to_dict(), "pool": {"namespace": "ns"}}, "blocks_per_object"),
    (CacheDelta, {"cache_version": 1, "cached_keys": ["zz"]}, "cached_keys"),
    (CacheDelta, {"cache_version": 1, "cached_removed": []}, "cached_added"),
    (CacheDelta, {"cache_version": None, "cached_keys": []}, "cache_version"),
    (InstanceState, {"cache_version": 1, "cached_keys": []}, "instance_id"),
    (InstanceState, {"instance_id": "i", "cached_keys": []}, "cache_version"),
    (RegisterRequest, {"url": "h:1", "instance_id": "i"}, "url"),
    (RegisterRequest, {"url": "http://h:1"}, "instance_id"),
    (RegisterReply, {"registered": "http://h:1", "up": "yes"}, "up"),
    (InstanceState, {"instance_id": "i", "cache_version": 1, "cached_keys": [], "role": "chef"}, "role"),
    (SwitchRoleRequest, {"role": "both", "drain_s": 1.0}, "both"),
    (SwitchRoleRequest, {"role": "decode", "drain_s": 0}, "drain_s"),
    (TensorSlot, {"shape": [2, -1], "dtype": "float32", "offset": 0}, "shape"),
    (TensorSlot, {"shape": [2], "dtype": "", "offset": 0}, "dtype"),
    (StageStepCall, {"tensors": []}, "step"),
    (StageStepCall, {"step": {}, "tensors": [1]}, "tensors"),
    (StageStepCall, {"step": {}, "tensors": [{"shape": [1], "dtype": "float32"}]}, "offset"),
    (StageLogits, {"step_id": 1, "tensors": [], "error": 3}, "error"),
    (StageExpect, {"request_id": "r", "dest": {}}, "dest"),
    (StageFinish, {"request_id": "r", "timeout_s": "3"}, "timeout_s"),
    (StageFinishReply, {"error": ""}, "error"),
    (StagePoolLoad, {"request_id": "r", "leases": []}, "leases"),
    (StagePoolLoadReply, {}, "good"),
    (StagePoolUnload, {"op": "stage_pool_unload"}, "request_id"),
    (StagePoolStore, {"request_id": "r", "reservation": {}, "first_blocks": [0.5]}, "first_blocks"),
    (StagePoolStoreReply, {"ok": 1}, "ok"),
    (StagePoolStoreEnd, {"request_id": "r", "commit": "no"}, "commit"),
    (StagePoolStoreEndReply, {"checksums": [[1], "x"]}, "checksums"),
    (StagePing, [], "JSON object"),
])
def test_a_malformed_body_is_a_bad_request_naming_what_is_wrong(cls, body, field):
    with pytest.raises(BadRequest, match=field):
        cls.from_dict(body)


def test_each_error_has_one_status_and_code_and_maps_back_to_itself():
    # Two exceptions, told apart by their codes: a request that failed inside the engine is a 500
    # like a failed instance (by the status alone it reads as the instance's failure), and a
    # forged answer a 502 like no answer (the client's own, never sent).
    assert len({e.status for e in ERRORS}) == len(ERRORS) - 2 and len({e.code for e in ERRORS}) == len(ERRORS)
    for cls in ERRORS:
        assert issubclass(cls, RequestError) != issubclass(cls, InstanceUnavailable)
        if issubclass(cls, RequestError):
            # A request error is never the server's failure, but for the request's own.
            assert cls.status < 500 or cls in (NoKVRoom, RequestFailed)
        e = cls("why")
        back = error_from(e.status, json.loads(json.dumps(e.to_dict())))
        assert type(back) is cls and str(back) == "why"
        assert type(error_from(e.status, None)) is {RequestFailed: InstanceFailed, ForgedAnswer: Unreachable}.get(cls, cls)
    assert {c.status for c in ERRORS if issubclass(c, RequestError)} == {400, 403, 404, 410, 413, 424, 429, 500, 507}
    assert {c.status for c in ERRORS if issubclass(c, InstanceUnavailable)} == {401, 409, 500, 502, 503, 504}
    assert type(error_from(418, {"error": "teapot"})) is InstanceFailed
    busy = error_from(429, {"error": "full"}, retry_after="3")
    assert isinstance(busy, InstanceBusy) and busy.retry_after == 3.0
    assert error_from(503, InstanceNotReady("boom", fatal=True).to_dict()).fatal
    assert isinstance(BadRequest("x"), ValueError) and isinstance(UnknownReservation("x"), LookupError)


def test_the_instance_names_each_exception_it_can_raise():
    for raised, expected in [
        (EngineOverloaded("busy", retry_after=2.0), InstanceBusy), (KVCapacityError("full"), NoKVRoom),
        (UnknownReservation("gone"), UnknownReservation), (ValueError("bad"), BadRequest),
        (json.JSONDecodeError("x", "", 0), BadRequest), (TransferError("broke"), KVWriteFailed),
        (TimeoutError(), InstanceBusy), (EngineError("died"), InstanceFailed), (WrongEpoch("old"), WrongEpoch),
        (EngineRequestFailed("its step raised"), RequestFailed),
    ]:
        assert type(_as_protocol_error(raised)) is expected, raised
    with pytest.raises(KeyError):  # a bug, not a missing reservation: a 500 with its traceback
        _as_protocol_error(KeyError("a bug"))


def test_stream_lines_carry_outputs_and_the_error_that_ended_the_stream():
    assert read_stream_line(stream_line(OUT).decode()) == OUT
    with pytest.raises(InstanceFailed, match="died"):
        read_stream_line(stream_line(InstanceFailed("died")).decode())
    with pytest.raises(BadRequest):
        read_stream_line(stream_line(BadRequest("bad params")).decode())
    with pytest.raises(InstanceFailed, match="malformed"):
        read_stream_line('{"request_id": 1}')  # the instance's fault, not the request's
    with pytest.raises(InstanceFailed, match="malformed"):
        read_stream_line("not json")


def _client(handler) -> InstanceClient:
    return InstanceClient(b"s" * 16, Fence("", 1), control_timeout_s=1.0, transport=signed_transport(handler, b"s" * 16))


@pytest.mark.parametrize("answer, expected", [
    (httpx.Response(507, json=NoKVRoom("no room").to_dict()), NoKVRoom),
    (httpx.Response(404, json={"error": "nope"}), UnknownReservation),
    (httpx.Response(409, json=WrongEpoch("newer").to_dict()), WrongEpoch),
    (httpx.Response(410, json=PrefixNotCached("evicted").to_dict()), PrefixNotCached),
    (httpx.Response(401, text="unsigned"), Unauthorized),
    (httpx.Response(500, text="<html>"), InstanceFailed),
    (httpx.Response(200, json={"dest": {"num_blocks": 1}}), InstanceFailed),  # a malformed answer
    (httpx.ConnectError("refused"), Unreachable),
    (httpx.ReadTimeout("slow"), TimedOut),
])
def test_the_client_maps_an_answer_back_to_the_typed_error(answer, expected):
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def call():
        client = _client(handler)
        try:
            await client.reserve("http://i", "r", [1], PARAMS)
        finally:
            await client.close()

    with pytest.raises(expected):
        asyncio.run(call())


def test_the_client_sends_the_messages_the_instance_reads():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen[request.url.path] = body
        if request.url.path == "/instance/reserve":
            return httpx.Response(200, json=ReserveReply(DEST).to_dict())
        return httpx.Response(200, json=PrefillReply(OUT).to_dict())

    async def call():
        client = _client(handler)
        try:
            dest = await client.reserve("http://i", "r", [1, 2, 3], PARAMS)
            out = await client.prefill("http://i", "r", [1, 2, 3], PARAMS, None, dest, asyncio.Event())
        finally:
            await client.close()
        return dest, out

    dest, out = asyncio.run(call())
    assert dest == ReserveReply(DEST) and dest.num_blocks == 2 and out == OUT
    assert ReserveRequest.from_dict(seen["/instance/reserve"]) == ReserveRequest("r", [1, 2, 3], PARAMS)
    assert PrefillRequest.from_dict(seen["/instance/prefill"]) == PrefillRequest("r", [1, 2, 3], PARAMS, DEST)


def test_a_state_travels_flat_as_an_instances_stats_and_each_stage_call_names_its_op():
    assert STATE.to_dict() == {"instance_id": "i1", "num_running": 1, "role": "prefill", "pool_client": {"reads": 2},
                               "cache_version": 3, "cached_keys": ["0102", "6b"],
                               "work": {"c2": {"prefills": [[0.5, 400, 16]], "decodes": [[2.0, 30, 45]],
                                               "incoming": [12]}}}
    assert CacheDelta(4).to_dict() == {"cache_version": 4, "cached_added": [], "cached_removed": []}
    calls = [m for m in MESSAGES if hasattr(m, "OP")]
    assert len({m.OP for m in calls}) == 9 and all(m.to_dict()["op"] == m.OP for m in calls)


def test_the_polls_answer_typed_and_a_malformed_answer_is_the_instances_fault():
    answers = {"/instance/info": INFO.to_dict(), "/instance/state": STATE.to_dict()}
    since = []

    def handler(request: httpx.Request) -> httpx.Response:
        since.append(request.url.params.get("since"))
        return httpx.Response(200, json=answers[request.url.path])

    async def call():
        client = _client(handler)
        try:
            assert await client.info("http://i", 1.0) == INFO
            assert await client.state("http://i", 3, 1.0) == STATE
            answers["/instance/state"] = {"instance_id": "i1", "num_running": 1}
            with pytest.raises(InstanceFailed, match="cache_version"):
                await client.state("http://i", None, 1.0)
            # The load it reports of each Conductor's work is read typed too: a negative age or
            # count is the instance's fault, never a load taken as it is.
            for bad in ({"c2": {"prefills": [[-1.0, 400, 0]], "decodes": [], "incoming": []}},
                        {"c2": {"prefills": [], "decodes": [[1.0, 30]], "incoming": []}},
                        {"c2": {"prefills": [], "decodes": [], "incoming": [-3]}}, {"c2": []}):
                answers["/instance/state"] = {**STATE.to_dict(), "work": bad}
                with pytest.raises(InstanceFailed, match="prefills|decodes|incoming|JSON object"):
                    await client.state("http://i", None, 1.0)
        finally:
            await client.close()

    asyncio.run(call())
    assert since == [None, "3", None, None, None, None, None]


def test_registration_answers_a_register_reply_and_a_malformed_body_400():
    secret = b"s" * 16

    def instance(request: httpx.Request) -> httpx.Response:
        profile = InstanceProfile(PrefillCostModel(1e-7, 2e-7, 1e-3, 0.05), None)
        info = InstanceInfo("i1", "decode", 7, 4096, KVLayout(2, 2, 16, 8, "float32").to_dict(), profile.to_dict())
        return httpx.Response(200, json=(info if request.url.path == "/instance/info" else STATE).to_dict())

    async def call():
        conductor = Conductor(ConductorConfig(secret=secret, epoch=1))
        conductor.registry.client = _client(instance)
        app = Starlette(routes=[registration_route(conductor)])
        auth = ControlAuth(derive_key(secret, INSTANCE))  # instances sign with a key of their own purpose
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://c",
                                     auth=ControlAuth(derive_key(secret, CONTROL))) as http:
            as_conductor = await http.post("/cluster/register", json=RegisterRequest("http://i:1", "i1").to_dict())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://c", auth=auth) as http:
            ok = await http.post("/cluster/register", json=RegisterRequest("http://i:1", "i1").to_dict())
            bad = await http.post("/cluster/register", json={"url": "i:1", "instance_id": "i1"})
            not_json = await http.post("/cluster/register", content=b"{")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://c") as http:
            unsigned = await http.post("/cluster/register", json=RegisterRequest("http://i:1", "i1").to_dict())
        await conductor.registry.client.close()
        await conductor.client.close()
        return conductor, ok, bad, not_json, unsigned, as_conductor

    conductor, ok, bad, not_json, unsigned, as_conductor = asyncio.run(call())
    assert as_conductor.status_code == 401, "a registration signed with the Conductors' key was taken"
    assert ok.status_code == 200 and RegisterReply.from_dict(ok.json()) == RegisterReply("http://i:1", True)
    (rec,) = conductor.registry.records
    assert rec.url == "http://i:1" and rec.up and rec.info.pid == 7 and rec.state == STATE
    for r in (bad, not_json):
        assert r.status_code == 400 and r.json()["code"] == BadRequest.code
    assert "url" in bad.json()["error"] and "JSON object" in not_json.json()["error"]
    assert unsigned.status_code == 401 and unsigned.json()["code"] == Unauthorized.code


def test_a_fence_header_is_an_id_and_an_int64_epoch():
    assert Fence.parse("conductor-a/12") == Fence("conductor-a", 12) and Fence.parse("7") == Fence("", 7)
    assert Fence.parse(f"a/{2**63 - 1}").epoch == 2**63 - 1
    for bad in ("nonsense", "a/-1", f"a/{2**63}", "a/" + "1" + "0" * 30, "a/1e3", "bad id/3", "x" * 65 + "/1"):
        with pytest.raises(BadRequest):
            Fence.parse(bad)
