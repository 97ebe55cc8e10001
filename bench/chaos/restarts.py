"""bench.chaos: ``--restarts`` kill -9 restarts of one instance, and what the survivors keep (issue 31).

The Supervisor rightly holds a sixth restart within five minutes back (a crash loop), so the
instance restarted here is a decode instance of the bench's own: it runs the command line the
Conductor gave one of its decode instances, on a port of its own, and joins the cluster as they
do (etcd, or registering with the Conductor); the bench starts it again on the same port as
soon as it is dead. Each incarnation is killed while it holds a request (a reservation or a
running sequence: a prefill instance may be writing KV into it over shared memory), or after
``BUSY_WAIT_S`` if none came. The survivors are every other process of the cluster: the
Conductor and its instances.

After ``WARMUP_RESTARTS`` restarts (once the incarnation then up has generated tokens, so that
the survivors' links to it exist) and after ``--restarts`` more (once the last incarnation has
done the same), each survivor's RSS, anonymous and shared memory (``/proc/PID/status``),
threads, open descriptors, open memfds (descriptors naming ``/memfd:``) and memfds mapped
(``/proc/PID/maps``: a dead peer's memory still mapped) are read: for each figure the smallest of
``SAMPLES`` readings, since a request in flight holds a connection or a thread for a moment and
what matters is what stays. A figure that grew by more than its ``TOLERANCE``, or a survivor that
died, is counted: must be 0. The report also keeps one reading after each restart (a leak grows
with each) and the kinds of descriptors (sockets, pipes, memfds, ...). Before the Messenger
dropped a dead peer's links, each restart left a prefill instance 1 GiB of shared memory, 2
memfds and 2 threads richer.

The last incarnation stays up, one more decode instance, until the run ends.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench.chaos.cluster import conductor_stats, wait_until
from bench.chaos.config import HOST, SECRET_ENV, progress
from bench.chaos.load import open_fds, proc_status
from bench.harness import ServerProcess, start_server
from cluster.conductor.supervisor import free_port

if TYPE_CHECKING:
    from bench.chaos.run import Run

# Restarts before the figures are first read: the survivors' pools of threads and connections
# fill up on the first restarts they go through (moves, recomputes, links made again), which is
# growth once, not per restart.
WARMUP_RESTARTS = 3
SAMPLES = 5
SAMPLE_GAP_S = 0.5
BUSY_WAIT_S = 60.0
# How much each figure of a survivor may grow over the restarts. A leaked link costs more over
# ten restarts (1 GiB of shared memory, 2 memfds and 2 threads each, before issue 31; a socket at
# least). The memory figures move by a few hundred MiB without any restart: the allocator, and
# the pages of a survivor's own KV cache, touched for the first time as the traffic goes on; the
# descriptors by a few sockets (the live traffic's connections). And a survivor may link to a
# peer it never had to talk to before (a request moved off the dead instance goes somewhere new):
# a memfd and up to 7 threads, once; and it may have written to the incarnation of the first
# reading but not (yet) to the last, or the other way round: one live link more or less.
TOLERANCE = {"rss_mib": 512, "anon_mib": 512, "shmem_mib": 512, "threads": 8, "fds": 8, "memfds": 2, "memfd_maps": 2}
LABELS = {"rss_mib": "RSS MiB", "anon_mib": "RssAnon MiB", "shmem_mib": "RssShmem MiB", "threads": "threads",
          "fds": "descriptors", "memfds": "memfds open", "memfd_maps": "memfds mapped"}


def figures(pid: int) -> dict[str, int] | None:
    """The ``TOLERANCE`` figures of process ``pid`` now (None: it is gone)."""
    status = proc_status(pid, ("VmRSS", "RssAnon", "RssShmem", "Threads"))
    if len(status) < 4:
        return None
    fds = open_fds(pid)
    return {"rss_mib": status["VmRSS"] // 1024, "anon_mib": status["RssAnon"] // 1024,
            "shmem_mib": status["RssShmem"] // 1024, "threads": status["Threads"], "fds": len(fds),
            "memfds": sum(t.startswith("/memfd:") for t in fds), "memfd_maps": memfd_maps(pid)}


def memfd_maps(pid: int) -> int:
    """Distinct memfds mapped into ``pid`` (``/proc/PID/maps``): a dead peer's shared memory still
    mapped shows here even once its descriptor is closed."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return 0
    return len({line.split()[4] for line in lines if "/memfd:" in line})


def fd_kinds(pid: int) -> dict[str, int]:
    """How many open descriptors of ``pid`` are sockets, pipes, memfds, anonymous inodes (eventfd,
    epoll, ...) or files: where a growth of ``fds`` comes from."""
    def kind(target: str) -> str:
        return next((k.lstrip("/") for k in ("socket", "pipe", "anon_inode", "/memfd") if target.startswith(k + ":")),
                    "file")
    return dict(Counter(kind(t) for t in open_fds(pid)))


async def settled(pids: dict[str, int]) -> dict[str, dict[str, int] | None]:
    """Each process's figures, each the smallest of ``SAMPLES`` readings ``SAMPLE_GAP_S`` apart
    (None for a process gone meanwhile)."""
    out: dict[str, dict[str, int] | None] = {}
    for i in range(SAMPLES):
        if i:
            await asyncio.sleep(SAMPLE_GAP_S)
        for label, pid in pids.items():
            now = figures(pid)
            if now is None or (i and out[label] is None):
                out[label] = None
            else:
                out[label] = {k: min(v, out[label][k]) for k, v in now.items()} if i else now
    return out


