"""cluster/protocol.py: every message round-trips through its one to_dict/from_dict pair (and
through JSON), a malformed body is a BadRequest naming the field, and each error travels as one
status the client maps back to the same class."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cluster.conductor.client import InstanceClient
from cluster.instance.routes import _as_protocol_error
from cluster.messenger import TransferError
from cluster.protocol import (
    ERRORS, AbortReply, AbortRequest, AdoptReply, AdoptRequest, BadRequest, GenerateRequest, InstanceBusy,
    InstanceFailed, InstanceNotReady, InstanceUnavailable, KVWriteFailed, NoKVRoom, Prefilled, PrefillReply,
    PrefillRequest, PrefixNotCached, PushReply, PushRequest, RenewReply, RenewRequest, RequestError, ReserveReply,
    ReserveRequest, StageJoin, StageLinks, StageSpec, StageSpecReply, TimedOut, Unauthorized, UnknownReservation,
    Unreachable, WrongEpoch, error_from, read_stream_line, stream_line)
from engine.disaggregation import KVCapacityError
from engine.engine_client import EngineError, EngineOverloaded
from engine.outputs import Logprobs, RequestOutput
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.7, top_k=5, stop=["\n"], seed=3, logprobs=2, max_tokens=9)
DEST = {"address": "127.0.0.1:1", "region": {"engine_id": "e"}, "offset": 0, "skip_blocks": 1, "num_blocks": 2}
PEER = {"address": "127.0.0.1:2", "region": {"engine_id": "s"}}
OUT = RequestOutput("r", [5], "hi", False, None, 3, 1, 0, [Logprobs(5, -0.1, [(5, -0.1), (7, -2.5)])],
                    sampler_state=b"\x00\x01\xff")
SPEC = StageSpec({"model": "m", "stage": [0, 2]}, 1024, 2048, 3.0, [4, 8192])

MESSAGES = [
    ReserveRequest("r", [1, 2, 3], PARAMS), ReserveReply(DEST),
    RenewRequest(["a", "b"]), RenewReply(["b"]),
    AbortRequest("r", writes_done=True), AbortReply("r"),
    PrefillRequest("r", [1, 2, 3], PARAMS, DEST), PrefillReply(OUT),
    GenerateRequest("r", [1, 2], PARAMS), GenerateRequest("r", [1, 2], PARAMS, Prefilled(9, 16, b"\x07")),
    Prefilled(9), PushRequest("m", [1, 2], DEST), PushReply(2), AdoptRequest("m", True), AdoptReply(2),
    SPEC, StageJoin("g", 1, 2), StageJoin("g", 1, 2, PEER), StageSpecReply(SPEC),
    StageLinks(PEER), StageLinks(PEER, PEER),
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
])
def test_a_malformed_body_is_a_bad_request_naming_what_is_wrong(cls, body, field):
    with pytest.raises(BadRequest, match=field):
        cls.from_dict(body)


def test_each_error_has_one_status_and_code_and_maps_back_to_itself():
    assert len({e.status for e in ERRORS}) == len(ERRORS) and len({e.code for e in ERRORS}) == len(ERRORS)
    for cls in ERRORS:
        assert issubclass(cls, RequestError) != issubclass(cls, InstanceUnavailable)
        if issubclass(cls, RequestError):
            assert cls.status < 500 or cls is NoKVRoom  # a request error is never a server failure
        e = cls("why")
        back = error_from(e.status, json.loads(json.dumps(e.to_dict())))
        assert type(back) is cls and str(back) == "why"
        assert type(error_from(e.status, None)) is cls  # no body: by the status alone
    assert {c.status for c in ERRORS if issubclass(c, RequestError)} == {400, 404, 410, 424, 429, 507}
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
    return InstanceClient(b"s" * 16, epoch=1, control_timeout_s=1.0, transport=httpx.MockTransport(handler))


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
            out = await client.prefill("http://i", "r", [1, 2, 3], PARAMS, dest, asyncio.Event())
        finally:
            await client.close()
        return dest, out

    dest, out = asyncio.run(call())
    assert dest == ReserveReply(DEST) and dest.num_blocks == 2 and out == OUT
    assert ReserveRequest.from_dict(seen["/instance/reserve"]) == ReserveRequest("r", [1, 2, 3], PARAMS)
    assert PrefillRequest.from_dict(seen["/instance/prefill"]) == PrefillRequest("r", [1, 2, 3], PARAMS, DEST)
