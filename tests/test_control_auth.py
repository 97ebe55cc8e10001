"""Signed control requests (``cluster/protocol/``): keys, signatures, replays, and the httpx
and starlette glue, against an in-process app and a real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from cluster.protocol import (
    CONTROL,
    INSTANCE,
    MEMBERSHIP,
    DIGEST_HEADER,
    MESSENGER,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    ControlAuth,
    ControlAuthError,
    ControlVerifier,
    derive_key,
    sign,
    verify_request,
)

SECRET = b"0123456789abcdef-cluster-secret"
KEY = derive_key(SECRET, CONTROL)
T0 = 1_700_000_000.0
BODY = b'{"request_id": "r1", "prompt_token_ids": [1, 2, 3]}'
TARGET = "/instance/prefill?rid=r1&x=%2F"


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _verifier(clock: Clock | None = None, max_skew_s: float = 30.0) -> ControlVerifier:
    return ControlVerifier(KEY, max_skew_s=max_skew_s, clock=clock or Clock())


# -- keys --------------------------------------------------------------------------------------------
def test_keys_per_purpose_are_unrelated_to_each_other_and_to_the_secret():
    control, messenger = derive_key(SECRET, CONTROL), derive_key(SECRET, MESSENGER)
    assert len(control) == len(messenger) == 32
    assert control != messenger
    # Each purpose a key of its own: a call signed with one is not one signed with another.
    keys = {derive_key(SECRET, p) for p in (CONTROL, MESSENGER, INSTANCE, MEMBERSHIP)}
    assert len(keys) == 4
    assert SECRET not in (control, messenger)
    assert SECRET.hex().encode() not in (control, messenger)
    assert derive_key(SECRET, CONTROL) == control  # deterministic: both ends derive the same key
    assert derive_key(SECRET + b"!", CONTROL) != control
    with pytest.raises(ValueError):
        derive_key(b"", CONTROL)
    with pytest.raises(ValueError):
        derive_key(SECRET, "")


# -- sign / verify -----------------------------------------------------------------------------------
def test_round_trip():
    headers = sign(KEY, "POST", TARGET, BODY, now=T0)
    assert set(headers) == {TIMESTAMP_HEADER, NONCE_HEADER, DIGEST_HEADER, SIGNATURE_HEADER}
    assert headers[DIGEST_HEADER] == hashlib.sha256(BODY).hexdigest()
    assert headers[TIMESTAMP_HEADER] == str(int(T0))
    _verifier().verify("POST", TARGET, headers, BODY)
    # Methods are compared case-insensitively, as HTTP clients may spell them either way.
    _verifier().verify("post", TARGET, sign(KEY, "POST", TARGET, BODY, now=T0), BODY)
    # Two signatures of the same request differ (fresh nonce), so both are accepted.
    v = _verifier()
    v.verify("POST", TARGET, sign(KEY, "POST", TARGET, BODY, now=T0), BODY)
    v.verify("POST", TARGET, sign(KEY, "POST", TARGET, BODY, now=T0), BODY)


@pytest.mark.parametrize("change, message", [
    (lambda r: {**r, "body": BODY.replace(b"r1", b"r2")}, "does not match its signed SHA-256"),
    (lambda r: {**r, "target": "/instance/decode?rid=r1&x=%2F"}, "bad signature"),
    (lambda r: {**r, "target": TARGET + "&extra=1"}, "bad signature"),
    (lambda r: {**r, "method": "PUT"}, "bad signature"),
    (lambda r: {**r, "headers": {**r["headers"], TIMESTAMP_HEADER: str(int(T0) + 1)}}, "bad signature"),
    (lambda r: {**r, "headers": {**r["headers"], NONCE_HEADER: "0" * 32}}, "bad signature"),
    # A consistent new digest for a new body does not help without the key.
    (lambda r: {**r, "body": b"{}", "headers": {**r["headers"], DIGEST_HEADER: hashlib.sha256(b"{}").hexdigest()}},
     "bad signature"),
])
def test_tampering_is_refused(change, message):
    original = {"method": "POST", "target": TARGET, "body": BODY,
                "headers": sign(KEY, "POST", TARGET, BODY, now=T0)}
    r = change(original)
    with pytest.raises(ControlAuthError, match=message):
        _verifier().verify(r["method"], r["target"], r["headers"], r["body"])


def test_wrong_key_missing_and_malformed_headers_are_refused():
    with pytest.raises(ControlAuthError, match="bad signature"):
        _verifier().verify("POST", TARGET, sign(derive_key(SECRET, MESSENGER), "POST", TARGET, BODY, now=T0), BODY)
    headers = sign(KEY, "POST", TARGET, BODY, now=T0)
    with pytest.raises(ControlAuthError, match=f"missing {SIGNATURE_HEADER}"):
        _verifier().verify("POST", TARGET, {k: v for k, v in headers.items() if k != SIGNATURE_HEADER}, BODY)
    with pytest.raises(ControlAuthError, match="unsigned"):
        _verifier().verify("POST", TARGET, {"Authorization": "Bearer " + SECRET.hex()}, BODY)
    with pytest.raises(ControlAuthError, match="malformed"):
        _verifier().verify("POST", TARGET, {**headers, TIMESTAMP_HEADER: "9" * 5000}, BODY)
    with pytest.raises(ControlAuthError, match="malformed"):
        _verifier().verify("POST", TARGET, {**headers, NONCE_HEADER: "xyz"}, BODY)


def test_replay_is_refused():
    v = _verifier()
    headers = sign(KEY, "POST", TARGET, BODY, now=T0)
    v.verify("POST", TARGET, headers, BODY)
    with pytest.raises(ControlAuthError, match="replayed"):
        v.verify("POST", TARGET, headers, BODY)
    # A refused request (bad signature) does not burn its nonce for the genuine one.
    genuine = sign(KEY, "POST", TARGET, BODY, now=T0)
    with pytest.raises(ControlAuthError, match="bad signature"):
        v.verify("POST", "/elsewhere", genuine, BODY)
    v.verify("POST", TARGET, genuine, BODY)


def test_clock_skew_is_refused_both_ways():
    clock = Clock()
    v = _verifier(clock, max_skew_s=30)
    v.verify("GET", "/instance/state", sign(KEY, "GET", "/instance/state", b"", now=T0 - 30), b"")
    v.verify("GET", "/instance/state", sign(KEY, "GET", "/instance/state", b"", now=T0 + 30), b"")
    with pytest.raises(ControlAuthError, match="stale or future-dated.*-31 s"):
        v.verify("GET", "/instance/state", sign(KEY, "GET", "/instance/state", b"", now=T0 - 31), b"")
    with pytest.raises(ControlAuthError, match=r"stale or future-dated.*\+31 s"):
        v.verify("GET", "/instance/state", sign(KEY, "GET", "/instance/state", b"", now=T0 + 31), b"")


def test_nonces_are_forgotten_once_their_timestamp_leaves_the_window():
    clock = Clock()
    v = _verifier(clock, max_skew_s=30)
    old = sign(KEY, "GET", "/instance/state", b"", now=T0)
    v.verify("GET", "/instance/state", old, b"")
    for i in range(50):
        clock.now = T0 + i
        v.verify("GET", "/instance/state", sign(KEY, "GET", "/instance/state", b"", now=clock.now), b"")
    # Memory follows the window, not the history: only the nonces stamped T0+19 .. T0+49 are held.
    assert v.remembered_nonces == 31
    clock.now = T0 + 200
    v.verify("GET", "/instance/state", sign(KEY, "GET", "/instance/state", b"", now=clock.now), b"")
    assert v.remembered_nonces == 1  # all but the newest expired
    # The forgotten request still cannot be replayed: its timestamp is now out of the window.
    with pytest.raises(ControlAuthError, match="stale"):
        v.verify("GET", "/instance/state", old, b"")


# -- httpx hook and starlette helper ---------------------------------------------------------------
def _app(verifier: ControlVerifier) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        if (error := await verify_request(verifier, request)) is not None:
            return JSONResponse(error.to_dict(), status_code=error.status)
        body = await request.body()  # read again after verification: starlette cached it
        return JSONResponse({"json": json.loads(body) if body else None,
                             "query": dict(request.query_params)})

    return Starlette(routes=[Route("/instance/{name}", echo, methods=["GET", "POST"])])


def _secret_nowhere(headers: httpx.Headers) -> None:
    assert "authorization" not in headers
    text = json.dumps(list(headers.multi_items()))
    for form in (SECRET.hex(), SECRET.decode(), KEY.hex()):
        assert form not in text


async def _exercise(base_url: str, transport: httpx.AsyncBaseTransport | None = None) -> None:
    """Signed calls of every body shape pass; unsigned and replayed ones get 401."""
    sent: list[httpx.Request] = []

    async def remember(request: httpx.Request) -> None:  # runs after the auth flow signed it
        sent.append(request)

    signed = httpx.AsyncClient(base_url=base_url, transport=transport, auth=ControlAuth(KEY),
                               event_hooks={"request": [remember]})
    plain = httpx.AsyncClient(base_url=base_url, transport=transport)
    async with signed, plain:
        r = await signed.post("/instance/admit", json={"request_id": "a", "ids": [1, 2]})
        assert r.status_code == 200, r.text
        assert r.json()["json"] == {"request_id": "a", "ids": [1, 2]}

        r = await signed.get("/instance/state", params={"rid": "a/b c", "n": "1"})
        assert r.status_code == 200, r.text
        assert r.json() == {"json": None, "query": {"rid": "a/b c", "n": "1"}}

        async with signed.stream("POST", "/instance/generate", json={"stream": True}) as s:
            assert s.status_code == 200
            assert json.loads(await s.aread())["json"] == {"stream": True}

        async def chunks():
            yield b'{"chunked": '
            yield b"true}"

        r = await signed.post("/instance/chunked", content=chunks())
        assert r.status_code == 200, r.text
        assert r.json()["json"] == {"chunked": True}

        for request in sent:
            _secret_nowhere(request.headers)

        r = await plain.post("/instance/admit", json={"request_id": "a"})
        assert r.status_code == 401 and "unsigned" in r.json()["error"]
        r = await plain.post("/instance/admit", json={"request_id": "a"},
                             headers={"Authorization": "Bearer " + SECRET.hex()})
        assert r.status_code == 401  # the old bearer secret no longer opens anything

        first = sent[0]
        replay = await plain.post(first.url.raw_path.decode(), content=first.content,
                                  headers={k: v for k, v in first.headers.items() if k.startswith("x-mooncake")})
        assert replay.status_code == 401 and "replayed" in replay.json()["error"]


def test_httpx_auth_against_starlette_in_process():
    app = _app(ControlVerifier(KEY))
    asyncio.run(_exercise("http://instance", httpx.ASGITransport(app=app)))


def test_httpx_auth_against_uvicorn_on_loopback():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_app(ControlVerifier(KEY)), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        asyncio.run(_exercise("http://127.0.0.1:%d" % sock.getsockname()[1]))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    assert not thread.is_alive()


def test_sync_client_is_signed_too():
    verifier = ControlVerifier(KEY)

    def handler(request: httpx.Request) -> httpx.Response:
        try:
            verifier.verify(request.method, request.url.raw_path.decode(), request.headers, request.content)
        except ControlAuthError as e:
            return httpx.Response(401, text=str(e))
        return httpx.Response(200)

    with httpx.Client(transport=httpx.MockTransport(handler), auth=ControlAuth(KEY)) as client:
        assert client.post("http://instance/instance/abort?rid=x", json={"rid": "x"}).status_code == 200
        assert client.post("http://instance/instance/abort", content=iter([b"a", b"b"])).status_code == 200
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        assert client.post("http://instance/instance/abort", json={}).status_code == 401
