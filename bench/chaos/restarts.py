"""bench.chaos: ``--restarts`` kill -9 restarts of one instance, and what the survivors keep (issue 31).

The Supervisor rightly holds a sixth restart within five minutes back (a crash loop), so the
instance restarted here is a decode instance of the bench's own: it runs the command line the
Conductor gave one of its decode instances, on a port of its own, and joins the cluster as they
do (etcd, or registering with the Conductor); the bench starts it again on the same port as
soon as it is dead. Each incarnation is killed while it holds a request (a reservation or a
running sequence: a prefill instance may be writing KV into it over shared memory), or after
``BUSY_WAIT_S`` if none came. The survivors are every other process of the cluster: the
Conductor and its instances.

Before the first kill (once the first incarnation has generated tokens, so that the survivors'
links to it exist) and after the last restart (once the last incarnation has done the same),
each survivor's RSS, anonymous and shared memory (``/proc/PID/status``), threads, open
descriptors and open memfds (descriptors naming ``/memfd:``) are read: for each figure the
smallest of ``SAMPLES`` readings, since a request in flight holds a connection or a thread for a
moment and what matters is what stays. A figure that grew by more than its ``TOLERANCE``, or a
survivor that died, is counted: must be 0. Before the Messenger dropped a dead peer's links,
each restart left a prefill instance 1 GiB of shared memory, 2 memfds and 2 threads richer.

The last incarnation stays up, one more decode instance, until the run ends.
"""

from __future__ import annotations

import asyncio
import signal
import time
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

SAMPLES = 5
SAMPLE_GAP_S = 0.5
BUSY_WAIT_S = 60.0
# How much each figure of a survivor may grow over all the restarts. A leaked link costs far more
# over ten restarts (1 GiB of shared memory, 2 memfds and 2 threads each, before issue 31); the
# memory figures move by a hundred MiB or so under live traffic (the allocator, page cache), and
# a survivor that wrote to the first incarnation but not (yet) to the last, or the other way
# round, counts one live link more or less: its memfds, threads and sockets.
TOLERANCE = {"rss_mib": 256, "anon_mib": 256, "shmem_mib": 256, "threads": 4, "fds": 6, "memfds": 2}
LABELS = {"rss_mib": "RSS MiB", "anon_mib": "anonymous memory MiB (RssAnon)", "shmem_mib": "shared memory MiB (RssShmem)",
          "threads": "threads", "fds": "open descriptors", "memfds": "open memfds"}


def figures(pid: int) -> dict[str, int] | None:
    """The ``TOLERANCE`` figures of process ``pid`` now (None: it is gone)."""
    status = proc_status(pid, ("VmRSS", "RssAnon", "RssShmem", "Threads"))
    if len(status) < 4:
        return None
    fds = open_fds(pid)
    return {"rss_mib": status["VmRSS"] // 1024, "anon_mib": status["RssAnon"] // 1024,
            "shmem_mib": status["RssShmem"] // 1024, "threads": status["Threads"], "fds": len(fds),
            "memfds": sum(t.startswith("/memfd:") for t in fds)}


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
    result: dict[str, Any] = {"url": url, "restarts": 0, "killed_busy": 0, "restart_s": []}
    run.faulted.add(url)  # down between its incarnations, as intended
    t_start = time.monotonic()
    server = await _start(run, cmd, url, 0)

    async def generated() -> bool:
        return (await _instance_stats(run, url)).get("num_generated_tokens", 0) > 0

    async def busy() -> bool:
        s = await _instance_stats(run, url)
        return bool(s.get("num_reservations") or s.get("num_running"))

    await wait_until(generated, BUSY_WAIT_S, interval_s=0.2)
    before = await settled(survivors)
    progress(f"{cfg.restarts} kill -9 restarts of the decode instance {url} (started as pid {server.proc.pid}); "
             f"survivors: {', '.join(survivors)}")
    for n in range(1, cfg.restarts + 1):
        result["killed_busy"] += bool(await wait_until(busy, BUSY_WAIT_S, interval_s=0.1))
        t0 = time.monotonic()
        await asyncio.to_thread(server.stop, 10.0, signal.SIGKILL)
        cluster.extra_servers.remove(server)
        server = await _start(run, cmd, url, n)
        result["restart_s"].append(round(time.monotonic() - t0, 1))
        result["restarts"] = n
    await wait_until(generated, BUSY_WAIT_S, interval_s=0.2)
    run.faulted.discard(url)  # up for good now: from here on it is a healthy instance like the others
    after = await settled(survivors)
    grown = [f"{label} {fig} {before[label][fig]} -> {after[label][fig]}"
             for label in survivors if before[label] and after[label]
             for fig, slack in TOLERANCE.items() if after[label][fig] - before[label][fig] > slack]
    lost = [label for label in survivors if not (before[label] and after[label])]
    result.update(survivors={label: {"pid": pid, "before": before[label], "after": after[label]}
                             for label, pid in survivors.items()},
                  totals={fig: [sum(b[fig] for b in before.values() if b), sum(a[fig] for a in after.values() if a)]
                          for fig in TOLERANCE},
                  grown=grown, survivors_lost=lost, seconds=round(time.monotonic() - t_start, 1))
    progress(f"{cfg.restarts} restarts in {result['seconds']} s ({result['killed_busy']} killed holding a request); "
             f"survivors before -> after: " + "; ".join(f"{LABELS[f]} {b} -> {a}" for f, (b, a) in result["totals"].items())
             + f"; grown beyond tolerance: {grown or 'none'}; survivors lost: {lost or 'none'}")
    return result
