"""``EtcdMetadata``: the metadata contract (``cluster.metadata``) in a real etcd (>= 3.4),
through its v3 HTTP gateway, for clusters that have one (Mooncake's default); over TLS and with
etcd's user/password authentication where the operator turned them on (``EtcdAccess``)."""

from __future__ import annotations

import base64
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import etcd3gw
from etcd3gw.exceptions import Etcd3Exception
from etcd3gw.lease import Lease as EtcdLease

from cluster.metadata import DEFAULT_TIMEOUT_S, LeaseGone, MetadataStore, MetadataUnavailable, base_url

ETCD_DEFAULT_PORT = 2379


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _range_end(prefix: bytes) -> bytes:
    """etcd's range end for every key starting with ``prefix`` (b"\\0" with an empty prefix: all).
    UTF-8 never produces the byte 0xff, so the last byte always increments without a carry."""
    return prefix[:-1] + bytes([prefix[-1] + 1]) if prefix else b"\0"


@dataclass(frozen=True)
class EtcdAccess:
    """What it takes to reach a secured etcd, the same for every process of a cluster, so it comes
    from the environment (``from_env``) that the Conductor passes on to the instances it starts:

    * ``MOONCAKE_ETCD_CA``: the CA certificate (PEM file) that signed etcd's (``--cert-file``);
      with it the URL must be ``https://``. Without it an ``https://`` etcd is checked against
      the system's CAs.
    * ``MOONCAKE_ETCD_CERT`` and ``MOONCAKE_ETCD_KEY``: this client's certificate and key, for an
      etcd started with ``--client-cert-auth``.
    * ``MOONCAKE_ETCD_USER`` and ``MOONCAKE_ETCD_PASSWORD``: an etcd user, for an etcd with auth
      enabled (``etcdctl auth enable``); the password is never logged or put on a command line.
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key and a key its certificate "
                             "(MOONCAKE_ETCD_CERT and MOONCAKE_ETCD_KEY)")
        if (self.user is None) != (self.password is None):
            raise ValueError("an etcd user needs a password and a password a user "
                             "(MOONCAKE_ETCD_USER and MOONCAKE_ETCD_PASSWORD)")
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"etcd {name} file {path!r} does not exist")

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> EtcdAccess:
        def get(name: str) -> str | None:
            return env.get(f"MOONCAKE_ETCD_{name}") or None

        return cls(get("CA"), get("CERT"), get("KEY"), get("USER"), get("PASSWORD"))


class EtcdMetadata(MetadataStore):
    """A ``MetadataStore`` in etcd (>= 3.4, its v3 HTTP gateway, through ``etcd3gw``).

    Every key is stored under ``root`` so several clusters can share one etcd; keys come back
    without it. Leases are etcd leases: the TTL is rounded up to whole seconds (at least 1) and
    etcd may raise it to its own floor. ``get_many`` is one etcd transaction of range reads per
    ``max_txn_ops`` keys (etcd's ``--max-txn-ops``, 128 by default), so each batch is read at a
    single revision. Each call's HTTP requests are bounded by ``timeout_s``.

    ``access``: TLS files and an etcd user (default: ``EtcdAccess.from_env()``). With a user, each
    client authenticates once and sends etcd's token with every call; a token etcd no longer takes
    (expired, or etcd restarted) is replaced once and the call made again.
    """

    def __init__(self, url: str = f"http://127.0.0.1:{ETCD_DEFAULT_PORT}", *, root: str = "mooncake-py/",
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_txn_ops: int = 128,
                 access: EtcdAccess | None = None) -> None:
        if max_txn_ops < 1:
            raise ValueError(f"max_txn_ops must be at least 1, got {max_txn_ops}")
        self.url = base_url(url, ("http", "https", "etcd"), ETCD_DEFAULT_PORT)
        self.access = EtcdAccess.from_env() if access is None else access
        if self.access.tls and not self.url.startswith("https://"):
            raise ValueError(f"etcd TLS files are set (MOONCAKE_ETCD_CA/CERT) but the URL {url!r} is not https://: "
                             "it would go unencrypted")
        if self.access.user is not None and not self.url.startswith("https://"):
            raise ValueError(f"an etcd user is set (MOONCAKE_ETCD_USER/PASSWORD) but the URL {url!r} is not https://: "
                             "the password would go unencrypted (start etcd with TLS, MOONCAKE_ETCD_CA)")
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

    def _client(self) -> etcd3gw.Etcd3Client:
        host, port, scheme = self._endpoint
        a = self.access
        # api_path given: etcd >= 3.4 serves /v3/, and discovering it would cost a round trip.
        client = etcd3gw.Etcd3Client(host=host, port=port, protocol=scheme, timeout=self._timeout_s,
                                     api_path="/v3/", ca_cert=a.ca, cert_cert=a.cert, cert_key=a.key)
        if a.ca is not None:
            # requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE (set on many hosts) override a
            # session's CA: the operator's CA must win, so the environment is not consulted.
            client.session.trust_env = False
        return client

    def _authenticate(self, client: etcd3gw.Etcd3Client) -> None:
        """Give ``client`` a fresh token of the configured user (nothing without a user)."""
        if self.access.user is None:
            return
        client.session.headers.pop("Authorization", None)
        token = client.post(client.get_url("/auth/authenticate"),
                            json={"name": self.access.user, "password": self.access.password})["token"]
        client.session.headers["Authorization"] = token

    def _call(self, what: str, request: Callable[[etcd3gw.Etcd3Client], Any]) -> Any:
        with self._pool_lock:
            client = self._idle.pop() if self._idle else None
        kept = client is not None  # back to the pool afterwards: only a client that authenticated
        try:
            if client is None:
                client = self._client()
                self._authenticate(client)
                kept = True
                with self._pool_lock:
                    self._all.append(client)
            try:
                return request(client)
            except Etcd3Exception as exc:
                if self.access.user is None or "invalid auth token" not in (exc.detail_text or ""):
                    raise
                self._authenticate(client)  # expired, or etcd restarted: once more with a new one
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
            if kept:
                with self._pool_lock:
                    self._idle.append(client)
            elif client is not None:
                client.session.close()

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

    def create(self, key: str, value: str, lease: int | None = None) -> int | None:
        stored = _b64(self._key(key))
        put: dict[str, Any] = {"key": stored, "value": _b64(value.encode())}
        if lease is not None:
            put["lease"] = lease
        # Absent means never created (or deleted since): its create revision compares as 0.
        txn = {"compare": [{"key": stored, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
               "success": [{"request_put": put}], "failure": []}
        result = self._call("create", lambda c: c.transaction(txn))
        # The gateway leaves false out: no "succeeded" is a failed compare.
        return int(result["header"]["revision"]) if result.get("succeeded") else None

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
