"""bench.chaos: faults of the parts the instances share (issue 23 §8), which must cost no request
and mark no healthy instance down.

* the **metadata store stopped**: the bench starts its own etcd (``--etcd``), SIGSTOPs it for
  ``--etcd-stop-s`` (a request must be served meanwhile: the pool is a cache), then SIGCONT.
* a **pool node stopped**: ``pool_node.py``.
* an **unsigned huge control body**: 1 GiB streamed to ``/cluster/register`` on the public port
  with no signature; the Conductor must refuse it from the headers (401) and its peak RSS must
  not grow by the body.
* a **replayed and a stale-epoch control call**: a poll signed as the Conductor signs it (the
  cluster secret, its id and epoch, the instance as audience) is answered, then the same bytes
  again (a replay), the same with a newer epoch header (which, if taken, would release every
  reservation of the Conductor's) and a reserve signed with an older epoch must all be refused
  (401 / 409), and no instance may log that an epoch replaced another.

A partition of one instance needs network namespaces: it is not run here (tests/test_across_hosts.py
does it). A late KV writer cannot be made honestly from outside the processes:
tests/test_late_write.py covers it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from bench.chaos.cluster import Etcd, conductor_stats
from bench.chaos.config import HOST, progress
from bench.chaos.load import memory_kib

if TYPE_CHECKING:
    from bench.chaos.run import Run

T = TypeVar("T")

PARTITION = "not run here (see tests/test_across_hosts.py)"
LATE_WRITER = "covered by tests/test_late_write.py"
# The Conductor's peak RSS may grow by this much while a huge body is streamed at it (what one
# request's buffers and logging cost); more means it is reading the body into memory.
HUGE_BODY_RSS_SLACK_MIB = 64


def partition_support() -> str:
    """Why the bench does not partition an instance itself (for the report)."""
    netns = False
    if os.geteuid() == 0 and shutil.which("ip"):
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode == 0
    return PARTITION + ("; network namespaces work here" if netns else "; no network namespaces here")



# --------------------------------------------------------------------------- faults


async def signal_window(proc: subprocess.Popen, stop_s: float, during: Awaitable[T]) -> T:
    """SIGSTOP ``proc``, await ``during``, and SIGCONT once ``stop_s`` seconds have passed (or
    ``during`` took longer); what ``during`` returned."""
    proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        return await during
    finally:
        await asyncio.sleep(max(0.0, stop_s - (time.monotonic() - t0)))
        proc.send_signal(signal.SIGCONT)


async def bounded_probe(run: Run, stop_s: float) -> dict[str, Any]:
    """``run.probe()``, given up (not served) after the stop and the probe's own timeout."""
    try:
        return await asyncio.wait_for(run.probe(), max(stop_s, 1.0) + run.cfg.probe_timeout_s)
    except asyncio.TimeoutError:
        return {"served": False, "served_after_s": None, "attempts": None}


async def stop_etcd(run: Run) -> None:
    """SIGSTOP the metadata store (etcd) for ``etcd_stop_s``: requests are served meanwhile."""

    etcd: Etcd = run.cluster.etcd
    before = ((await conductor_stats(run.client, run.cluster)) or {}).get("pool") or {}
    fault: dict[str, Any] = {"kind": "SIGSTOP", "role": "metadata store (etcd)", "old_pid": etcd.proc.pid,
                             "new_pid": etcd.proc.pid, "stopped_s": run.cfg.etcd_stop_s, "at_s": run._elapsed()}
    run.faults.append(fault)
    progress(f"SIGSTOP etcd pid {etcd.proc.pid} for {run.cfg.etcd_stop_s:g} s")
    during = await signal_window(etcd.proc, run.cfg.etcd_stop_s, bounded_probe(run, run.cfg.etcd_stop_s))
    after = await run.probe()
    pool = ((await conductor_stats(run.client, run.cluster)) or {}).get("pool") or {}
    fault.update(served_while_stopped=during["served"], served_while_stopped_s=during["served_after_s"],
                 served=after["served"], served_after_s=after["served_after_s"],
                 metadata_unavailable=pool.get("metadata_unavailable", 0) - before.get("metadata_unavailable", 0))
    fault["recovered"] = bool(during["served"] and after["served"])
    fault["summary"] = (f"served while stopped after {during['served_after_s']} s, after SIGCONT "
                        f"{after['served_after_s']} s; pool calls given up: {fault['metadata_unavailable']}")
    progress(f"etcd: {fault['summary']}")


