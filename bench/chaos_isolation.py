"""bench.chaos, the fault-isolation part (issue 23 §8): what the cluster of two instances of each
role must survive without losing a request or marking a healthy instance down.

* **long prompts**: ``--long-clients`` clients, each sending prompts of about ``--long-words``
  words one after another, so requests queue on the prefill instances and hold decode
  reservations for seconds while the faults hit. Each prompt is new (no prefix cache helps
  its first answer) and is sent twice in a row, cold then warm (streamed one way, not the
  other); in float32 both answers must be the same text.
* a **monitor** polls the Conductor's ``/stats`` every half second through the whole run: an
  instance record with ``up`` false whose URL is not the one being faulted is a healthy
  instance marked down; it also samples the Conductor process's memory (``/proc/PID/status``).
* the **metadata store stopped**: the bench starts its own etcd (``--etcd``), SIGSTOPs it for
  ``--etcd-stop-s`` (a request must be served meanwhile: the pool is a cache), then SIGCONT.
* a **pool node stopped**: a ``python -m cluster.pool`` node on the same metadata, SIGSTOPped for
  ``--pool-stop-s`` (served meanwhile), then killed with SIGKILL (served afterwards).
* an **unsigned huge control body**: 1 GiB streamed to ``/cluster/register`` on the public port
  with no signature; the Conductor must refuse it from the headers (401) and its peak RSS must
  not grow by the body.
* a **replayed and a stale-epoch control call**: a poll signed as the Conductor signs it (the
  cluster secret, its epoch, the instance as audience) is answered, then the same bytes again
  (a replay), the same with a newer epoch header (which, if taken, would release every
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
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import harness

if TYPE_CHECKING:
    from bench.chaos import Run

PARTITION = "not run here (see tests/test_across_hosts.py)"
LATE_WRITER = "covered by tests/test_late_write.py"
# The Conductor's peak RSS may grow by this much while a huge body is streamed at it (what one
# request's buffers and logging cost); more means it is reading the body into memory.
HUGE_BODY_RSS_SLACK_MIB = 64

# Common English words: a prompt of n of them is about 1.3 n tokens, as prose is.
_WORDS = ["the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "with", "as", "by", "at", "from", "his", "her", "they", "we", "you", "it", "this", "which", "be", "are", "were", "had", "have", "has", "not", "but", "all", "one", "can", "more", "some", "there", "when", "what", "who", "their", "time", "people", "year", "way", "day", "man", "woman", "child", "world", "life", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "river", "garden", "window", "market", "table", "road", "light", "music", "field", "paper", "village", "sea", "mountain", "small", "large", "old", "new", "good", "great", "long", "little", "own", "other", "right", "big", "high", "different", "early", "young", "important", "few", "public", "bad", "same", "able", "every", "open", "green", "quiet", "slow", "bright", "cold", "warm", "dark", "simple", "strong", "walk", "run", "read", "write", "speak", "build", "carry", "follow", "begin", "grow", "learn", "remember", "bring", "hold", "stand", "turn", "start", "show", "hear", "play", "move", "live", "believe", "happen", "include", "continue", "set", "lead", "understand", "watch", "stop", "create"]


def long_prompt(seed: int, client: int, k: int, n_words: int) -> str:
    """Prompt ``k`` of client ``client``: ``n_words`` words that share no prefix with another."""
    rng = random.Random(f"{seed}/{client}/{k}")
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    return f"Note {client}-{k}. " + " ".join(words) + ". Summarize the note:"


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of ``pid`` in KiB; {} when it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.MULTILINE)}


def partition_support() -> str:
    """Why the bench does not partition an instance itself (for the report)."""
    netns = False
    if os.geteuid() == 0 and shutil.which("ip"):
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode == 0
    return PARTITION + ("; network namespaces work here" if netns else "; no network namespaces here")


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


# --------------------------------------------------------------------------- the long-prompt load


async def long_clients(run: Run, stop: asyncio.Event) -> None:
    """``long_clients`` clients, each a new long prompt after the other, cold then warm."""
    from bench.chaos import COMPLETIONS, Outcome, send

    async def client(c: int) -> None:
        k = 0
        while not stop.is_set():
            prompt = long_prompt(run.cfg.seed, c, k, run.cfg.long_words)
            for warm in (False, True):
                out = Outcome(run.phase, -1, stream=(c + k + warm) % 2 == 1, long_key=f"{c}.{k}")
                run.outcomes.append(out)
                body = {"prompt": prompt, "max_tokens": run.cfg.long_max_tokens, "temperature": 0,
                        "stream": out.stream}
                await send(run.client, run.cluster.url, out, run.cfg.long_max_tokens, run.cfg.deadline_s,
                           override=(COMPLETIONS, body))
                if out.result != "completed":
                    await asyncio.sleep(1.0)  # an error answer is quick: do not spin
            k += 1

    await asyncio.gather(*(client(c) for c in range(run.cfg.long_clients)))


# --------------------------------------------------------------------------- the monitor


@dataclass
class Monitor:
    """What the Conductor said about its instances while the run went on."""

    samples: int = 0
    marked_down: list[dict[str, Any]] = field(default_factory=list)  # healthy instances marked down
    faulted_down: int = 0  # samples where the faulted instance was down (expected)
    rss_kib: list[tuple[float, int]] = field(default_factory=list)
    peak_hwm_kib: int = 0


async def monitor(run: Run, stop: asyncio.Event, interval_s: float = 0.5) -> None:
    from bench.chaos import conductor_stats

    m = run.monitor
    open_episodes: dict[str, dict[str, Any]] = {}
    pid = run.cluster.server.proc.pid
    while not stop.is_set():
        mem = memory_kib(pid)
        if mem:
            m.rss_kib.append((run._elapsed(), mem.get("VmRSS", 0)))
            m.peak_hwm_kib = max(m.peak_hwm_kib, mem.get("VmHWM", 0))
        stats = await conductor_stats(run.client, run.cluster)
        if stats:
            m.samples += 1
            for inst in stats.get("instances", []):
                url = inst["url"]
                if inst["up"]:
                    open_episodes.pop(url, None)
                elif url in run.faulted:
                    m.faulted_down += 1
                    open_episodes.pop(url, None)
                elif url not in open_episodes:
                    episode = {"url": url, "role": inst["role"], "phase": run.phase, "at_s": run._elapsed(),
                               "last_error": inst.get("last_error"), "faulted_then": sorted(run.faulted)}
                    open_episodes[url] = episode
                    m.marked_down.append(episode)
                    from bench.chaos import _progress
                    _progress(f"HEALTHY instance marked down: {episode}")
                else:
                    open_episodes[url]["until_s"] = run._elapsed()
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass


# --------------------------------------------------------------------------- faults


async def _signal_window(run: Run, proc: subprocess.Popen, stop_s: float) -> dict[str, Any]:
    """SIGSTOP ``proc`` for ``stop_s`` seconds, probing the cluster meanwhile; then SIGCONT."""
    proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        during = await asyncio.wait_for(run.probe(), max(stop_s, 1.0) + run.cfg.probe_timeout_s)
    except asyncio.TimeoutError:
        during = {"served": False, "served_after_s": None, "attempts": None}
    finally:
        await asyncio.sleep(max(0.0, stop_s - (time.monotonic() - t0)))
        proc.send_signal(signal.SIGCONT)
    return during


async def stop_etcd(run: Run) -> None:
    """SIGSTOP the metadata store (etcd) for ``etcd_stop_s``: requests are served meanwhile."""
    from bench.chaos import _progress, conductor_stats

    etcd: Etcd = run.cluster.etcd
    before = ((await conductor_stats(run.client, run.cluster)) or {}).get("pool") or {}
    fault: dict[str, Any] = {"kind": "SIGSTOP", "role": "metadata store (etcd)", "old_pid": etcd.proc.pid,
                             "new_pid": etcd.proc.pid, "stopped_s": run.cfg.etcd_stop_s, "at_s": run._elapsed()}
    run.faults.append(fault)
    _progress(f"SIGSTOP etcd pid {etcd.proc.pid} for {run.cfg.etcd_stop_s:g} s")
    during = await _signal_window(run, etcd.proc, run.cfg.etcd_stop_s)
    after = await run.probe()
    pool = ((await conductor_stats(run.client, run.cluster)) or {}).get("pool") or {}
    fault.update(served_while_stopped=during["served"], served_while_stopped_s=during["served_after_s"],
                 served=after["served"], served_after_s=after["served_after_s"],
                 metadata_unavailable=pool.get("metadata_unavailable", 0) - before.get("metadata_unavailable", 0))
    fault["recovered"] = bool(during["served"] and after["served"])
    fault["summary"] = (f"served while stopped after {during['served_after_s']} s, after SIGCONT "
                        f"{after['served_after_s']} s; pool calls given up: {fault['metadata_unavailable']}")
    _progress(f"etcd: {fault['summary']}")


async def stop_pool_node(run: Run) -> None:
    """A pool node of the cluster's: SIGSTOP for ``pool_stop_s`` (served meanwhile), then SIGKILL."""
    from bench.chaos import _progress, conductor_stats

    cluster = run.cluster
    meta = ["--etcd", cluster.etcd.url] if cluster.etcd is not None else ["--metadata", embedded_metadata_url(run)]
    proc, segment = await start_pool_node(meta, cluster.secret, run.cfg.log_path.parent / "pool-node.log")
    cluster.pool_node = proc

    async def listed() -> bool:
        stats = await conductor_stats(run.client, cluster)
        return bool(stats) and segment in ((stats.get("pool") or {}).get("segments") or {})

    from bench.chaos import wait_until
    seen = await wait_until(listed, 30.0)
    fault: dict[str, Any] = {"kind": "SIGSTOP then kill -9", "role": "pool node", "old_pid": proc.pid,
                             "new_pid": None, "segment": segment, "listed": bool(seen),
                             "stopped_s": run.cfg.pool_stop_s, "at_s": run._elapsed()}
    run.faults.append(fault)
    _progress(f"pool node {segment} pid {proc.pid} (listed: {bool(seen)}): SIGSTOP for {run.cfg.pool_stop_s:g} s")
    during = await _signal_window(run, proc, run.cfg.pool_stop_s)
    proc.kill()
    proc.wait(10)
    after = await run.probe()
    fault.update(served_while_stopped=during["served"], served=after["served"], served_after_s=after["served_after_s"])
    fault["recovered"] = bool(during["served"] and after["served"])
    fault["summary"] = (f"served while stopped after {during['served_after_s']} s, after the kill "
                        f"{after['served_after_s']} s")
    _progress(f"pool node: {fault['summary']}")


