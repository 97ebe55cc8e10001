"""Shared test set-up.

``etcd_url``: one real etcd for the session (tests/test_pool_metadata.py, tests/test_pool_cluster.py);
without an ``etcd`` binary its tests are skipped, unless ``CI=true``, where they fail: CI installs
``etcd-server`` and must run them.

Without CUDA, Triton kernels can only run in Triton's interpreter, which is chosen when a kernel
is decorated: set it before any test module imports :mod:`kernels`. It does not change the torch
twins the engine runs on CPU.

Instances cache their calibration (``cluster/instance/calibration.py``); tests, and the instance
processes they start (which inherit the environment), keep theirs in a directory of the session's
own, never in the user's cache.
"""

import atexit
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import httpx
import pytest
import torch

from bench.harness import free_port, until

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_CALIBRATION_CACHE = tempfile.mkdtemp(prefix="mooncake-calibration-")
os.environ["MOONCAKE_CALIBRATION_CACHE"] = _CALIBRATION_CACHE
atexit.register(shutil.rmtree, _CALIBRATION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A single-member etcd on free loopback ports, for the session's tests (each uses keys of its own)."""
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but there is no etcd binary: CI must run the etcd tests (apt-get install etcd-server)")
        pytest.skip("no etcd binary (apt-get install etcd-server); CI=true makes this a failure")
    data = tmp_path_factory.mktemp("etcd")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log_path = data / "etcd.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [binary, "--name", "test", "--data-dir", str(data / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}",
             # etcd's shortest lease is 1.5 election timeouts rounded up to whole seconds (2 s by
             # default); a 50 ms election timeout brings it to 1 s, keeping the expiry tests short.
             "--heartbeat-interval", "10", "--election-timeout", "50",
             "--logger", "zap", "--log-level", "error"],
            stdout=log_file, stderr=subprocess.STDOUT)
    try:
        def healthy() -> bool:
            if process.poll() is not None:
                pytest.fail(f"etcd exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                return httpx.get(f"{client}/health", timeout=1.0).json().get("health") == "true"
            except (httpx.HTTPError, ValueError):
                return False

        try:
            until(healthy, 15.0, "etcd to become healthy", every_s=0.05)
        except TimeoutError as e:
            pytest.fail(f"{e}:\n{log_path.read_text()}")
        yield client
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
