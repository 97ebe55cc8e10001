"""The pool's metadata store: membership and the object index, held under leases.

Mooncake keeps the pool's metadata in etcd: every node writes its entries (where its segment is,
which objects it holds) under a lease it keeps alive; when a node dies its lease expires and its
entries vanish, so no master has to notice the death. ``MetadataStore`` is that contract:

* ``grant_lease`` / ``keepalive`` / ``revoke``: a lease lives ``ttl_s`` past its last keepalive
  (or grant); when it expires or is revoked every key put under it is gone, at once for readers.
* ``put`` / ``get`` / ``get_many`` / ``get_prefix`` / ``delete`` / ``delete_prefix``: string keys
  to string values. A key put under a lease belongs to that lease until it is put again (under
  another lease or none) or deleted.
* Failures: ``LeaseGone`` when a keepalive or a put names a lease that expired or was revoked
  (the caller grants a new one and writes its entries again); ``MetadataUnavailable`` when the
  backend cannot be reached or does not answer in time (the caller retries later).

Every store is synchronous and safe to share between threads. Four implementations:

* ``LocalMetadata``: a dict in this process (tests, and the embedded store below).
* ``MetadataServer`` / ``HttpMetadata``: a ``LocalMetadata`` served over HTTP by the Conductor and
  its client, the zero-configuration backend (Mooncake's master with
  ``--enable_http_metadata_server``). Every request is signed with a key derived from the
  cluster secret for this purpose alone (``cluster.protocol``); anything else gets 401.
* ``EtcdMetadata``: a real etcd (>= 3.4) through its HTTP gateway, for clusters that have one.
"""

from __future__ import annotations

import base64
import http.client
import bisect
import json
import logging
import math
import secrets
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import etcd3gw
from etcd3gw.exceptions import Etcd3Exception
from etcd3gw.lease import Lease as EtcdLease

from cluster.protocol import ControlAuthError, ControlVerifier, derive_key, sign

log = logging.getLogger(__name__)

# The purpose the metadata requests' signing key is derived for: a key unlike the control key,
# so a leaked one cannot forge the other's requests.
METADATA_PURPOSE = "pool-metadata"
DEFAULT_TIMEOUT_S = 5.0
ETCD_DEFAULT_PORT = 2379


class LeaseGone(Exception):
    """The lease named by a keepalive or a put expired or was revoked; its keys are gone."""


class MetadataUnavailable(Exception):
    """The metadata backend could not be reached, refused the request or did not answer in time."""