def embedded_metadata_url(run: Run) -> str:
    found = re.search(r"KVCache pool metadata at (\S+)", run.cluster.server.log())
    if not found:
        raise RuntimeError("the Conductor did not log its metadata server's address")
    return found.group(1)


async def huge_body(run: Run) -> dict[str, Any]:
    """Stream ``huge_body_bytes`` of unsigned body to ``/cluster/register``; the answer, what was
    sent before the server stopped reading, and the Conductor's memory before, during and after."""
    from bench.chaos import HOST, _progress

    n = run.cfg.huge_body_bytes
    pid = run.cluster.server.proc.pid
    before = memory_kib(pid)
    peak_rss = before.get("VmRSS", 0)
    _progress(f"unsigned {n / 2**30:g} GiB body to /cluster/register (Conductor pid {pid}, "
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
    _progress(f"huge body: HTTP {status} after {out['sent_before_refusal_mib']} MiB sent, "
              f"VmHWM growth {growth} MiB")
    return out


async def stale_epoch(run: Run) -> dict[str, Any]:
    """Control calls signed as the Conductor would sign them, then replayed, re-dated to a newer
    epoch, or signed with an older one: only the first may be taken."""
    from bench.chaos import _progress, conductor_stats
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
    _progress(f"stale epoch / replay: {calls}; epoch-replaced log lines: {replaced}")
    return out
