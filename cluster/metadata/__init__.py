"""The cluster's metadata store: its membership and the pool's object index, held under leases.

A package of the cluster's own: Conductors find the instances and claim their ids
in it (``membership``), elastic roles elect their decider in it, and the KVCache pool keeps its
index there (``cluster.pool``).

Mooncake keeps the pool's metadata in etcd: every node writes its entries (where its segment is,
which objects it holds) under a lease it keeps alive; when a node dies its lease expires and its
entries vanish, so no master has to notice the death. ``MetadataStore`` is that contract:

* ``grant_lease`` / ``keepalive`` / ``revoke``: a lease lives ``ttl_s`` past its last keepalive
  (or grant); when it expires or is revoked every key put under it is gone, at once for readers.
* ``create``: ``put`` only if the key is absent, answering the store's revision after it (a
  number that only grows, over every write) or None when the key is held: a claim on a name, and
  an epoch that orders the claims (a restarted Conductor's, ``membership``).
* ``put`` / ``get`` / ``get_many`` / ``get_prefix`` / ``delete`` / ``delete_prefix``: string keys
  to string values. A key put under a lease belongs to that lease until it is put again (under
  another lease or none) or deleted.
* Failures: ``LeaseGone`` when a keepalive or a put names a lease that expired or was revoked
  (the caller grants a new one and writes its entries again); ``MetadataUnavailable`` when the
  backend cannot be reached or does not answer in time (the caller retries later).

Every store is synchronous and safe to share between threads. The backends, one module each:

* ``local.LocalMetadata``: a dict in this process (tests, and the embedded store below).
* ``embedded.MetadataServer`` / ``embedded.HttpMetadata``: a ``LocalMetadata`` served over HTTP
  by the Conductor and its client, the zero-configuration backend (Mooncake's master with
  ``--enable_http_metadata_server``). Every request is signed with a key derived from the
  cluster secret for this purpose alone (``cluster.protocol``); anything else gets 401.
* ``etcd.EtcdMetadata``: a real etcd (>= 3.4) through its HTTP gateway, for clusters that have one.

``connect_metadata`` picks the network backend a URL names. ``membership`` keeps the cluster's
members (instances, Conductors) in the same store under keys of their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from urllib.parse import urlsplit

DEFAULT_TIMEOUT_S = 5.0


class LeaseGone(Exception):
    """The lease named by a keepalive or a put expired or was revoked; its keys are gone."""


class MetadataUnavailable(Exception):
    """The metadata backend could not be reached, refused the request or did not answer in time."""


class MetadataStore(ABC):
    """Keys and values (``str``) with leases; see the package docstring for the contract.
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
    def create(self, key: str, value: str, lease: int | None = None) -> int | None:
        """Set ``key`` as ``put`` does, but only if it is absent: the store's revision after
        the write (larger than any revision this store answered before), or None when the key
        is present (nothing is written). ``LeaseGone`` as ``put``."""

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


# -- choosing a backend ---------------------------------------------------------------------------


def base_url(url: str, schemes: tuple[str, ...], default_port: int | None) -> str:
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
    # Imported here, not at the top: the backends import the contract from this package, and a
    # process loads only the backend it uses (etcd3gw only with etcd).
    if etcd:
        from cluster.metadata.etcd import EtcdMetadata

        return EtcdMetadata(url)
    from cluster.metadata.embedded import HttpMetadata

    return HttpMetadata(url, secret)
