"""Starting a whole cluster on this machine: the instance processes the Conductor drives.

``python -m server`` (disaggregated mode) calls ``launch_instances`` before serving: each
instance is ``python -m server --role ROLE --conductor URL`` on its own loopback port with its
share of the cores, the cluster secret in its environment, and the kernel's parent-death signal
set, so no instance outlives the Conductor even if that is killed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class LaunchedInstance:
    role: str
    url: str
    process: subprocess.Popen


def launch_instances(
    roles: list[str],
    conductor_url: str,
    secret: str,
    threads: int,
    extra_args: list[str],
    host: str = "127.0.0.1",
) -> list[LaunchedInstance]:
    env = dict(os.environ, MOONCAKE_CLUSTER_SECRET=secret)
    launched = []
    for role in roles:
        port = free_port(host)
        cmd = [sys.executable, "-m", "server", "--role", role, "--host", host, "--port", str(port),
               "--conductor", conductor_url, "--threads", str(threads), *extra_args]
        process = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
        url = f"http://{host}:{port}"
        log.info("started %s instance pid %d on %s", role, process.pid, url)
        launched.append(LaunchedInstance(role, url, process))
    return launched


def stop_instances(launched: list[LaunchedInstance], timeout_s: float = 10.0) -> None:
    for inst in launched:
        if inst.process.poll() is None:
            inst.process.terminate()
    for inst in launched:
        try:
            inst.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s instance pid %d did not stop; killing it", inst.role, inst.process.pid)
            inst.process.kill()
            inst.process.wait()