def instance_command(pid: int, port: int) -> list[str]:
    """The command line of instance ``pid``, on ``port`` instead of its own."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    at = args.index("--port") + 1
    return [*args[:at], str(port), *args[at + 1:]]


async def _instance_stats(run: Run, url: str) -> dict[str, Any]:
    try:
        return (await run.client.get(url + "/stats", timeout=5)).json()
    except (httpx.HTTPError, ValueError):
        return {}


async def _start(run: Run, cmd: list[str], url: str, incarnation: int) -> ServerProcess:
    """Incarnation ``incarnation`` of the instance, once the Conductor counts it up."""
    cluster = run.cluster
    server = start_server(f"restarted instance #{incarnation}", cmd, url,
                          run.cfg.log_path.with_name(f"restarted-{incarnation}.log"),
                          {"OMP_NUM_THREADS": "1", SECRET_ENV: cluster.secret})
    cluster.extra_servers.append(server)
    cluster.seen_pids.add(server.proc.pid)

    async def up() -> bool:
        stats = await conductor_stats(run.client, cluster)
        return bool(stats) and any(i["url"] == url and i["up"] and i["pid"] == server.proc.pid
                                   for i in stats["instances"])

    if not await wait_until(up, run.cfg.restart_timeout_s, interval_s=0.2):
        raise RuntimeError(f"incarnation {incarnation} of {url} was not up within {run.cfg.restart_timeout_s:g} s "
                           f"(log: {server.log_path})")
    return server


async def restart_one_instance(run: Run) -> dict[str, Any]:
    cluster, cfg = run.cluster, run.cfg
    stats = await conductor_stats(run.client, cluster)
    if not stats:
        raise RuntimeError("the Conductor's /stats did not answer")
    own = [i for i in stats["instances"] if i["up"] and cluster.owns(i["pid"])]
    decode = [i for i in own if i["role"] == "decode"]
    if not decode:
        raise RuntimeError(f"no decode instance of this cluster is up: {stats['instances']}")
    url = f"http://{HOST}:{free_port(HOST)}"
    cmd = instance_command(decode[0]["pid"], int(url.rsplit(":", 1)[1]))
    survivors = {"Conductor": cluster.server.proc.pid, **{f"{i['role']} {i['url']}": i["pid"] for i in own}}
    result: dict[str, Any] = {"url": url, "warmup_restarts": WARMUP_RESTARTS, "restarts": 0, "killed_busy": 0,
                              "restart_s": []}
    run.faulted.add(url)  # down between its incarnations, as intended
    t_start = time.monotonic()
    server = await _start(run, cmd, url, 0)

    async def generated() -> bool:
        return (await _instance_stats(run, url)).get("num_generated_tokens", 0) > 0

    async def busy() -> bool:
        s = await _instance_stats(run, url)
        return bool(s.get("num_reservations") or s.get("num_running"))

    async def restart(n: int) -> None:
        nonlocal server
        result["killed_busy"] += bool(await wait_until(busy, BUSY_WAIT_S, interval_s=0.1))
        t0 = time.monotonic()
        await asyncio.to_thread(server.stop, 10.0, signal.SIGKILL)
        cluster.extra_servers.remove(server)
        server = await _start(run, cmd, url, n)
        result["restart_s"].append(round(time.monotonic() - t0, 1))

    progress(f"{WARMUP_RESTARTS} + {cfg.restarts} kill -9 restarts of the decode instance {url} (started as pid "
             f"{server.proc.pid}); survivors: {', '.join(survivors)}")
    for n in range(1, WARMUP_RESTARTS + 1):
        await restart(n)
    await wait_until(generated, BUSY_WAIT_S, interval_s=0.2)
    before = await settled(survivors)
    kinds_before = {label: fd_kinds(pid) for label, pid in survivors.items()}
    # One reading after each restart: a leak grows with every restart, a pool of threads or
    # connections that fills up once does not.
    series: dict[str, list[dict[str, int] | None]] = {label: [] for label in survivors}
    for n in range(1, cfg.restarts + 1):
        await restart(WARMUP_RESTARTS + n)
        result["restarts"] = n
        for label, pid in survivors.items():
            series[label].append(figures(pid))
    await wait_until(generated, BUSY_WAIT_S, interval_s=0.2)
    run.faulted.discard(url)  # up for good now: from here on it is a healthy instance like the others
    after = await settled(survivors)
    grown = [f"{label} {fig} {before[label][fig]} -> {after[label][fig]}"
             for label in survivors if before[label] and after[label]
             for fig, slack in TOLERANCE.items() if after[label][fig] - before[label][fig] > slack]
    lost = [label for label in survivors if not (before[label] and after[label])]
    result.update(survivors={label: {"pid": pid, "before": before[label], "after": after[label],
                                     "fd_kinds_before": kinds_before[label], "fd_kinds_after": fd_kinds(pid),
                                     "after_each_restart": series[label]}
                             for label, pid in survivors.items()},
                  totals={fig: [sum(b[fig] for b in before.values() if b), sum(a[fig] for a in after.values() if a)]
                          for fig in TOLERANCE},
                  grown=grown, survivors_lost=lost, seconds=round(time.monotonic() - t_start, 1))
    progress(f"{cfg.restarts} restarts in {result['seconds']} s ({result['killed_busy']} killed holding a request); "
             f"survivors before -> after: " + "; ".join(f"{LABELS[f]} {b} -> {a}" for f, (b, a) in result["totals"].items())
             + f"; grown beyond tolerance: {grown or 'none'}; survivors lost: {lost or 'none'}")
    return result
