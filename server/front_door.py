"""Every HTTP port of the cluster (the Conductor's, an instance's, the colocated server's) runs
through here: uvicorn with a deadline on each request's head and body and a cap on connections.

uvicorn's h11 protocol closes a connection that sits idle between requests after
``timeout_keep_alive``, but any byte cancels that timer, and nothing bounds how long the head or
the body of a request may take to arrive: a client that connects and says nothing, or sends a
header byte every ten seconds ("slowloris"), holds a connection and a file descriptor for ever,
and enough of them exhaust the process's open files (500 such connections were
measured still open after 75 s). So:

* **head deadline** (``header_timeout_s``): from the moment a connection can start a request
  (its opening, or the end of the previous response) to the end of the request's headers.
  Bytes that trickle in do not extend it.
* **body deadline** (``body_timeout_s``): from the end of the headers to the end of the body.
  The endpoint reading the body then sees the client as gone (``http.disconnect``).
* Neither bounds a response: a stream of tokens runs as long as it runs.
* **connection cap** (``max_connections``): a connection past it is closed as soon as it is
  accepted, so the process keeps descriptors for its own files, its peers and its KV transfers.
  The default is the open-file limit less :data:`RESERVED_FDS`, after ``serve`` has raised the
  soft limit to the hard one (``raise_open_file_limit``): under the common soft limit of 1,024
  the cap would be 768 connections while the hard limit allows hundreds of thousands.

An expired deadline closes the connection (a client that has not finished its request has no
response to read); it is logged at debug level, since a flood of them is the attack itself.

On a public port (the OpenAI API: the Conductor's, the colocated server's; not an instance's,
whose callers are the Conductors) one client may not take the whole door:

* **connections per client** (``max_connections_per_client``, by IP address): one past it is
  answered 429 with ``Retry-After`` and closed as soon as it is accepted;
* **requests per client** (``max_requests_per_client_s``, a token bucket holding two seconds'
  worth): a request past it is answered 429 with ``Retry-After`` (the seconds until the bucket
  holds one again) without reaching the app.

Loopback clients are exempt: on this host they are the cluster itself, the operator's tools, or
a balancer in front that speaks for many clients. The request cap knows more than an address
: a request carrying one of the users' API keys (``client_keys``) is counted against
that key, wherever it comes from (through a balancer on this host too); one from a balancer the
operator trusts (``trusted_proxies``) against the address that balancer saw, the last one in its
``X-Forwarded-For`` (the shipped server/haproxy.cfg sets it, after dropping any the client sent);
any other against its own address.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import resource
import socket
import time
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# Descriptors kept for the process's own use beside its clients' connections: the model's files,
# connections to instances or peers, KV transfer sockets, shared memory, logs.
RESERVED_FDS = 256
MIN_CONNECTIONS = 64
# One client address may hold this many connections to the OpenAI port: far more than a client
# needs (a connection carries a stream at a time, and a 2-core instance serves a few dozen), far
# fewer than the door's cap, so one client cannot take the descriptors of all the others.
DEFAULT_CONNECTIONS_PER_CLIENT = 256


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard one (at most 1,048,576 where the
    hard one is unlimited); return the soft limit now. Only the soft limit is a default a process
    may lift on its own; the hard one is the operator's (``ulimit -Hn``, systemd's LimitNOFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:  # e.g. above the kernel's nr_open
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
            return soft
        log.info("open-file limit raised from %d to %d", soft, target)
        return target
    return soft


def default_max_connections() -> int:
    """The open-file limit less :data:`RESERVED_FDS` (at least :data:`MIN_CONNECTIONS`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 65536
    return max(MIN_CONNECTIONS, soft - RESERVED_FDS)


@dataclass(frozen=True)
class FrontDoor:
    """The limits of one HTTP port (see the module docstring)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int | None = None  # None: default_max_connections()
    max_connections_per_client: int | None = None  # None: no cap per client
    max_requests_per_client_s: float | None = None  # None: no rate cap per client
    client_keys: tuple[str, ...] = ()  # the users' API keys: each one client of the rate cap
    trusted_proxies: frozenset[str] = frozenset()  # balancers whose X-Forwarded-For is believed

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("the header and body timeouts must be positive")
        for name in ("max_connections", "max_connections_per_client"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_requests_per_client_s is not None and not self.max_requests_per_client_s > 0:
            raise ValueError("max_requests_per_client_s must be positive")

    def wrap(self, app):
        """``app`` behind this door's rate cap per client (itself when there is none)."""
        if self.max_requests_per_client_s is None:
            return app
        return ClientRateLimit(app, self.max_requests_per_client_s, self.client_keys, self.trusted_proxies)

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol with this door's deadlines and caps."""
        door, cap = self, self.max_connections or default_max_connections()
        per_client_cap = self.max_connections_per_client
        per_client: Counter[str] = Counter()  # open connections by client address, loopback not counted

        class GuardedH11Protocol(H11Protocol):
            _timer: asyncio.TimerHandle | None = None
            _phase: str | None = None
            _counted: str | None = None  # the client address this connection counts against

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                if len(self.connections) > cap:  # this one is already counted
                    log.debug("connection from %s refused: %d open, the cap is %d", self.client,
                              len(self.connections) - 1, cap)
                    transport.close()
                    return
                host = self.client[0] if self.client else None
                if per_client_cap is not None and host is not None and not _is_loopback(host):
                    self._counted = host
                    per_client[host] += 1
                    if per_client[host] > per_client_cap:
                        log.debug("connection from %s refused: %d open from it, the cap is %d", host,
                                  per_client[host] - 1, per_client_cap)
                        transport.write(_too_many(f"too many connections from {host} (at most {per_client_cap})",
                                                  1.0))
                        transport.close()
                        return
                self._arm()

            def data_received(self, data: bytes) -> None:
                super().data_received(data)
                self._arm()

            def on_response_complete(self) -> None:
                super().on_response_complete()
                self._arm()

            def connection_lost(self, exc: Exception | None) -> None:
                self._disarm()
                if self._counted is not None:
                    per_client[self._counted] -= 1
                    if not per_client[self._counted]:
                        del per_client[self._counted]
                    self._counted = None
                super().connection_lost(exc)

            def _arm(self) -> None:
                # The client owes the rest of a request while h11 waits for a request (IDLE) or
                # reads its body (SEND_BODY); in any other state nothing is owed.
                state = self.conn.their_state
                phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
                if phase is None or self.transport.is_closing():
                    self._disarm()
                elif phase != self._phase:  # a deadline runs from the start of its phase
                    self._disarm()
                    self._phase = phase
                    timeout = door.header_timeout_s if phase == "head" else door.body_timeout_s
                    self._timer = self.loop.call_later(timeout, self._expire)

            def _disarm(self) -> None:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer, self._phase = None, None

            def _expire(self) -> None:
                log.debug("closing the connection from %s: its request's %s took over %g s", self.client,
                          self._phase, door.header_timeout_s if self._phase == "head" else door.body_timeout_s)
                self._timer = None
                if not self.transport.is_closing():
                    self.transport.close()

        return GuardedH11Protocol


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a Unix socket's path, say: not a network client
        return True


def _too_many_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "rate_limit_exceeded", "param": None,
                                 "code": "rate_limit_exceeded"}}).encode()


