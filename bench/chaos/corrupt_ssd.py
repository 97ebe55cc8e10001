"""bench.chaos: a corrupt object on a pool segment's SSD tier (issue 31).

The pool's SSD tier is off by default and an instance's share of the pool's DRAM holds about
ninety objects, so this row runs on a cluster of its own: ``python -m server`` with one prefill
and one decode instance (leases and timeouts at the shipped defaults), each giving the pool
``POOL_DRAM_GIB`` of DRAM (four objects of 256 tokens) over an SSD tier, with a KV cache of
``KV_CACHE_GIB`` (about 2,300 tokens). A long prompt, the marker, is answered and stored in the
pool. Fresh long prompts follow until every segment has moved at least as many objects down to
its SSD as it held after the marker (eviction takes the least recently used first: the
marker's) and the prefill instance has computed more prompt tokens than its KV cache holds (its
own prefix cache has let the marker go). Then one byte in the middle of every object file on the
SSD tiers is flipped, and the marker is sent again: the prefill instance finds its objects in
the pool, the segment reads the SSD copy back to promote it, and its checksums do not match.

Must be 0: the marker's second answer not a 200 with the first answer's text (a miss costs only
the compute; the corrupt bytes taken as KV would be an error or another text), and a corrupt
copy the segments did not count (``corrupt_ssd_reads`` of each instance's ``/stats``).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench.chaos.cluster import wait_until
from bench.chaos.config import HOST, SECRET_ENV, progress
from bench.chaos.load import POOL_PROMPT_WORDS, long_prompt, send_long
from bench.harness import ServerProcess, launch_server

if TYPE_CHECKING:
    from bench.chaos.run import Run

POOL_DRAM_GIB = 0.06
SSD_GIB = 0.5
KV_CACHE_GIB = 0.1
MAX_FILLERS = 20
PROMPT_CLIENT = 400  # long_prompt's client number for these prompts: none of the long-prompt load's


async def _instances(client: httpx.AsyncClient, server: ServerProcess) -> dict[str, dict[str, Any]]:
    """Each instance's /stats by role (``prefill``, ``decode``)."""
    stats = (await client.get(server.base_url + "/stats", timeout=10)).json()
    return {i["role"]: (await client.get(i["url"] + "/stats", timeout=10)).json() for i in stats["instances"]}


def _segments(instances: dict[str, dict[str, Any]], name: str) -> dict[str, int]:
    return {role: (s.get("pool_segment") or {}).get(name, 0) for role, s in instances.items()}


def corrupt_files(directory: Path) -> int:
    """Flip one byte in the middle of every object file under ``directory``; how many."""
    n = 0
    for path in sorted(directory.rglob("*.kv")):
        with path.open("r+b") as f:
            middle = path.stat().st_size // 2
            f.seek(middle)
            byte = f.read(1)
            f.seek(middle)
            f.write(bytes([byte[0] ^ 0xFF]))
        n += 1
    return n


async def corrupt_ssd_object(run: Run) -> dict[str, Any]:
    cfg = run.cfg
    ssd_dir = cfg.log_path.parent / "ssd"
    shutil.rmtree(ssd_dir, ignore_errors=True)
    server = launch_server(["--dtype", "float32", "--prefill-instances", "1", "--decode-instances", "1",
                            "--pool-dram-gib", str(POOL_DRAM_GIB), "--pool-ssd-dir", str(ssd_dir),
                            "--pool-ssd-gib", str(SSD_GIB), "--kv-cache-gib", str(KV_CACHE_GIB)],
                           cfg.log_path.with_name("ssd-cluster.log"), name="SSD-tier cluster", python=cfg.python,
                           host=HOST, env={"OMP_NUM_THREADS": "1", SECRET_ENV: secrets.token_hex(16)})

    async def healthy() -> bool:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the SSD-tier cluster exited with {server.proc.returncode} (log: {server.log_path})")
        try:
            return (await run.client.get(server.base_url + "/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        if not await wait_until(healthy, cfg.health_timeout_s, interval_s=1.0):
            raise RuntimeError(f"the SSD-tier cluster was not healthy within {cfg.health_timeout_s:g} s "
                               f"(log: {server.log_path})")
        progress(f"SSD-tier cluster at {server.base_url}: a marker prompt, then fresh ones until it is on the SSD")
        marker = long_prompt(cfg.seed, PROMPT_CLIENT, 0, POOL_PROMPT_WORDS)
        first = await send_long(run, marker, "ssd-marker", base_url=server.base_url)
        if first.result != "completed":
            raise RuntimeError(f"the SSD-tier cluster did not answer the marker: {first.status} {first.error}")

        async def sealed() -> dict[str, dict[str, Any]] | None:
            inst = await _instances(run.client, server)
            stored = sum(_segments(inst, "objects").values()) and not sum(_segments(inst, "pending_puts").values())
            return inst if stored else None

        at_marker = await wait_until(sealed, 30.0, interval_s=0.2)
        if not at_marker:
            raise RuntimeError("the marker's objects were not stored in the pool within 30 s")
        held, demoted0 = _segments(at_marker, "objects"), _segments(at_marker, "demotions")
        cache_tokens = at_marker["prefill"]["num_blocks"] * at_marker["prefill"]["block_size"]
        tokens0 = at_marker["prefill"]["num_prompt_tokens_computed"]
        fillers, inst = 0, at_marker
        while not (all(_segments(inst, "demotions")[r] - demoted0[r] >= held[r] for r in held)
                   and inst["prefill"]["num_prompt_tokens_computed"] - tokens0 > cache_tokens):
            if fillers == MAX_FILLERS:
                raise RuntimeError(f"the marker was not pushed to the SSD by {MAX_FILLERS} prompts: {inst}")
            fillers += 1
            await send_long(run, long_prompt(cfg.seed, PROMPT_CLIENT, fillers, POOL_PROMPT_WORDS), f"ssd-{fillers}",
                            base_url=server.base_url)
            inst = await wait_until(sealed, 30.0, interval_s=0.2) or await _instances(run.client, server)
        corrupted = corrupt_files(ssd_dir)
        if not corrupted:
            raise RuntimeError(f"no object file on the SSD tiers under {ssd_dir}")
        reads0 = sum(_segments(inst, "corrupt_ssd_reads").values())
        again = await send_long(run, marker, "ssd-marker", base_url=server.base_url)
        reads = sum(_segments(await _instances(run.client, server), "corrupt_ssd_reads").values()) - reads0
    finally:
        await asyncio.to_thread(server.stop, 30.0)
        shutil.rmtree(ssd_dir, ignore_errors=True)
    out = {"fillers": fillers, "files_corrupted": corrupted, "status": again.status, "result": again.result,
           "same_text": again.text == first.text, "latency_s": round(again.latency_s, 2), "corrupt_ssd_reads": reads,
           "served_wrong": int(again.result != "completed" or again.text != first.text), "not_counted": int(reads == 0)}
    progress(f"corrupt SSD object: {corrupted} object files corrupted after {fillers} prompts; the marker again: "
             f"{again.status} {again.result}, same text: {out['same_text']}; corrupt SSD reads counted: {reads}")
    return out
