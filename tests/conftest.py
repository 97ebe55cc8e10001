"""Shared test set-up.

``etcd_url``: one real etcd for the session (tests/test_pool_metadata.py, tests/test_pool_cluster.py);
without an ``etcd`` binary its tests are skipped, unless ``CI=true``, where they fail: CI installs
``etcd-server`` and must run them.

Without CUDA, Triton kernels can only run in Triton's interpreter, which is chosen when a kernel
is decorated: set it before any test module imports :mod:`mooncake_kernels`. It does not change
the torch twins the engine runs on CPU.

Instances cache their calibration (``cluster/instance/calibration.py``); tests, and the instance
processes they start (which inherit the environment), keep theirs in a directory of the session's
own, never in the user's cache.
"""

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from bench.harness import start_etcd

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_CALIBRATION_CACHE = tempfile.mkdtemp(prefix="mooncake-calibration-")
os.environ["MOONCAKE_CALIBRATION_CACHE"] = _CALIBRATION_CACHE
atexit.register(shutil.rmtree, _CALIBRATION_CACHE, ignore_errors=True)


def _require_etcd() -> None:
    if shutil.which("etcd") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but there is no etcd binary: CI must run the etcd tests (apt-get install etcd-server)")
        pytest.skip("no etcd binary (apt-get install etcd-server); CI=true makes this a failure")


@pytest.fixture
def etcd_binary() -> None:
    """For a test that starts an etcd of its own: skipped without the binary (failed with CI=true)."""
    _require_etcd()


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A single-member etcd on free loopback ports, for the session's tests (each uses keys of its own),
    with 1 s leases (``fast_leases``) so that the expiry tests stay short."""
    _require_etcd()
    try:
        etcd = start_etcd(tmp_path_factory.mktemp("etcd") / "etcd", name="test", fast_leases=True)
    except (RuntimeError, TimeoutError) as e:
        pytest.fail(str(e))
    try:
        yield etcd.url
    finally:
        etcd.stop(5.0)


@pytest.fixture(scope="session")
def colocated():
    """The engine the cluster tests compare answers with: the default model as their clusters
    run it (float32, where a greedy answer does not depend on its batch or on what its prefix
    cache holds; one thread), in this process, loaded once for the session."""
    from engine import LLM

    return LLM(threads=1, kv_cache_gib=0.25, dtype="float32")
