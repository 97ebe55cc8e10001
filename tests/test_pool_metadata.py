"""The pool's metadata stores: one contract, checked on every backend.

The same tests run against ``LocalMetadata``, ``HttpMetadata`` talking to a ``MetadataServer`` on
loopback, and ``EtcdMetadata`` against a real etcd (conftest.py's ``etcd_url``). Without an
``etcd`` binary the etcd runs are skipped, unless ``CI=true``, where they fail: CI installs
``etcd-server`` and must run them. Lease expiry is waited for by polling, never by a fixed sleep.
"""

from __future__ import annotations

import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import etcd3gw
import httpx
import pytest

from cluster.conductor.supervisor import free_port
from cluster.protocol import CONTROL, ControlAuth, derive_key
from cluster.metadata import LeaseGone, MetadataStore, MetadataUnavailable, connect_metadata
from cluster.metadata.embedded import METADATA_PURPOSE, HttpMetadata, MetadataServer
from cluster.metadata.etcd import EtcdMetadata
from cluster.metadata.local import LocalMetadata

SECRET = b"pool-metadata-test-secret-0123456789"


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@dataclass
class Backend:
    store: MetadataStore
    ttl_s: float  # a short lease TTL the backend honours
    expiry_wait_s: float  # how long keys may take to vanish after that TTL ran out unrenewed


