"""bench.chaos: ten times the sustainable load for a minute, and whether every process's private
memory stays bounded (issue 40, item 5).

The steady stream and the long prompts are paused (``Run.paused_traffic``). Each process's
private memory (``RssAnon``: the Conductor's and every instance's) is read at rest. The bench then
measures what the cluster sustains: ``CLIENTS`` closed-loop clients send the short prompts
(sampled at temperature 0.8, ``MAX_TOKENS`` tokens each) for ``MEASURE_S`` s, and the requests
completed a second is the sustainable rate. Then it offers ten times that, Poisson arrivals, for
``overload_s`` s (60 in the full run), the same requests, while every process's ``RssAnon`` is
sampled every 0.25 s. A process whose peak rose more than ``BOUND_MIB`` above its rest is a row
that must be 0; every answer must be a 200 or a 429 with ``Retry-After``.

The issue measured the decode instance 580 MiB above its baseline in such a run; the sampler
held a few float32 copies of the whole batch's logits at once (``engine.sampler.ROWS_PER_PASS``
bounds them now).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any

from bench.chaos.cluster import conductor_stats
from bench.chaos.config import COMPLETIONS, PROMPTS, progress
from bench.chaos.load import proc_status
from bench.chaos.traffic import request_body

if TYPE_CHECKING:
    from bench.chaos.run import Run

CLIENTS = 8
MEASURE_S = 15.0
MAX_TOKENS = 32
LOAD_FACTOR = 10
BOUND_MIB = 300
SAMPLE_S = 0.25


def _anon_mib(pid: int) -> int | None:
    """``pid``'s RssAnon in MiB; None when it cannot be read (the process is gone)."""
    kib = proc_status(pid, ("RssAnon",)).get("RssAnon")
    return None if kib is None else kib // 1024


def _body(i: int) -> dict[str, Any]:
    completions = [k for k, (path, _) in enumerate(PROMPTS) if path == COMPLETIONS]
    return {**request_body(completions[i % len(completions)], False, MAX_TOKENS), "temperature": 0.8,
            "ignore_eos": True}


async def overload(run: Run) -> dict[str, Any]:
    cfg = run.cfg
    url = run.cluster.url + COMPLETIONS
    async with run.paused_traffic() as quiet:
        stats = quiet.get("stats") or await conductor_stats(run.client, run.cluster)
        if not stats:
            raise RuntimeError("the Conductor's /stats did not answer")
        pids = {"conductor": run.cluster.server.proc.pid,
                **{f"{i['role']} {i['url']}": i.get("pid") for i in stats["instances"] if i.get("pid")}}
        rest = {name: _anon_mib(pid) for name, pid in pids.items()}

        done = 0
        t0 = time.monotonic()

        async def closed_loop(k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() - t0 < MEASURE_S:
                r = await run.client.post(url, json=_body(i))
                done += r.status_code == 200
                i += CLIENTS

        await asyncio.gather(*(closed_loop(k) for k in range(CLIENTS)))
        rate = max(done / MEASURE_S, 0.1)
        offered = LOAD_FACTOR * rate
        progress(f"overload: the cluster sustains {rate:.2f} req/s; offering {offered:.1f} req/s for "
                 f"{cfg.overload_s:g} s")
        peak = dict(rest)
        statuses: dict[str, int] = {}
        no_retry_after = 0
        sampling = True

        async def sample() -> None:
            while sampling:
                for name, pid in pids.items():
                    now = _anon_mib(pid)
                    if now is not None and (peak[name] is None or now > peak[name]):
                        peak[name] = now
                await asyncio.sleep(SAMPLE_S)

        async def one(i: int) -> None:
            nonlocal no_retry_after
            try:
                r = await run.client.post(url, json=_body(i))
                key = str(r.status_code)
                no_retry_after += r.status_code in (429, 503) and "retry-after" not in r.headers
            except Exception as e:  # noqa: BLE001 -- counted: anything but an answer is a failure here
                key = type(e).__name__
            statuses[key] = statuses.get(key, 0) + 1

        sampler = asyncio.create_task(sample())
        rng = random.Random(0)
        tasks = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < cfg.overload_s:
            tasks.append(asyncio.create_task(one(len(tasks))))
            await asyncio.sleep(rng.expovariate(offered))
        await asyncio.gather(*tasks)
        sampling = False
        await sampler
        above = {name: peak[name] - rest[name] for name in pids if peak[name] is not None and rest[name] is not None}
        out = {"sustainable_rps": round(rate, 2), "offered_rps": round(offered, 1), "seconds": cfg.overload_s,
               "sent": len(tasks), "statuses": statuses, "rest_mib": rest, "peak_mib": peak, "above_rest_mib": above,
               "bound_mib": BOUND_MIB, "over_bound": sorted(n for n, a in above.items() if a > BOUND_MIB),
               "unclear_answers": sum(n for s, n in statuses.items() if s not in ("200", "429")) + no_retry_after}
        progress(f"overload: {statuses}; peak private memory above rest (MiB): {above}")
        return out