class MetadataStore(ABC):
    """Keys and values (``str``) with leases; see the module docstring for the contract.
    Implementations are synchronous and thread-safe."""

    @abstractmethod
    def grant_lease(self, ttl_s: float) -> int:
        """A new lease that expires ``ttl_s`` seconds after its last keepalive. A backend may
        round the TTL up (etcd counts whole seconds and has a floor), never down."""

    @abstractmethod
    def keepalive(self, lease: int) -> None:
        """Restart the lease's TTL; ``LeaseGone`` if it already expired or was revoked."""

    @abstractmethod
    def revoke(self, lease: int) -> None:
        """End the lease now: its keys are gone when this returns. An unknown lease is no error."""

    @abstractmethod
    def put(self, key: str, value: str, lease: int | None = None) -> None:
        """Set ``key``, owned by ``lease`` (or by no lease: it stays until deleted).
        ``LeaseGone`` if the lease expired or was revoked; nothing is written then."""

    @abstractmethod
    def get(self, key: str) -> str | None:
        """The value of ``key``, or None when it is absent."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        """The values of those ``keys`` that are present, in as few round trips as the backend allows."""

    @abstractmethod
    def get_prefix(self, prefix: str) -> dict[str, str]:
        """Every key starting with ``prefix`` (whole keys, prefix included) and its value."""

    @abstractmethod
    def get_prefixes(self, prefixes: Sequence[str]) -> dict[str, str]:
        """Every key starting with any of ``prefixes``, and its value, in as few round trips as
        the backend allows (one read of many small ranges: a prefix's replicas, say)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was present."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix``; how many there were."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store is not used afterwards."""


# -- in-process ---------------------------------------------------------------------------------


@dataclass
class _Lease:
    ttl_s: float
    deadline: float
    keys: set[str] = field(default_factory=set)


class LocalMetadata(MetadataStore):
    """A ``MetadataStore`` in this process's memory.

    Leases run on ``clock`` (monotonic seconds; injectable for tests). Expired leases are
    dropped, with their keys, at the start of every operation, under the lock: no thread is needed
    to reap them, and no reader ever sees a key whose lease has run out.

    Invariants (under ``_lock``): ``_values[k] == (v, L)`` with ``L`` not None iff ``k`` is in
    ``_leases[L].keys``; ``_sorted`` holds exactly the keys of ``_values``, sorted.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._values: dict[str, tuple[str, int | None]] = {}
        # Kept sorted so a prefix query is a bisection, not a scan of the whole object index.
        self._sorted: list[str] = []
        self._leases: dict[int, _Lease] = {}

    def grant_lease(self, ttl_s: float) -> int:
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"a lease TTL must be positive and finite, got {ttl_s}")
        with self._lock:
            self._expire()
            # Random, not counted: a restarted server must not hand a new holder the id that a
            # holder from before the restart still sends keepalives for.
            lease = 0
            while lease == 0 or lease in self._leases:
                lease = secrets.randbits(63)
            self._leases[lease] = _Lease(ttl_s, self._clock() + ttl_s)
            return lease

    def keepalive(self, lease: int) -> None:
        with self._lock:
            self._expire()
            held = self._leases.get(lease)
            if held is None:
                raise LeaseGone(f"lease {lease:x} expired or was revoked")
            held.deadline = self._clock() + held.ttl_s

    def revoke(self, lease: int) -> None:
        with self._lock:
            self._expire()
            if lease in self._leases:
                self._drop_lease(lease)

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        with self._lock:
            self._expire()
            if lease is not None and lease not in self._leases:
                raise LeaseGone(f"lease {lease:x} expired or was revoked")
            self._remove(key)  # detaches it from the lease it had, if any
            bisect.insort(self._sorted, key)
            self._values[key] = (value, lease)
            if lease is not None:
                self._leases[lease].keys.add(key)

    def get(self, key: str) -> str | None:
        with self._lock:
            self._expire()
            entry = self._values.get(key)
            return None if entry is None else entry[0]

    def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        with self._lock:
            self._expire()
            return {k: self._values[k][0] for k in keys if k in self._values}

    def get_prefix(self, prefix: str) -> dict[str, str]:
        with self._lock:
            self._expire()
            return {k: self._values[k][0] for k in self._prefixed(prefix)}

    def get_prefixes(self, prefixes: Sequence[str]) -> dict[str, str]:
        with self._lock:
            self._expire()
            return {k: self._values[k][0] for p in prefixes for k in self._prefixed(p)}

    def delete(self, key: str) -> bool:
        with self._lock:
            self._expire()
            return self._remove(key) is not None

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            self._expire()
            keys = self._prefixed(prefix)
            for key in keys:
                self._remove(key)
            return len(keys)

    def close(self) -> None:
        """Nothing to release: the data lives as long as the object."""

    # -- under the lock -----------------------------------------------------------------------------
    def _expire(self) -> None:
        # A scan over leases, not keys: there is one lease per live node, so this stays small.
        now = self._clock()
        for lease in [lease for lease, held in self._leases.items() if held.deadline <= now]:
            self._drop_lease(lease)

    def _drop_lease(self, lease: int) -> None:
        for key in list(self._leases[lease].keys):
            self._remove(key)
        del self._leases[lease]

    def _remove(self, key: str) -> tuple[str, int | None] | None:
        entry = self._values.pop(key, None)
        if entry is not None:
            del self._sorted[bisect.bisect_left(self._sorted, key)]
            if entry[1] is not None:
                self._leases[entry[1]].keys.discard(key)
        return entry

    def _prefixed(self, prefix: str) -> list[str]:
        start = bisect.bisect_left(self._sorted, prefix)
        end = start
        while end < len(self._sorted) and self._sorted[end].startswith(prefix):
            end += 1
        return self._sorted[start:end]


# -- over HTTP: the Conductor's embedded store ----------------------------------------------------

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
        if int(length) > _MAX_BODY_BYTES:
            self._answer(413, {"error": f"body over {_MAX_BODY_BYTES} bytes"}, close=True)
            return
        body = self.rfile.read(int(length))
        try:
            # Before anything else, so an unsigned request can learn nothing, not even a 404.
            self.server.verifier.verify("POST", self.path, self.headers, body)
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
    served (``HttpMetadata`` signs them); others get 401 and change nothing."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 store: LocalMetadata | None = None) -> None:
        self.store = store if store is not None else LocalMetadata()
        self._server = _Server((host, port), self.store, ControlVerifier(derive_key(secret, METADATA_PURPOSE)))
        # A short poll interval: close() waits up to one for the serving loop to notice.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="pool metadata server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` as bound (the real port when constructed with port 0)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

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
        self.url = _base_url(url, ("http", "https"), None)
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


# -- etcd -----------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _range_end(prefix: bytes) -> bytes:
    """etcd's range end for every key starting with ``prefix`` (b"\\0" with an empty prefix: all).
    UTF-8 never produces the byte 0xff, so the last byte always increments without a carry."""
    return prefix[:-1] + bytes([prefix[-1] + 1]) if prefix else b"\0"


class EtcdMetadata(MetadataStore):
    """A ``MetadataStore`` in etcd (>= 3.4, its v3 HTTP gateway, through ``etcd3gw``).

    Every key is stored under ``root`` so several clusters can share one etcd; keys come back
    without it. Leases are etcd leases: the TTL is rounded up to whole seconds (at least 1) and
    etcd may raise it to its own floor. ``get_many`` is one etcd transaction of range reads per
    ``max_txn_ops`` keys (etcd's ``--max-txn-ops``, 128 by default), so each batch is read at a
    single revision. Each call's HTTP requests are bounded by ``timeout_s``.
    """

    def __init__(self, url: str = f"http://127.0.0.1:{ETCD_DEFAULT_PORT}", *, root: str = "mooncake-py/",
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_txn_ops: int = 128) -> None:
        if max_txn_ops < 1:
            raise ValueError(f"max_txn_ops must be at least 1, got {max_txn_ops}")
        self.url = _base_url(url, ("http", "https", "etcd"), ETCD_DEFAULT_PORT)
        parts = urlsplit(self.url)
        self._endpoint = (parts.hostname, parts.port, parts.scheme)
        self.root = root
        self._timeout_s = timeout_s
        self._max_txn_ops = max_txn_ops
        # requests' Session is not documented as thread-safe, so each call borrows a client of its
        # own from this pool; there are as many as calls ever ran at once.
        self._idle: list[etcd3gw.Etcd3Client] = []
        self._all: list[etcd3gw.Etcd3Client] = []
        self._pool_lock = threading.Lock()

    def _call(self, what: str, request: Callable[[etcd3gw.Etcd3Client], Any]) -> Any:
        with self._pool_lock:
            client = self._idle.pop() if self._idle else None
        if client is None:
            host, port, scheme = self._endpoint
            # api_path given: etcd >= 3.4 serves /v3/, and discovering it would cost a round trip.
            client = etcd3gw.Etcd3Client(host=host, port=port, protocol=scheme, timeout=self._timeout_s,
                                         api_path="/v3/")
            with self._pool_lock:
                self._all.append(client)
        try:
            return request(client)
        except Etcd3Exception as exc:
            detail = exc.detail_text or ""
            if "lease not found" in detail:
                raise LeaseGone(f"etcd at {self.url}: {what}: the lease expired or was revoked") from exc
            raise MetadataUnavailable(f"etcd at {self.url}: {what}: {type(exc).__name__} {exc} {detail}") from exc
        # requests' other errors are OSErrors; an answer that is not the JSON expected raises
        # ValueError or KeyError.
        except (OSError, ValueError, KeyError) as exc:
            raise MetadataUnavailable(f"etcd at {self.url}: {what}: {exc!r}") from exc
        finally:
            with self._pool_lock:
                self._idle.append(client)

    def _key(self, key: str) -> bytes:
        return (self.root + key).encode()

    def _unkey(self, stored_b64: str) -> str:
        return base64.b64decode(stored_b64).decode()[len(self.root):]

    def grant_lease(self, ttl_s: float) -> int:
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"a lease TTL must be positive and finite, got {ttl_s}")
        return self._call("grant_lease", lambda c: c.lease(max(1, math.ceil(ttl_s))).id)

    def keepalive(self, lease: int) -> None:
        # etcd answers a keepalive for a lease it no longer has with no TTL (etcd3gw: -1).
        if self._call("keepalive", lambda c: EtcdLease(lease, client=c).refresh()) <= 0:
            raise LeaseGone(f"etcd at {self.url}: lease {lease:x} expired or was revoked")

    def revoke(self, lease: int) -> None:
        try:
            self._call("revoke", lambda c: EtcdLease(lease, client=c).revoke())
        except LeaseGone:  # already gone: what revoke wanted
            pass

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        self._call("put", lambda c: c.put(self._key(key), value.encode(),
                                          lease=None if lease is None else EtcdLease(lease, client=c)))

    def get(self, key: str) -> str | None:
        values = self._call("get", lambda c: c.get(self._key(key)))
        return values[0].decode() if values else None

    def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        return self._ranges("get_many", [{"key": _b64(self._key(k))} for k in dict.fromkeys(keys)])

    def get_prefixes(self, prefixes: Sequence[str]) -> dict[str, str]:
        starts = [self._key(p) for p in dict.fromkeys(prefixes)]
        return self._ranges("get_prefixes", [{"key": _b64(s), "range_end": _b64(_range_end(s))} for s in starts])

    def _ranges(self, what: str, ranges: list[dict[str, str]]) -> dict[str, str]:
        found: dict[str, str] = {}
        for start in range(0, len(ranges), self._max_txn_ops):
            # A transaction with no compare always runs its success branch: here, one range read each.
            txn = {"compare": [], "failure": [],
                   "success": [{"request_range": r} for r in ranges[start:start + self._max_txn_ops]]}
            result = self._call(what, lambda c: c.transaction(txn))
            for response in result.get("responses", []):
                for kv in response["response_range"].get("kvs", []):
                    found[self._unkey(kv["key"])] = base64.b64decode(kv.get("value", "")).decode()
        return found

    def get_prefix(self, prefix: str) -> dict[str, str]:
        start = self._key(prefix)
        request = {"key": _b64(start), "range_end": _b64(_range_end(start))}
        result = self._call("get_prefix", lambda c: c.post(c.get_url("/kv/range"), json=request))
        return {self._unkey(kv["key"]): base64.b64decode(kv.get("value", "")).decode()
                for kv in result.get("kvs", [])}

    def delete(self, key: str) -> bool:
        return self._call("delete", lambda c: c.delete(self._key(key)))

    def delete_prefix(self, prefix: str) -> int:
        start = self._key(prefix)
        request = {"key": _b64(start), "range_end": _b64(_range_end(start))}
        result = self._call("delete_prefix", lambda c: c.post(c.get_url("/kv/deleterange"), json=request))
        return int(result.get("deleted", 0))  # the gateway leaves zero counts out

    def close(self) -> None:
        with self._pool_lock:
            for client in self._all:
                client.session.close()
            self._all.clear()
            self._idle.clear()


# -- choosing a backend ---------------------------------------------------------------------------


def _base_url(url: str, schemes: tuple[str, ...], default_port: int | None) -> str:
    """``url`` checked to be ``SCHEME://HOST[:PORT]`` (one of ``schemes``; nothing after the port)
    and given back in that form; ``etcd://`` becomes ``http://``."""
    parts = urlsplit(url)
    if parts.scheme not in schemes:
        raise ValueError(f"metadata URL {url!r}: expected {' or '.join(s + '://' for s in schemes)}HOST:PORT")
    if not parts.hostname:
        raise ValueError(f"metadata URL {url!r} names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"metadata URL {url!r}: expected SCHEME://HOST:PORT and nothing else")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"metadata URL {url!r}: bad port ({exc})") from None
    port = port if port is not None else default_port
    scheme = "http" if parts.scheme == "etcd" else parts.scheme
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{scheme}://{host}" + (f":{port}" if port is not None else "")


def connect_metadata(url: str, secret: bytes, *, etcd: bool = False) -> MetadataStore:
    """The store at ``url``: with ``etcd``, an etcd endpoint (``http(s)://HOST[:PORT]`` or
    ``etcd://HOST[:PORT]``, port 2379 by default); otherwise a ``MetadataServer`` at
    ``http(s)://HOST[:PORT]``, whose requests are signed with a key derived from ``secret``.
    Nothing is contacted yet: the first call says whether the backend is there."""
    if etcd:
        return EtcdMetadata(url)
    return HttpMetadata(url, secret)