@pytest.fixture(params=["local", "http", "etcd"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "local":
        yield Backend(LocalMetadata(), ttl_s=0.2, expiry_wait_s=2.0)
    elif request.param == "http":
        server = MetadataServer(SECRET)
        store = HttpMetadata(server.url, SECRET, timeout_s=2.0)
        try:
            yield Backend(store, ttl_s=0.2, expiry_wait_s=2.0)
        finally:
            store.close()
            server.close()
    else:
        # A root of its own per test: the tests share one etcd and must not see each other's keys.
        store = EtcdMetadata(request.getfixturevalue("etcd_url"), root=f"test-{uuid.uuid4().hex}/", timeout_s=2.0)
        try:
            # etcd checks for expired leases every 0.5 s, on top of its 1 s shortest TTL.
            yield Backend(store, ttl_s=1.0, expiry_wait_s=4.0)
        finally:
            store.delete_prefix("")
            store.close()


# -- the contract, on every backend ---------------------------------------------------------------


def test_put_get_delete(backend: Backend) -> None:
    store = backend.store
    assert store.get("a") is None
    store.put("a", "1")
    store.put("b", "")
    assert store.get("a") == "1" and store.get("b") == ""
    store.put("a", "2")
    assert store.get("a") == "2"
    assert store.delete("a") is True
    assert store.delete("a") is False
    assert store.get("a") is None and store.get("b") == ""


def test_get_many_returns_present_keys_only(backend: Backend) -> None:
    store = backend.store
    keys = [f"obj/{i:03d}" for i in range(300)]  # over etcd's 128 operations per transaction
    for i, key in enumerate(keys):
        store.put(key, str(i))
    asked = keys + ["obj/absent", "other", keys[0]]
    assert store.get_many(asked) == {key: str(i) for i, key in enumerate(keys)}
    assert store.get_many(["obj/absent"]) == {}
    assert store.get_many([]) == {}


def test_get_prefixes_reads_many_prefixes_at_once(backend: Backend) -> None:
    store = backend.store
    for i in range(150):  # over etcd's 128 operations per transaction
        store.put(f"objs/k{i:03d}/seg-a", "a")
    store.put("objs/k000/seg-b", "b")
    store.put("objs/k0000/seg-c", "c")  # shares a string prefix with k000, not its "k000/" prefix
    asked = [f"objs/k{i:03d}/" for i in range(150)] + ["objs/absent/", "objs/k001/"]
    got = store.get_prefixes(asked)
    assert got == {**{f"objs/k{i:03d}/seg-a": "a" for i in range(150)}, "objs/k000/seg-b": "b"}
    assert store.get_prefixes(["objs/absent/"]) == {} and store.get_prefixes([]) == {}


def test_prefix_reads_and_deletes(backend: Backend) -> None:
    store = backend.store
    store.put("pool/segments/a", "A")
    store.put("pool/segments/b", "B")
    store.put("pool/segmentsX", "not under pool/segments/")
    store.put("pool/objects/k/a", "1")
    assert store.get_prefix("pool/segments/") == {"pool/segments/a": "A", "pool/segments/b": "B"}
    assert store.get_prefix("pool/nothing/") == {}
    assert set(store.get_prefix("")) == {"pool/segments/a", "pool/segments/b", "pool/segmentsX", "pool/objects/k/a"}
    assert store.delete_prefix("pool/segments/") == 2
    assert store.delete_prefix("pool/segments/") == 0
    assert store.get_prefix("pool/") == {"pool/segmentsX": "not under pool/segments/", "pool/objects/k/a": "1"}


def test_non_ascii_keys_and_values(backend: Backend) -> None:
    store = backend.store
    store.put("obj/ключ/€", "значение ✓")
    store.put("obj/ключ/b", "2")
    assert store.get("obj/ключ/€") == "значение ✓"
    assert store.get_many(["obj/ключ/€"]) == {"obj/ключ/€": "значение ✓"}
    assert store.get_prefix("obj/ключ/") == {"obj/ключ/€": "значение ✓", "obj/ключ/b": "2"}
    assert store.delete_prefix("obj/ключ") == 2


def test_lease_expiry_removes_its_keys(backend: Backend) -> None:
    store = backend.store
    lease = store.grant_lease(backend.ttl_s)
    store.put("seg/a", "leased", lease=lease)
    store.put("obj/x/a", "leased", lease=lease)
    store.put("seg/static", "no lease")
    assert store.get_prefix("seg/") == {"seg/a": "leased", "seg/static": "no lease"}
    assert _wait_until(lambda: store.get("seg/a") is None, backend.ttl_s + backend.expiry_wait_s)
    assert store.get_prefix("") == {"seg/static": "no lease"}
    with pytest.raises(LeaseGone):
        store.keepalive(lease)
    with pytest.raises(LeaseGone):
        store.put("seg/late", "x", lease=lease)
    assert store.get("seg/late") is None


def test_keepalive_holds_the_lease(backend: Backend) -> None:
    store = backend.store
    lease = store.grant_lease(backend.ttl_s)
    store.put("seg/a", "1", lease=lease)
    held_until = time.monotonic() + 2 * backend.ttl_s
    while time.monotonic() < held_until:
        store.keepalive(lease)
        assert store.get("seg/a") == "1"
        time.sleep(backend.ttl_s / 4)
    store.revoke(lease)


def test_revoke_removes_keys_at_once(backend: Backend) -> None:
    store = backend.store
    lease = store.grant_lease(30.0)
    other = store.grant_lease(30.0)
    store.put("seg/a", "1", lease=lease)
    store.put("seg/b", "2", lease=lease)
    store.put("seg/c", "3", lease=other)
    store.revoke(lease)
    assert store.get_prefix("seg/") == {"seg/c": "3"}
    store.revoke(lease)  # already gone: no error
    store.revoke(12345)  # never granted: no error
    with pytest.raises(LeaseGone):
        store.keepalive(lease)
    with pytest.raises(LeaseGone):
        store.put("seg/a", "again", lease=lease)
    assert store.get("seg/a") is None
    store.revoke(other)
    assert store.get_prefix("seg/") == {}


def test_a_key_belongs_to_the_lease_it_was_last_put_under(backend: Backend) -> None:
    store = backend.store
    first, second = store.grant_lease(30.0), store.grant_lease(30.0)
    store.put("k/moved", "1", lease=first)
    store.put("k/moved", "2", lease=second)
    store.put("k/freed", "1", lease=first)
    store.put("k/freed", "2")  # put again without a lease: no lease owns it any more
    store.revoke(first)
    assert store.get_prefix("k/") == {"k/moved": "2", "k/freed": "2"}
    store.revoke(second)
    assert store.get_prefix("k/") == {"k/freed": "2"}


def test_create_claims_an_absent_key_and_answers_a_growing_revision(backend: Backend) -> None:
    store = backend.store
    lease = store.grant_lease(30.0)
    first = store.create("claim/a", "one", lease=lease)
    assert isinstance(first, int) and first > 0
    assert store.create("claim/a", "two") is None  # held: nothing written
    assert store.get("claim/a") == "one"
    store.put("other", "x")  # any write moves the revision on
    store.revoke(lease)  # the claim goes with its lease, and can be made again, later
    second = store.create("claim/a", "three")
    assert second is not None and second > first and store.get("claim/a") == "three"
    with pytest.raises(LeaseGone):
        store.create("claim/b", "x", lease=lease)
    assert store.get("claim/b") is None


def test_bad_ttl_is_refused(backend: Backend) -> None:
    for ttl_s in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            backend.store.grant_lease(ttl_s)


def test_concurrent_callers(backend: Backend) -> None:
    store = backend.store
    lease = store.grant_lease(30.0)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(20):
                store.put(f"w/{n}/{i}", f"{n}.{i}", lease=lease)
                assert store.get(f"w/{n}/{i}") == f"{n}.{i}"
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(store.get_prefix("w/")) == 8 * 20
    store.revoke(lease)
    assert store.get_prefix("w/") == {}


# -- LocalMetadata on a clock of our own -----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_local_leases_run_on_the_injected_clock() -> None:
    clock = Clock()
    store = LocalMetadata(clock=clock)
    lease = store.grant_lease(10.0)
    store.put("a", "1", lease=lease)
    clock.now += 9.0
    store.keepalive(lease)  # due at 119 now
    clock.now += 9.5
    assert store.get("a") == "1"
    clock.now += 0.5  # exactly at the deadline: gone
    assert store.get("a") is None
    with pytest.raises(LeaseGone):
        store.keepalive(lease)


def test_local_deleted_keys_do_not_come_back_or_break_expiry() -> None:
    clock = Clock()
    store = LocalMetadata(clock=clock)
    lease = store.grant_lease(1.0)
    store.put("a", "1", lease=lease)
    store.put("b", "1", lease=lease)
    assert store.delete("a")
    store.put("a", "unleased")
    clock.now += 1.0
    assert store.get_prefix("") == {"a": "unleased"}


# -- the HTTP server: signing, bad requests, reachability -----------------------------------------


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    server = MetadataServer(SECRET)
    yield server
    server.close()


def test_unsigned_or_wrongly_signed_requests_get_401_and_change_nothing(server: MetadataServer) -> None:
    assert httpx.post(f"{server.url}/put", json={"key": "a", "value": "x"}).status_code == 401
    control_signed = httpx.Client(auth=ControlAuth(derive_key(SECRET, CONTROL)))  # the other purpose's key
    assert control_signed.post(f"{server.url}/put", json={"key": "a", "value": "x"}).status_code == 401
    control_signed.close()
    unsigned_bad_json = httpx.post(f"{server.url}/put", content=b"{not json")
    assert unsigned_bad_json.status_code == 401
    wrong_secret = HttpMetadata(server.url, b"another-cluster-secret")
    with pytest.raises(MetadataUnavailable, match="401"):
        wrong_secret.put("a", "x")
    wrong_secret.close()
    assert server.store.get_prefix("") == {}


def test_bad_requests_get_400(server: MetadataServer) -> None:
    signed = httpx.Client(base_url=server.url, auth=ControlAuth(derive_key(SECRET, METADATA_PURPOSE)))
    try:
        assert signed.post("/put", content=b"{not json").status_code == 400
        assert signed.post("/put", json=["a", "x"]).status_code == 400
        assert signed.post("/put", json={"key": 1, "value": "x"}).status_code == 400
        assert signed.post("/put", json={"key": "a", "value": "x", "lease": True}).status_code == 400
        assert signed.post("/get_many", json={"keys": ["a", 2]}).status_code == 400
        assert signed.post("/grant_lease", json={"ttl_s": "5"}).status_code == 400
        assert signed.post("/grant_lease", json={"ttl_s": -1}).status_code == 400
        assert signed.post("/no_such_operation", json={}).status_code == 404
        assert signed.post("/put", json={"key": "a", "value": "x"}).status_code == 200
    finally:
        signed.close()
    assert server.store.get_prefix("") == {"a": "x"}


def test_a_closed_server_is_unavailable_even_on_a_kept_alive_connection(server: MetadataServer) -> None:
    store = HttpMetadata(server.url, SECRET, timeout_s=2.0)
    store.put("a", "1")  # leaves a kept-alive connection in the client's pool
    server.close()
    start = time.monotonic()
    with pytest.raises(MetadataUnavailable):
        store.get("a")
    assert time.monotonic() - start < 1.0
    store.close()


@pytest.mark.parametrize("kind", ["http", "etcd"])
def test_unreachable_backend_is_unavailable_quickly(kind: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there: refused at once
    store = connect_metadata(url, SECRET, etcd=kind == "etcd")
    start = time.monotonic()
    with pytest.raises(MetadataUnavailable):
        store.grant_lease(5.0)
    with pytest.raises(MetadataUnavailable):
        store.get("a")
    assert time.monotonic() - start < 1.0
    store.close()


@pytest.mark.parametrize("kind", ["http", "etcd"])
def test_silent_backend_times_out(kind: str) -> None:
    # A socket that listens but never accepts: connecting succeeds (the backlog), answers never come.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        store = EtcdMetadata(url, timeout_s=0.3) if kind == "etcd" else HttpMetadata(url, SECRET, timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(MetadataUnavailable):
            store.get("a")
        assert time.monotonic() - start < 2.0
        store.close()


# -- etcd specifics ---------------------------------------------------------------------------------


def test_etcd_roots_keep_clusters_apart(etcd_url: str) -> None:
    one = EtcdMetadata(etcd_url, root=f"one-{uuid.uuid4().hex}/")
    two = EtcdMetadata(etcd_url, root=f"two-{uuid.uuid4().hex}/")
    try:
        one.put("pool/segments/a", "1")
        two.put("pool/segments/a", "2")
        assert one.get_prefix("") == {"pool/segments/a": "1"}
        assert two.get_many(["pool/segments/a"]) == {"pool/segments/a": "2"}
        assert one.delete_prefix("") == 1
        assert two.get("pool/segments/a") == "2"
    finally:
        one.delete_prefix("")
        two.delete_prefix("")
        one.close()
        two.close()


def test_etcd_get_many_is_one_transaction_per_128_keys(etcd_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = EtcdMetadata(etcd_url, root=f"txn-{uuid.uuid4().hex}/")
    calls: list[int] = []
    transaction = etcd3gw.Etcd3Client.transaction

    def counted(self: etcd3gw.Etcd3Client, txn: dict) -> dict:
        calls.append(len(txn["success"]))
        return transaction(self, txn)

    try:
        for i in range(200):
            store.put(f"k{i}", str(i))
        monkeypatch.setattr(etcd3gw.Etcd3Client, "transaction", counted)
        assert len(store.get_many([f"k{i}" for i in range(300)])) == 200
        assert calls == [128, 128, 44]
    finally:
        store.delete_prefix("")
        store.close()


# -- choosing a backend ---------------------------------------------------------------------------------


def test_connect_metadata_picks_and_checks_the_url() -> None:
    http = connect_metadata("http://127.0.0.1:8471", SECRET)
    assert isinstance(http, HttpMetadata) and http.url == "http://127.0.0.1:8471"
    etcd = connect_metadata("etcd://10.0.0.5", SECRET, etcd=True)
    assert isinstance(etcd, EtcdMetadata) and etcd.url == "http://10.0.0.5:2379"
    assert connect_metadata("https://etcd.example:2379/", SECRET, etcd=True).url == "https://etcd.example:2379"
    for url, etcd_flag in [("etcd://host:2379", False), ("ftp://host:1", True), ("127.0.0.1:2379", True),
                           ("http://", False), ("http://host:99999", True), ("http://host:1/v3", False),
                           ("http://host:1?x=1", False)]:
        with pytest.raises(ValueError, match="metadata URL"):
            connect_metadata(url, SECRET, etcd=etcd_flag)
    http.close()
    etcd.close()
