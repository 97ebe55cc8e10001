"""bench.chaos: a mass client disconnect, and whether what the clients held comes back (issue 31).

The steady stream and the long prompts are paused (``Run.paused_traffic``) until the cluster
holds nothing. Then ``disconnect_streams`` clients stream short prompts with room for
``STREAM_TOKENS`` tokens and stop reading after 1 to 8 events each (mid-decode), and
``disconnect_prompts`` clients send prompts of ``disconnect_words`` words (a few thousand
tokens) and get no token yet; once the Conductor is prefilling them, every one of these clients
drops its connection at the same moment. What was held before (the instances' blocks in use,
reservations, running and waiting requests and staging ranges, the Conductor's books about each
instance) must be back within ``WITHIN_S``; and from the moment it is, no prompt token may be
computed anywhere for ``WATCH_S`` (an abandoned prefill that goes on computing shows here: the
issue measured 6,680 tokens in the minute after the clients had gone, and 31 s until blocks and
reservations were free).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import httpx

from bench.chaos.cluster import wait_until
from bench.chaos.config import COMPLETIONS, progress
from bench.chaos.load import long_prompt
from bench.chaos.traffic import request_body

if TYPE_CHECKING:
    from bench.chaos.run import Run

STREAM_TOKENS = 256  # far more than a stream reads before it drops: it is decoding when it goes
WITHIN_S = 5.0
WATCH_S = 10.0
PROMPT_CLIENT = 300  # long_prompt's client number for the abandoned prompts: none of the load's


def _above(now: dict[str, dict[str, int]], baseline: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The held figures of ``now`` above their ``baseline`` (what the clients left behind)."""
    out = {}
    for url, per in now.items():
        if extra := {k: v - baseline.get(url, {}).get(k, 0) for k, v in per.items()
                     if v > baseline.get(url, {}).get(k, 0)}:
            out[url] = extra
    return out


def _prompt_tokens(held: dict[str, Any]) -> int:
    return sum(s.get("num_prompt_tokens_computed", 0) for s in held.get("instance_stats", {}).values())


async def _client(http: httpx.AsyncClient, url: str, body: dict[str, Any], events: int | None,
                  ready: asyncio.Event, seen: list[int], i: int) -> None:
    """Stream ``body`` and count its events in ``seen[i]``; after ``events`` of them (None: never)
    set ``ready`` and read no more, holding the connection until the task is cancelled."""
    try:
        async with http.stream("POST", url + COMPLETIONS, json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    seen[i] += 1
                    if seen[i] == events:
                        ready.set()
                        await asyncio.get_running_loop().create_future()  # never done: dropped by cancel()
    finally:
        ready.set()


async def mass_disconnect(run: Run) -> dict[str, Any]:
    cfg = run.cfg
    n_streams, n_prompts = cfg.disconnect_streams, cfg.disconnect_prompts
    async with run.paused_traffic() as quiet:
        if "stats" not in quiet:
            raise RuntimeError("the Conductor's /stats did not answer")
        baseline = quiet["held"]
        seen = [0] * (n_streams + n_prompts)
        ready = [asyncio.Event() for _ in range(n_streams)]
        limits = httpx.Limits(max_connections=len(seen) + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.deadline_s, connect=10)) as http:
            # Completions prompts (the first four) with room for many tokens, each dropped after 1-8.
            streams = [asyncio.create_task(_client(http, run.cluster.url, request_body(i % 4, True, STREAM_TOKENS),
                                                   1 + i % 8, ready[i], seen, i)) for i in range(n_streams)]
            await wait_until(lambda: _all_set(ready), cfg.deadline_s, interval_s=0.1)
            prompts = [asyncio.create_task(_client(
                http, run.cluster.url, {"prompt": long_prompt(cfg.seed, PROMPT_CLIENT, k, cfg.disconnect_words),
                                        "max_tokens": 16, "temperature": 0, "stream": True},
                None, asyncio.Event(), seen, n_streams + k)) for k in range(n_prompts)]

            at_leave: dict[str, Any] = {}

            async def prefilling() -> bool:
                nonlocal at_leave
                at_leave = await run.held()
                return sum(i.get("prefilling", 0) for i in (at_leave.get("stats") or {}).get("instances", [])) > 0

            await wait_until(prefilling, 30.0, interval_s=0.1)
            finished = sum(t.done() for t in streams)  # ended by themselves: not dropped mid-decode
            progress(f"mass disconnect: {n_streams} streams got {sum(seen[:n_streams])} events ({finished} ended by "
                     f"themselves), {n_prompts} prompts of {cfg.disconnect_words} words being prefilled; all drop now")
            for task in (*streams, *prompts):
                task.cancel()
            left = time.monotonic()
            await asyncio.gather(*streams, *prompts, return_exceptions=True)
        # Every connection is closed once the client is (its pool holds none for keep-alive).
        last: dict[str, Any] = {}
        held_at_within: dict[str, dict[str, int]] | None = None

        async def back() -> bool:
            nonlocal last, held_at_within
            last = await run.held()
            leftover = _above(last.get("held", {}), baseline) if "stats" in last else {"conductor": {"no answer": 1}}
            if held_at_within is None and time.monotonic() - left >= WITHIN_S:
                held_at_within = leftover
            return not leftover

        released = await wait_until(back, cfg.drain_s, interval_s=0.1)
        released_s = round(time.monotonic() - left, 2) if released else None
        tokens_at_release = _prompt_tokens(last)
        await asyncio.sleep(WATCH_S)
        tokens_after = _prompt_tokens(await run.held()) - tokens_at_release
    out = {"streams": n_streams, "stream_events": seen[:n_streams],
           "streams_dropped_mid_decode": n_streams - finished,
           "prompts": n_prompts, "prompts_abandoned_before_first_token": sum(s == 0 for s in seen[n_streams:]),
           "baseline_held": baseline, "released_s": released_s,
           "held_after_within": sum(v for per in (held_at_within or {}).values() for v in per.values()),
           "held_after_within_detail": held_at_within or {},
           "prompt_tokens_left_to_release": tokens_at_release - _prompt_tokens(at_leave),
           "prompt_tokens_after_release": tokens_after, "watched_s": WATCH_S}
    progress(f"mass disconnect: everything back {released_s} s after the clients left (held after {WITHIN_S:g} s: "
             f"{out['held_after_within_detail']}); prompt tokens computed until then "
             f"{out['prompt_tokens_left_to_release']}, in the {WATCH_S:g} s after: {tokens_after}")
    return out


async def _all_set(events: list[asyncio.Event]) -> bool:
    return all(e.is_set() for e in events)
