"""bench.chaos: the cluster under test and the processes of the bench's own (etcd, a pool node)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench import harness
from bench.chaos.config import HOST, SECRET_ENV, ChaosConfig
from bench.harness import ServerProcess, launch_server

# --------------------------------------------------------------------------- processes of the bench's own


# The bench's etcd: ``url``, ``proc`` (SIGSTOPped by ``stop_etcd``), ``data_dir``, ``stop()``.
Etcd = harness.EtcdProcess


def start_etcd(workdir: Path, timeout_s: float = 30.0) -> Etcd | None:
    """A single-member etcd of the bench's own on free loopback ports, at etcd's shipped timing
    (None without an etcd binary); its log is ``workdir/etcd.log``."""
    if shutil.which("etcd") is None:
        return None
    data = workdir / f"etcd-{os.getpid()}"
    shutil.rmtree(data, ignore_errors=True)
    return harness.start_etcd(data, name="chaos", log_path=workdir / "etcd.log", within_s=timeout_s)


def stop_process(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """SIGCONT (it may be stopped), SIGTERM, then SIGKILL: ``proc`` is gone afterwards."""
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            return
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


async def start_pool_node(metadata_args: list[str], secret: str, log_path: Path, timeout_s: float = 60.0
                          ) -> tuple[subprocess.Popen, str]:
    """``python -m cluster.pool`` with the cluster's secret; (process, segment id) once it says it is ready."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.pool", *metadata_args, "--dram-gib", "0.25"],  # noqa: ASYNC220
                                env=dict(os.environ, MOONCAKE_CLUSTER_SECRET=secret, OMP_NUM_THREADS="1"),
                                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout_s)
    except asyncio.TimeoutError:
        stop_process(proc)
        raise RuntimeError(f"the pool node did not start within {timeout_s:g} s (log: {log_path})") from None
    if not line.startswith("pool node ready: "):
        stop_process(proc)
        raise RuntimeError(f"the pool node did not start: {line!r} (log: {log_path})")
    return proc, line.split()[3]



@dataclass
class Cluster:
    server: ServerProcess
    seen_pids: set[int] = field(default_factory=set)  # every instance pid /stats ever named
    secret: str = ""  # the cluster secret (the stale-epoch check signs with it, as the Conductor does)
    etcd: Etcd | None = None  # the metadata store the bench started (None: the embedded one)
    pool_node: subprocess.Popen | None = None
    extra_servers: list[ServerProcess] = field(default_factory=list)  # instances of the bench's own

    @property
    def url(self) -> str:
        return self.server.base_url

    @property
    def port(self) -> int:
        return urlsplit(self.server.base_url).port

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is an instance this cluster started (checked before every signal: a
        recycled pid must never be hit)."""
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        conductor = self.url.encode()
        return any(a == b"--conductor" and b == conductor for a, b in zip(args, args[1:]))


def start_cluster(cfg: ChaosConfig) -> Cluster:
    # float32, the reference precision: there a greedy answer does not depend on how requests
    # were batched, which the expected texts rely on (the CPU default, int4 weights,
    # rounds differently at different batch sizes). --server-arg can still choose another.
    # Leases and timeouts are the shipped defaults: no flag here sets them.
    secret = os.environ.get(SECRET_ENV) or secrets.token_hex(16)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), SECRET_ENV: secret}
    etcd = start_etcd(cfg.log_path.parent) if cfg.etcd else None
    flags = ["--dtype", "float32", *(["--header-timeout-s", str(cfg.header_timeout_s)] if cfg.header_timeout_s else []),
             "--prefill-instances", str(cfg.prefill_instances),
             "--decode-instances", str(cfg.decode_instances), *(["--etcd", etcd.url] if etcd else [])]
    try:
        server = launch_server([*flags, *cfg.server_args], cfg.log_path, name="chaos", python=cfg.python,
                               host=HOST, env=env)
    except BaseException:
        stop_process(etcd.proc if etcd else None)
        raise
    return Cluster(server, secret=secret, etcd=etcd)


def stop_cluster(cluster: Cluster, timeout_s: float = 30.0) -> None:
    """Stop the Conductor's process group, then any instance left over. Instances live in their own
    process groups and follow the Conductor on its death (SIGTERM); a stopped one cannot, so each
    gets SIGCONT first, and the group of one still there after ``timeout_s`` gets SIGKILL."""
    for pid in cluster.seen_pids:
        if cluster.owns(pid):
            signal_pid(pid, signal.SIGCONT)
    stop_process(cluster.pool_node)
    for extra in cluster.extra_servers:
        extra.stop(timeout_s)
    cluster.server.stop(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(cluster.owns(p) for p in cluster.seen_pids):
        time.sleep(0.2)
    for pid in cluster.seen_pids:
        if cluster.owns(pid):
            try:
                if os.getpgid(pid) == pid:  # the launcher makes each instance the leader of its own group
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if cluster.etcd is not None:
        stop_process(cluster.etcd.proc)
        shutil.rmtree(cluster.etcd.data_dir, ignore_errors=True)


def signal_pid(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


async def conductor_stats(client: httpx.AsyncClient, cluster: Cluster) -> dict[str, Any] | None:
    try:
        r = await client.get(cluster.url + "/stats", timeout=10)
        stats = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if stats:
        cluster.seen_pids.update(i["pid"] for i in stats.get("instances", []) if i.get("pid"))
        cluster.seen_pids.update(s["pid"] for s in stats.get("supervised", []) if s.get("pid"))
    return stats


async def wait_until(check: Callable[[], Awaitable[Any]], timeout_s: float, interval_s: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy (returned) or ``timeout_s`` passes (None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if value := await check():
            return value
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(interval_s)


async def all_up(client: httpx.AsyncClient, cluster: Cluster) -> dict[str, Any] | None:
    """The Conductor's stats when each supervised instance is alive and up, else None."""
    stats = await conductor_stats(client, cluster)
    if not stats or not stats.get("instances"):
        return None
    up = {i["url"] for i in stats["instances"] if i["up"]}
    supervised = stats.get("supervised") or []
    if all(s["alive"] and s["url"] in up for s in supervised) and {"prefill", "decode"} <= {
            i["role"] for i in stats["instances"] if i["up"]}:
        return stats
    return None


# --------------------------------------------------------------------------- the run
