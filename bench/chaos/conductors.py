"""bench.chaos: one of two Conductors killed (issue 31).

A second Conductor (``python -m server --prefill-instances 0 --decode-instances 0``, its own
``--conductor-id``) is started on the bench's etcd, where the cluster's instances announce
themselves; it must find all of them. Streams go through it, and once they are under way it gets
kill -9. Through the first Conductor the steady stream and the long prompts go on (the usual
rows count anything they lose, and any healthy instance marked down). The fault is recovered
when: the second Conductor found every instance, no instance restarted, and every reservation the
dead Conductor held on the instances was released within one reservation lease (the shipped
10 s, plus a poll). Its cut streams are its own clients': they are counted apart.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import httpx

from bench.chaos.cluster import conductor_stats, wait_until
from bench.chaos.config import COMPLETIONS, HOST, SECRET_ENV, progress
from bench.chaos.load import long_prompt
from bench.chaos.traffic import Outcome, send
from bench.harness import launch_server

if TYPE_CHECKING:
    from bench.chaos.run import Run

SECOND_ID = "chaos-second"
LEASE_S = 10.0  # the instances' shipped --reservation-lease-s
STREAMS = 4


async def second_conductor_killed(run: Run) -> None:
    cluster, cfg = run.cluster, run.cfg
    if cluster.etcd is None:
        raise RuntimeError("two Conductors need the membership in etcd (this run has --no-etcd)")
    before = await conductor_stats(run.client, cluster)
    pids = {i["url"]: i["pid"] for i in before["instances"]}
    env = {"OMP_NUM_THREADS": "1", SECRET_ENV: cluster.secret}
    second = launch_server(["--dtype", "float32", "--prefill-instances", "0", "--decode-instances", "0",
                            "--etcd", cluster.etcd.url, "--conductor-id", SECOND_ID],
                           cfg.log_path.with_name("conductor2.log"), name="second Conductor", python=cfg.python,
                           host=HOST, env=env)
    fault: dict[str, Any] = {"kind": "kill -9", "role": "second Conductor", "old_pid": second.proc.pid,
                             "at_s": run._elapsed()}
    run.faults.append(fault)
    try:
        t0 = time.monotonic()

        async def sees_all() -> bool:
            try:
                r = await run.client.get(second.base_url + "/stats", timeout=5)
                return sum(i["up"] for i in r.json()["instances"]) == len(pids)
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        found = await wait_until(sees_all, cfg.health_timeout_s)
        fault["found_instances_s"] = round(time.monotonic() - t0, 1) if found else None
        if not found:
            fault.update(recovered=False, summary=f"the second Conductor did not find the {len(pids)} instances")
            return
        progress(f"second Conductor serving over the {len(pids)} instances after {fault['found_instances_s']} s")
        # Long prompts, so that its reservations are out on the decode instances while they prefill.
        outs = [Outcome(run.phase, -1, True, long_key=f"second-{k}") for k in range(STREAMS)]
        bodies = [{"prompt": long_prompt(cfg.seed, 100 + k, 0, cfg.long_words), "max_tokens": 32, "temperature": 0,
                   "stream": True} for k in range(STREAMS)]
        streams = [asyncio.create_task(send(run.client, second.base_url, o, 32, cfg.deadline_s,
                                            override=(COMPLETIONS, b))) for o, b in zip(outs, bodies)]
        held = await wait_until(lambda: _held(run), 30, interval_s=0.2)
        os.kill(second.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        progress(f"kill -9 of the second Conductor pid {second.proc.pid} with {STREAMS} streams under way "
                 f"(its reservations on the instances: {held})")
        await asyncio.gather(*streams)
        released = await wait_until(lambda: _released(run), LEASE_S + 5, interval_s=0.2)
        fault["released_s"] = round(time.monotonic() - killed, 1) if released else None
        after = await conductor_stats(run.client, cluster)
        restarted = [u for u, p in pids.items()
                     if not any(i["url"] == u and i["pid"] == p and i["up"] for i in after["instances"])]
        fault.update(streams_cut=sum(o.result != "completed" for o in outs), instances_restarted=len(restarted),
                     recovered=bool(released) and not restarted)
        fault["summary"] = (f"found the {len(pids)} instances in {fault['found_instances_s']} s; {fault['streams_cut']}"
                            f" of its {STREAMS} streams cut; instances restarted: {len(restarted)}; its "
                            f"reservations released {fault['released_s']} s after its death (lease {LEASE_S:g} s)")
        progress(f"second Conductor: {fault['summary']}")
    finally:
        second.stop(10.0)


async def _reservations(run: Run) -> int | None:
    """Reservations the second Conductor holds on the cluster's instances (None: unknown)."""
    stats = await conductor_stats(run.client, run.cluster)
    if not stats:
        return None
    total = 0
    for inst in stats["instances"]:
        try:
            r = await run.client.get(inst["url"] + "/stats", timeout=5)
            total += r.json().get("reservations_by_conductor", {}).get(SECOND_ID, 0)
        except (httpx.HTTPError, ValueError):
            return None
    return total


async def _held(run: Run) -> int | None:
    n = await _reservations(run)
    return n or None


async def _released(run: Run) -> bool:
    return await _reservations(run) == 0