def _too_many(message: str, retry_after_s: float) -> bytes:
    """A whole HTTP/1.1 429 answer, for a connection refused before any request was read."""
    body = _too_many_body(message)
    return (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
            f"Retry-After: {max(1, math.ceil(retry_after_s))}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


class ClientRateLimit:
    """ASGI middleware: at most ``rate`` HTTP requests a second from one client, in bursts of up
    to two seconds' worth (a token bucket per client); one past it is answered 429 with
    ``Retry-After`` before the app sees it. A client is a user's key (``keys``), else the address
    a trusted balancer (``proxies``) saw, else the connection's address; loopback addresses are
    exempt, keys never are. The table of buckets forgets a client once its bucket is full again,
    so it holds only the clients active in the last two seconds."""

    def __init__(self, app, rate: float, keys: Sequence[str] = (), proxies: Collection[str] = frozenset()) -> None:
        self.app = app
        self.rate = rate
        self.burst = max(1.0, 2.0 * rate)
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)
        self._swept = time.monotonic()
        self._keys = tuple(keys)
        self._proxies = frozenset(proxies)

    def take(self, host: str, now: float) -> float:
        """Take a token for ``host``; 0 when there was one, else the seconds until there is."""
        tokens, then = self._buckets.get(host, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens < 1.0:
            self._buckets[host] = (tokens, now)
            return (1.0 - tokens) / self.rate
        self._buckets[host] = (tokens - 1.0, now)
        refill_s = self.burst / self.rate  # an address untouched this long has a full bucket again
        if now - self._swept > refill_s:
            self._swept = now
            for h in [h for h, (_, t) in self._buckets.items() if now - t > refill_s]:
                del self._buckets[h]
        return 0.0

    def client(self, scope) -> str | None:
        """Who ``scope``'s request counts against; None: nobody (a loopback address)."""
        headers = scope.get("headers") or ()
        if self._keys and (user := user_of(bearer_token(headers), self._keys)) is not None:
            return "key " + user  # a digest: the table (and the 429's text) never holds a key
        peer = (scope.get("client") or ("",))[0]
        if peer in self._proxies:
            forwarded = [v for n, v in headers if n == b"x-forwarded-for"]
            if forwarded:  # the balancer appends the address it saw: the last entry is its own word
                peer = forwarded[-1].decode("latin-1").split(",")[-1].strip()
        return None if not peer or _is_loopback(peer) else peer

    async def __call__(self, scope, receive, send) -> None:
        client = self.client(scope) if scope["type"] == "http" else None
        if client is not None:
            wait = self.take(client, time.monotonic())
            if wait:
                body = _too_many_body(f"too many requests from {client} (at most {self.rate:g} a second)")
                await send({"type": "http.response.start", "status": 429,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"retry-after", str(max(1, math.ceil(wait))).encode()),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The token of a request's ``Authorization: Bearer`` header (ASGI headers), or ""."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def user_of(token: str, keys: Sequence[str]) -> str | None:
    """The user whose API key ``token`` is, as a digest of the key (never the key itself), or None."""
    for key in keys:
        if hmac.compare_digest(token.encode(), key.encode()):
            return hashlib.sha256(key.encode()).hexdigest()[:12]
    return None


def serve(app, host: str, port: int, door: FrontDoor, *, log_level: str = "info", fd: int | None = None) -> None:
    """Run ``app`` on ``host:port`` until SIGINT / SIGTERM, behind ``door``; with ``fd``, on that
    inherited listening socket instead (the Supervisor's, which keeps the port across restarts)."""
    raise_open_file_limit()  # before the door's default cap is read from it
    config = uvicorn.Config(door.wrap(app), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            http=door.protocol())
    uvicorn.Server(config).run(sockets=None if fd is None else [socket.socket(fileno=fd)])
