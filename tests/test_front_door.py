"""server/front_door.py: the head and body deadlines and the connection cap of every HTTP port,
and the caps per client of the public one."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import subprocess
import sys
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from server.app import ServerSettings
from server.cli import instance_args, parse_args
from server.launch import front_door
import server.front_door as front_door_module
from server.front_door import (DEFAULT_CONNECTIONS_PER_CLIENT, MIN_CONNECTIONS, RESERVED_FDS, ClientRateLimit,
                               FrontDoor, default_max_connections)
from threaded_server import serve_in_thread


def _app(seen: dict) -> Starlette:
    async def echo(request: Request):
        try:
            body = await request.body()
        except ClientDisconnect:
            seen["disconnected"] = seen.get("disconnected", 0) + 1
            raise
        return JSONResponse({"bytes": len(body)})

    async def stream(request: Request):
        async def chunks():
            for i in range(6):
                await asyncio.sleep(0.25)
                yield f"{i}\n"
        return StreamingResponse(chunks(), media_type="text/plain")

    async def hello(request: Request):
        return PlainTextResponse("hi")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream),
                             Route("/", hello)])


@pytest.fixture
def serve_door():
    """Start the test app behind a FrontDoor on a free port; yields a starter returning (port, seen)."""
    with contextlib.ExitStack() as stack:
        def start(door: FrontDoor) -> tuple[int, dict]:
            seen: dict = {}
            return stack.enter_context(serve_in_thread(door.wrap(_app(seen)), http=door.protocol())), seen

        yield start


def _closed_within(conn: socket.socket, within_s: float, trickle: bytes = b"", every_s: float = 0.1) -> float:
    """Seconds until the server closes ``conn`` (sending ``trickle`` a byte at a time meanwhile);
    fails after ``within_s``."""
    t0 = time.monotonic()
    conn.settimeout(every_s)
    i = 0
    while time.monotonic() - t0 < within_s:
        try:
            if conn.recv(4096) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0
        if i < len(trickle):
            try:
                conn.sendall(trickle[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
            i += 1
    raise AssertionError(f"still open after {within_s} s")


def test_silent_and_slow_header_clients_are_closed_at_the_head_deadline(serve_door):
    port, _ = serve_door(FrontDoor(header_timeout_s=0.6, body_timeout_s=5))
    silent = socket.create_connection(("127.0.0.1", port))
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"GET / HTTP/1.1\r\n")
    assert 0.4 < _closed_within(silent, 5) < 2.5
    # A header byte every 0.1 s does not extend the deadline.
    took = _closed_within(slow, 5, trickle=b"Host: x\r\nX-Slow: " + b"a" * 100)
    assert took < 2.5
    # A client that sends its request in time is served, and again on the same connection.
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
        assert c.get("/").text == "hi"
        time.sleep(0.2)
        assert c.get("/").text == "hi"


def test_a_slow_body_is_cut_at_the_body_deadline_and_responses_are_not(serve_door):
    port, seen = serve_door(FrontDoor(header_timeout_s=5, body_timeout_s=0.6))
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 1000\r\n\r\n")
    assert _closed_within(conn, 5, trickle=b"b" * 100) < 2.5
    deadline = time.monotonic() + 5
    while not seen.get("disconnected") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen.get("disconnected") == 1  # the endpoint saw the client gone
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
        assert c.post("/echo", content=b"x" * 5000).json() == {"bytes": 5000}
        # A 1.5 s stream outlives both deadlines: they bound requests, never responses.
        t0 = time.monotonic()
        assert c.get("/stream").text == "".join(f"{i}\n" for i in range(6))
        assert time.monotonic() - t0 > 1.2


def test_connections_past_the_cap_are_closed_at_once(serve_door):
    port, _ = serve_door(FrontDoor(header_timeout_s=30, body_timeout_s=30, max_connections=4))
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    time.sleep(0.2)  # accepted
    extra = socket.create_connection(("127.0.0.1", port))
    assert _closed_within(extra, 2) < 1.0
    for s in held:  # the four under the cap were left alone
        s.setblocking(False)
        with pytest.raises(BlockingIOError):
            s.recv(1)
        s.close()
    deadline = time.monotonic() + 5
    while True:  # the server notices the closes; then there is room again
        try:
            assert httpx.get(f"http://127.0.0.1:{port}/", timeout=2).text == "hi"
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_one_client_past_its_connection_cap_gets_a_429_and_loopback_is_exempt(serve_door, monkeypatch):
    """Issue 40 item 6: one client address may not hold more than its share of connections."""
    port, _ = serve_door(FrontDoor(header_timeout_s=30, body_timeout_s=30, max_connections_per_client=3))
    loopback = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]  # exempt: the cluster itself
    time.sleep(0.2)
    assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "hi"
    for s in loopback:
        s.close()
    monkeypatch.setattr(front_door_module, "_is_loopback", lambda host: False)  # as if from another host
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    time.sleep(0.2)
    extra = socket.create_connection(("127.0.0.1", port))
    extra.settimeout(5)
    answer = extra.recv(4096)
    assert answer.startswith(b"HTTP/1.1 429 ") and b"Retry-After: 1" in answer and b"rate_limit_exceeded" in answer
    assert _closed_within(extra, 2) < 1.0
    held.pop().close()
    deadline = time.monotonic() + 5
    while True:  # the server notices the close: the client has room for one again
        r = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200
    for s in held:
        s.close()


def test_one_client_past_its_request_rate_gets_a_429_with_retry_after(serve_door, monkeypatch):
    port, _ = serve_door(FrontDoor(header_timeout_s=30, body_timeout_s=30, max_requests_per_client_s=2))
    url = f"http://127.0.0.1:{port}/"
    with httpx.Client(timeout=5) as http:
        assert all(http.get(url).status_code == 200 for _ in range(10)), "a loopback client is exempt"
        monkeypatch.setattr(front_door_module, "_is_loopback", lambda host: False)
        statuses = [http.get(url) for _ in range(5)]  # a burst of two seconds' worth, then none
        assert [r.status_code for r in statuses] == [200, 200, 200, 200, 429]
        refused = statuses[-1]
        assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        time.sleep(0.6)  # one token back at two a second
        assert http.get(url).status_code == 200


def test_serving_raises_the_soft_open_file_limit_to_the_hard_one():
    """Under the common soft limit of 1,024 the default cap was 768 connections (issue 40)."""
    code = ("import resource, server.front_door as f; soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "assert soft == 512, soft; new = f.raise_open_file_limit(); "
            "assert resource.getrlimit(resource.RLIMIT_NOFILE) == (new, hard), new; "
            "assert new == (hard if hard != resource.RLIM_INFINITY else 1 << 20), (new, hard); "
            "assert f.default_max_connections() == new - f.RESERVED_FDS; print('ok')")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 512:
        pytest.skip(f"the hard open-file limit here is {hard}: nothing to raise")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard)))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_limits_and_their_flags():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert default_max_connections() == max(MIN_CONNECTIONS, soft - RESERVED_FDS)
    for bad in (dict(header_timeout_s=0), dict(body_timeout_s=-1), dict(max_connections=0)):
        with pytest.raises(ValueError):
            FrontDoor(**bad)
    args = parse_args(["--header-timeout-s", "3", "--body-timeout-s", "7", "--max-connections", "900"])
    assert front_door(args) == FrontDoor(header_timeout_s=3, body_timeout_s=7, max_connections=900)
    flags = instance_args(args)  # the instances a Conductor starts get the same limits
    for flag, value in (("--header-timeout-s", "3.0"), ("--body-timeout-s", "7.0"), ("--max-connections", "900")):
        assert flags[flags.index(flag) + 1] == value
    assert "--max-connections" not in instance_args(parse_args([]))
    # The caps per client are the public port's only: an instance's callers are Conductors.
    args = parse_args(["--max-connections-per-client", "8", "--max-requests-per-client-s", "5",
                       "--trusted-proxy", "10.0.0.5"])
    public = ServerSettings(api_keys=("k1",))
    assert front_door(args, public=public) == FrontDoor(max_connections_per_client=8, max_requests_per_client_s=5,
                                                        client_keys=("k1",), trusted_proxies=frozenset({"10.0.0.5"}))
    assert front_door(args) == FrontDoor()
    assert "--max-connections-per-client" not in instance_args(args) and "--trusted-proxy" not in instance_args(args)
    assert front_door(parse_args([]), public=ServerSettings()) == FrontDoor(
        max_connections_per_client=DEFAULT_CONNECTIONS_PER_CLIENT)
    assert front_door(parse_args(["--max-connections-per-client", "0"]), public=ServerSettings()) == FrontDoor()
    for bad in (dict(max_connections_per_client=0), dict(max_requests_per_client_s=0)):
        with pytest.raises(ValueError):
            FrontDoor(**bad)


def test_the_request_cap_counts_users_keys_and_the_address_a_trusted_balancer_saw():
    """Issue 52: behind a balancer on this host every client was loopback (exempt), and
    X-Forwarded-For was never read. Now a user's key is one client wherever it comes from; a
    trusted balancer's last X-Forwarded-For entry names the client; anyone else's header is not
    believed; an unknown key does not make a client of its own."""
    limit = ClientRateLimit(None, 1.0, keys=("alice-key", "bob-key"), proxies={"127.0.0.1", "10.0.0.5"})

    def scope(peer: str, **headers: str) -> dict:
        return {"type": "http", "client": (peer, 5000),
                "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}

    alice = limit.client(scope("127.0.0.1", authorization="Bearer alice-key"))
    bob = limit.client(scope("127.0.0.1", authorization="Bearer bob-key"))
    assert alice and bob and alice != bob and "alice" not in alice  # a digest, never the key
    assert limit.client(scope("192.0.2.7", authorization="Bearer alice-key")) == alice  # the key, not the address
    assert limit.client(scope("192.0.2.7", authorization="Bearer guessed")) == "192.0.2.7"
    assert limit.client(scope("127.0.0.1")) is None  # loopback, no key: exempt as before
    assert limit.client(scope("127.0.0.1", x_forwarded_for="198.51.100.1, 192.0.2.9")) == "192.0.2.9"
    assert limit.client(scope("10.0.0.5", x_forwarded_for="192.0.2.9")) == "192.0.2.9"
    assert limit.client(scope("192.0.2.8", x_forwarded_for="192.0.2.9")) == "192.0.2.8"  # not a trusted balancer
    now = 1000.0
    assert limit.take(alice, now) == 0 and limit.take(alice, now) == 0 and limit.take(alice, now) > 0
    assert limit.take(bob, now) == 0  # another user's bucket
