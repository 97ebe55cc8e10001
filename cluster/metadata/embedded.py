"""The Conductor's embedded metadata store: ``MetadataServer`` serves a ``LocalMetadata`` over
HTTP, ``HttpMetadata`` is its client. Together here because they share the wire format.

The zero-configuration backend (Mooncake's master with ``--enable_http_metadata_server``): one
route per operation of the contract (``cluster.metadata``), ``POST /<operation>`` with a
JSON object, answered with a JSON object; a lease that is gone is status 410. Every request is
signed with a key derived from the cluster secret for this purpose alone (``METADATA_PURPOSE``,
``cluster.protocol``); anything else gets 401.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from cluster.metadata import DEFAULT_TIMEOUT_S, LeaseGone, MetadataStore, MetadataUnavailable, base_url
from cluster.metadata.local import LocalMetadata
from cluster.protocol import ControlAuthError, ControlVerifier, derive_key, sign

log = logging.getLogger(__name__)

# The purpose the metadata requests' signing key is derived for: a key unlike the control key,
# so a leaked one cannot forge the other's requests.
METADATA_PURPOSE = "pool-metadata"

_MAX_BODY_BYTES = 16 << 20  # a get_many of every object a large node holds fits easily
_LEASE_GONE_STATUS = 410  # "Gone": how the server tells HttpMetadata to raise LeaseGone


class _BadRequest(Exception):
    pass


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    # bool is an int to Python but not a lease id or a TTL to us.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _BadRequest(f"{name!r} must be a {kind.__name__}")
    return value


def _lease_field(body: dict[str, Any], optional: bool = False) -> int | None:
    if optional and body.get("lease") is None:
        return None
    return _field(body, "lease", int)


def _str_list(body: dict[str, Any], name: str) -> list[str]:
    value = _field(body, name, list)
    if not all(isinstance(item, str) for item in value):
        raise _BadRequest(f"{name!r} must be a list of strings")
    return value


def _grant(store: LocalMetadata, body: dict[str, Any]) -> dict[str, Any]:
    ttl_s = body.get("ttl_s")
    if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool):
        raise _BadRequest("'ttl_s' must be a number")
    return {"lease": store.grant_lease(float(ttl_s))}


# One route per operation: POST /<operation> with a JSON object, answered with a JSON object
# ({} for the operations that return nothing, hence the ``or {}``).
_ROUTES: dict[str, Callable[[LocalMetadata, dict[str, Any]], dict[str, Any]]] = {
    "/grant_lease": _grant,
    "/keepalive": lambda s, b: s.keepalive(_lease_field(b)) or {},
    "/revoke": lambda s, b: s.revoke(_lease_field(b)) or {},
    "/put": lambda s, b: s.put(_field(b, "key", str), _field(b, "value", str), _lease_field(b, optional=True)) or {},
    "/create": lambda s, b: {"revision": s.create(_field(b, "key", str), _field(b, "value", str),
                                                  _lease_field(b, optional=True))},
    "/get": lambda s, b: {"value": s.get(_field(b, "key", str))},
    "/get_many": lambda s, b: {"values": s.get_many(_str_list(b, "keys"))},
    "/get_prefix": lambda s, b: {"values": s.get_prefix(_field(b, "prefix", str))},
    "/get_prefixes": lambda s, b: {"values": s.get_prefixes(_str_list(b, "prefixes"))},
    "/delete": lambda s, b: {"deleted": s.delete(_field(b, "key", str))},
    "/delete_prefix": lambda s, b: {"deleted": s.delete_prefix(_field(b, "prefix", str))},
}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], store: LocalMetadata, verifier: ControlVerifier) -> None:
        # An IPv6 address (``::`` included: on Linux it takes IPv4 too) needs an IPv6 socket.
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.store = store
        self.verifier = verifier
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self._closing = False
        super().__init__(address, _Handler)

    def track(self, connection: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            if not open_:
                self._connections.discard(connection)
            elif self._closing:
                _shut(connection)
            else:
                self._connections.add(connection)

    def close_connections(self) -> None:
        # Clients keep connections alive: without this, a closed server would go on answering on
        # them from its handler threads.
        with self._connections_lock:
            self._closing = True
            for connection in self._connections:
                _shut(connection)
            self._connections.clear()


def _shut(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by the peer
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a node's heartbeat reuses one connection
    timeout = 120  # an idle kept-alive connection is dropped after this long
    server: _Server

    def setup(self) -> None:
        super().setup()
        # http.server writes the headers and the body separately: with Nagle's algorithm the body
        # would wait for the client's delayed ACK, some 40 ms per request.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def do_POST(self) -> None:  # noqa: N802 (the name http.server dispatches to)
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._answer(411, {"error": "a Content-Length is required"}, close=True)
            return
        try:
            # Before anything else, so an unsigned request can learn nothing, not even a 404, and
            # from the headers alone: its body is never read.
            digest = self.server.verifier.check_headers("POST", self.path, self.headers)
        except ControlAuthError as exc:
            # Its body is skipped unread (a bounded one, so the connection can carry the next
            # request; a larger one closes it).
            small = int(length) <= _MAX_BODY_BYTES
            for left in range(int(length), 0, -(64 << 10)) if small else ():
                self.rfile.read(min(left, 64 << 10))
            self._answer(401, {"error": str(exc)}, close=not small)
            return
        if int(length) > _MAX_BODY_BYTES:
            self._answer(413, {"error": f"body over {_MAX_BODY_BYTES} bytes"}, close=True)
            return
        body = self.rfile.read(int(length))
        try:
            self.server.verifier.check_body(digest, hashlib.sha256(body).hexdigest())
        except ControlAuthError as exc:
            self._answer(401, {"error": str(exc)})
            return
        route = _ROUTES.get(self.path)
        if route is None:
            self._answer(404, {"error": f"no operation {self.path}"})
            return
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise _BadRequest("the body must be a JSON object")
            self._answer(200, route(self.server.store, request))
        except (ValueError, _BadRequest) as exc:  # bad JSON (JSONDecodeError is a ValueError), arguments
            self._answer(400, {"error": str(exc)})
        except LeaseGone as exc:
            self._answer(_LEASE_GONE_STATUS, {"error": str(exc)})

    def _answer(self, status: int, payload: dict[str, Any], close: bool = False) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:  # the body was not read, so the connection cannot carry another request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.debug("metadata server: " + format, *args)


class MetadataServer:
    """Serves a ``LocalMetadata`` (``store``) over HTTP on a daemon thread, from construction
    until ``close``. Only requests signed with ``derive_key(secret, METADATA_PURPOSE)`` are
    served (``HttpMetadata`` signs them); others get 401 and change nothing.

    It listens on ``host`` (``0.0.0.0`` or ``::``: every address of this host) and ``url`` names
    it by ``advertise_host``, the address other hosts reach it by; without one, by ``host``, or
    by loopback when ``host`` is a wildcard (which no other host could use)."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 store: LocalMetadata | None = None, *, advertise_host: str | None = None) -> None:
        self.store = store if store is not None else LocalMetadata()
        self._advertise_host = advertise_host or None
        self._server = _Server((host, port), self.store, ControlVerifier(derive_key(secret, METADATA_PURPOSE)))
        # A short poll interval: close() waits up to one for the serving loop to notice.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="pool metadata server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """``http://HOST:PORT``: the advertised host (else the bound one; loopback for a
        wildcard) and the real port (when constructed with port 0)."""
        host, port = self._server.server_address[:2]
        if self._advertise_host is not None:
            host = self._advertise_host
        elif host in ("0.0.0.0", "::"):
            host = "127.0.0.1" if host == "0.0.0.0" else "::1"
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def close(self) -> None:
        """Stop serving: no request is answered after this returns."""
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        self._thread.join()


class HttpMetadata(MetadataStore):
    """The client of a ``MetadataServer`` at ``url`` (``http(s)://HOST[:PORT]``). Each call is one
    signed request on a kept-alive connection, bounded by ``timeout_s`` for each of connecting,
    sending and answering.

    ``http.client`` rather than httpx: a pool lookup sits on every read's critical path, and
    httpx's per-request machinery cost about twice the round trip itself here (918 vs 475 us
    for one ``get_prefixes`` on loopback). Connections are pooled, one per concurrent caller."""

    def __init__(self, url: str, secret: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = base_url(url, ("http", "https"), None)
        parts = urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._timeout_s = timeout_s
        self._key = derive_key(secret, METADATA_PURPOSE)
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """A connection and whether it was used before (so may have been closed by the server)."""
        with self._lock:
            if self._closed:
                raise MetadataUnavailable(f"metadata client for {self.url} is closed")
            if self._idle:
                return self._idle.pop(), True
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=self._timeout_s), False

    def _exchange(self, operation: str, body: bytes) -> tuple[int, bytes]:
        target = "/" + operation
        while True:
            connection, reused = self._connection()
            headers = {**sign(self._key, "POST", target, body), "Content-Type": "application/json"}
            try:
                connection.request("POST", target, body, headers)
                response = connection.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                connection.close()
                if reused:  # the server dropped an idle kept-alive connection: once more, anew
                    continue
                raise MetadataUnavailable(f"metadata server {self.url}: {operation}: {exc!r}") from exc
            except (OSError, http.client.HTTPException) as exc:  # refused, timed out, garbled
                connection.close()
                raise MetadataUnavailable(f"metadata server {self.url}: {operation}: {exc!r}") from exc
            if response.will_close:
                connection.close()
            else:
                with self._lock:
                    if self._closed:
                        connection.close()
                    else:
                        self._idle.append(connection)
            return response.status, data

    def _call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        status, data = self._exchange(operation, json.dumps(body).encode())
        try:
            answer = json.loads(data)
            error = answer.get("error") if isinstance(answer, dict) else None
        except ValueError:  # not JSON: something else answers at this address
            answer, error = None, data[:200].decode(errors="replace")
        if status == _LEASE_GONE_STATUS:
            raise LeaseGone(error)
        if status == 400:  # the arguments were wrong, not the server
            raise ValueError(f"metadata server {self.url} refused {operation}: {error}")
        if status != 200 or not isinstance(answer, dict):
            hint = " (is the cluster secret the same?)" if status == 401 else ""
            raise MetadataUnavailable(f"metadata server {self.url}: {operation} answered {status}: {error}{hint}")
        return answer

    def grant_lease(self, ttl_s: float) -> int:
        return self._call("grant_lease", {"ttl_s": ttl_s})["lease"]

    def keepalive(self, lease: int) -> None:
        self._call("keepalive", {"lease": lease})

    def revoke(self, lease: int) -> None:
        self._call("revoke", {"lease": lease})

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        self._call("put", {"key": key, "value": value, "lease": lease})

    def create(self, key: str, value: str, lease: int | None = None) -> int | None:
        return self._call("create", {"key": key, "value": value, "lease": lease})["revision"]

    def get(self, key: str) -> str | None:
        return self._call("get", {"key": key})["value"]

    def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        return self._call("get_many", {"keys": list(keys)})["values"] if keys else {}

    def get_prefix(self, prefix: str) -> dict[str, str]:
        return self._call("get_prefix", {"prefix": prefix})["values"]

    def get_prefixes(self, prefixes: Sequence[str]) -> dict[str, str]:
        return self._call("get_prefixes", {"prefixes": list(prefixes)})["values"] if prefixes else {}

    def delete(self, key: str) -> bool:
        return self._call("delete", {"key": key})["deleted"]

    def delete_prefix(self, prefix: str) -> int:
        return self._call("delete_prefix", {"prefix": prefix})["deleted"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