async def huge_body(run: Run) -> dict[str, Any]:
    """Stream ``huge_body_bytes`` of unsigned body to ``/cluster/register``; the answer, what was
    sent before the server stopped reading, and the Conductor's memory before, during and after."""

    n = run.cfg.huge_body_bytes
    pid = run.cluster.server.proc.pid
    before = memory_kib(pid)
    peak_rss = before.get("VmRSS", 0)
    progress(f"unsigned {n / 2**30:g} GiB body to /cluster/register (Conductor pid {pid}, "
              f"VmHWM {before.get('VmHWM', 0) // 1024} MiB)")
    reader, writer = await asyncio.open_connection(HOST, run.cluster.port)
    head = (f"POST /cluster/register HTTP/1.1\r\nHost: {HOST}:{run.cluster.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {n}\r\n\r\n").encode()
    answer = asyncio.create_task(reader.read(65536))
    sent, error, t0 = 0, "", time.monotonic()
    chunk = b"[" + b"1," * (1 << 19)  # 1 MiB of a JSON array that never ends
    chunk = chunk[:1 << 20]
    try:
        writer.write(head)
        while sent < n and not answer.done():
            writer.write(chunk[:min(len(chunk), n - sent)])
            try:
                await asyncio.wait_for(writer.drain(), 10.0)
            except asyncio.TimeoutError:
                error = "the server stopped reading without answering for 10 s"
                break
            sent += min(len(chunk), n - sent)
            if sent % (64 << 20) == 0:
                peak_rss = max(peak_rss, memory_kib(pid).get("VmRSS", 0))
    except (ConnectionError, OSError) as e:
        error = f"{type(e).__name__} after the server closed"
    try:
        raw = await asyncio.wait_for(answer, 30.0)
    except (asyncio.TimeoutError, ConnectionError, OSError) as e:
        raw = b""
        error = error or f"no answer: {type(e).__name__}"
    finally:
        writer.close()
    elapsed = time.monotonic() - t0
    await asyncio.sleep(0.5)
    after = memory_kib(pid)
    peak_rss = max(peak_rss, after.get("VmRSS", 0))
    line = raw.split(b"\r\n", 1)[0].split()
    status = int(line[1]) if len(line) >= 2 and line[1].isdigit() else None
    growth = max(0, after.get("VmHWM", 0) - before.get("VmHWM", 0)) // 1024
    refused = status in (401, 413) and growth < HUGE_BODY_RSS_SLACK_MIB
    out = {"bytes": n, "status": status, "sent_before_refusal_mib": round(sent / 2**20, 1), "seconds": round(elapsed, 2),
           "answer": raw[:300].decode("utf-8", "replace"), "client_error": error,
           "vmhwm_before_mib": before.get("VmHWM", 0) // 1024, "vmhwm_after_mib": after.get("VmHWM", 0) // 1024,
           "vmhwm_growth_mib": growth, "vmrss_peak_mib": peak_rss // 1024, "refused": refused}
    progress(f"huge body: HTTP {status} after {out['sent_before_refusal_mib']} MiB sent, "
              f"VmHWM growth {growth} MiB")
    return out


async def stale_epoch(run: Run) -> dict[str, Any]:
    """Control calls signed as the Conductor would sign them, then replayed, re-dated to a newer
    epoch, or signed with an older one: only the first may be taken."""
    from cluster.instance.receiver import REPLACED
    from cluster.protocol import (
        CONTROL,
        EPOCH_HEADER,
        Fence,
        ReserveRequest,
        audience_of,
        derive_key,
        sign,
    )
    from engine.sampling_params import SamplingParams

    stats = await conductor_stats(run.client, run.cluster)
    if not stats:
        raise RuntimeError("the Conductor's /stats did not answer")
    epoch, conductor = int(stats["epoch"]), str(stats["conductor_id"])
    victim = await run._instance("decode")
    url = victim["url"]
    key = derive_key(run.cluster.secret.encode(), CONTROL)
    log_before = run.cluster.server.log().count(REPLACED)

    def signed(method: str, path: str, body: bytes, ep: int) -> dict[str, str]:
        fence = Fence(conductor, ep).header()  # as the Conductor's own calls carry it
        headers = sign(key, method, path, body, audience=audience_of(url), epoch=fence)
        headers[EPOCH_HEADER] = fence
        return headers

    calls: dict[str, int | None] = {}
    poll = signed("GET", "/instance/state", b"", epoch)
    calls["poll signed as the Conductor (must be 200)"] = (await run.client.get(url + "/instance/state",
                                                                                 headers=poll)).status_code
    calls["the same poll replayed"] = (await run.client.get(url + "/instance/state", headers=poll)).status_code
    newer = signed("GET", "/instance/state", b"", epoch)
    newer[EPOCH_HEADER] = Fence(conductor, epoch + 10**9).header()  # would release the Conductor's reservations
    calls["a poll with its epoch header made newer"] = (await run.client.get(url + "/instance/state",
                                                                             headers=newer)).status_code
    body = json.dumps(ReserveRequest(f"chaos-stale-{hashlib.sha1(os.urandom(8)).hexdigest()[:8]}", [1, 2, 3],
                                     SamplingParams(max_tokens=1)).to_dict()).encode()
    old = signed("POST", "/instance/reserve", body, epoch - 1)
    r = await run.client.post(url + "/instance/reserve", content=body,
                              headers={**old, "Content-Type": "application/json"})
    calls["a reserve signed with an older epoch"] = r.status_code
    replaced = run.cluster.server.log().count(REPLACED) - log_before
    accepted = sum(s not in (401, 409) for label, s in calls.items() if "must be 200" not in label) + replaced
    out = {"instance": url, "epoch": epoch, "calls": calls, "epoch_replaced_log_lines": replaced,
           "accepted": accepted, "valid_call_answered": calls["poll signed as the Conductor (must be 200)"] == 200}
    if not out["valid_call_answered"]:
        raise RuntimeError(f"a poll signed as the Conductor was not answered 200: {calls}")
    progress(f"stale epoch / replay: {calls}; epoch-replaced log lines: {replaced}")
    return out
