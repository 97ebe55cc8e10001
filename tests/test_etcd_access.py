"""A secured etcd (issue 40 item 3): ``EtcdMetadata`` over TLS, checked against the operator's CA,
and with etcd's user/password authentication, configured as every process of a cluster gets it
(``EtcdAccess``, from ``MOONCAKE_ETCD_*``). One etcd of its own, with TLS, auth turned on midway."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from bench.harness import start_etcd
from cluster.metadata import MetadataUnavailable
from cluster.metadata.etcd import EtcdAccess, EtcdMetadata
from cluster.metadata.membership import claim_conductor, conductor_epoch
from cluster.protocol import MEMBERSHIP, derive_key

KEY = derive_key(b"s" * 32, MEMBERSHIP)


def _certs(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and etcd's certificate for 127.0.0.1 signed by it (EC keys: quick to make)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test ca")
    openssl("req", *ec, "-keyout", "etcd.key", "-out", "etcd.csr", "-subj", "/CN=127.0.0.1")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "etcd.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "etcd.pem", "-days", "1", "-extfile", "san.ext")
    return folder / "ca.pem", folder / "etcd.pem", folder / "etcd.key"


def _enable_auth(url: str, ca: Path, password: str) -> None:
    """etcd's root user and role, then auth on (what ``etcdctl user add root; auth enable`` does)."""
    with httpx.Client(base_url=url + "/v3", verify=ssl.create_default_context(cafile=str(ca)), timeout=5.0) as http:
        for path, body in [("/auth/role/add", {"name": "root"}),
                           ("/auth/user/add", {"name": "root", "password": password}),
                           ("/auth/user/grant", {"user": "root", "role": "root"}), ("/auth/enable", {})]:
            r = http.post(path, json=body)
            assert r.status_code == 200, (path, r.text)


def test_etcd_over_tls_and_with_a_user(tmp_path, etcd_binary):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make certificates with")
    ca, cert, key = _certs(tmp_path)
    etcd = start_etcd(tmp_path / "etcd", fast_leases=True, tls=(ca, cert, key))
    try:
        assert etcd.url.startswith("https://")
        store = EtcdMetadata(etcd.url, access=EtcdAccess(ca=str(ca)))
        store.put("k", "v")
        assert store.get("k") == "v"
        # Not the operator's CA (the system's): refused, and said so.
        with pytest.raises(MetadataUnavailable, match="(?i)certificate"):
            EtcdMetadata(etcd.url, access=EtcdAccess()).get("k")
        with pytest.raises(ValueError, match="not https"):
            EtcdMetadata(etcd.url.replace("https", "http"), access=EtcdAccess(ca=str(ca)))

        _enable_auth(etcd.url, ca, "root-password")
        user = EtcdAccess(ca=str(ca), user="root", password="root-password")
        secured = EtcdMetadata(etcd.url, access=user)
        assert secured.get("k") == "v"
        claim, epoch = claim_conductor(secured, KEY, "c1", "http://h:1", ttl_s=1.0)  # leases and txns too
        try:
            assert conductor_epoch(secured, KEY, "c1") == epoch
            # A token etcd does not take (expired, or etcd restarted): a new one, once, and on.
            for client in secured._idle:
                client.session.headers["Authorization"] = "not-a-token"
            assert secured.get("k") == "v"
        finally:
            claim.close()
        with pytest.raises(MetadataUnavailable, match="user name is empty"):
            store.get("k")  # the client from before auth was on, without a user
        with pytest.raises(MetadataUnavailable, match="authentication failed"):
            EtcdMetadata(etcd.url, access=EtcdAccess(ca=str(ca), user="root", password="wrong")).get("k")
        assert "root-password" not in repr(user)
        secured.close()
        store.close()
    finally:
        etcd.stop(5.0)


def test_etcd_access_comes_from_the_environment_and_refuses_half_a_pair(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    env = {"MOONCAKE_ETCD_CA": str(ca), "MOONCAKE_ETCD_USER": "u", "MOONCAKE_ETCD_PASSWORD": "p"}
    assert EtcdAccess.from_env(env) == EtcdAccess(ca=str(ca), user="u", password="p")
    assert EtcdAccess.from_env({}) == EtcdAccess()
    for half, what in [({"MOONCAKE_ETCD_USER": "u"}, "password"), ({"MOONCAKE_ETCD_CERT": str(ca)}, "key"),
                       ({"MOONCAKE_ETCD_CA": str(tmp_path / "missing.pem")}, "does not exist")]:
        with pytest.raises(ValueError, match=what):
            EtcdAccess.from_env(half)


def test_a_password_is_never_sent_over_plain_http():
    """Issue 52: an etcd user's password over http:// would cross the network in the clear."""
    with pytest.raises(ValueError, match="password would go unencrypted"):
        EtcdMetadata("http://etcd.example:2379", access=EtcdAccess(user="u", password="p"))
    EtcdMetadata("http://etcd.example:2379", access=EtcdAccess())  # no user: plain http is the operator's call
