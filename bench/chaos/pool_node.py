"""bench.chaos: a pool node of the bench's own, frozen (SIGSTOP) and then killed (issue 23 §8, issue 31).

A ``python -m cluster.pool`` node joins the cluster's pool (its metadata: the bench's etcd, or the
Conductor's embedded store). Before it starts, ``--frozen-prompts`` fresh long prompts are sent
at once: their times are the baseline, and their objects leave every instance's segment with
less free room than the new, empty node, which is therefore where the pool puts the next
objects. The node is SIGSTOPped as soon as it is ready, before any instance has talked to it, for
``--pool-stop-s``: once the Conductor lists it (and a second later every instance), as many
fresh long prompts again are sent at once (the store of each is planned on the frozen node
first, within the 5 s its metadata lease outlives it) and a short request must be served; then
SIGCONT and SIGKILL, and a request must be served again.

A pool call that the node does not answer may cost the prompt waiting on it the pool client's
call timeout (1 s), and the node is then passed over for a while: the instances count both
(``segment_timeouts``, ``segments_passed_over``). Must be 0: fresh prompts that took longer
while the node was frozen than the slowest one before plus that second and ``SLACK_S`` (a
connection to the frozen node that waits for its handshake, or a transfer timeout per prompt,
shows here), and a freeze that no pool call ran into (``segment_timeouts`` did not grow: the row
then measured nothing). With ``--frozen-prompts 0`` (``--quick``) only the short requests are
sent, which never reach the pool.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING, Any

from bench.chaos.cluster import conductor_stats, start_pool_node, wait_until
from bench.chaos.config import progress
from bench.chaos.faults import bounded_probe, signal_window
from bench.chaos.load import POOL_PROMPT_WORDS, long_prompt, send_long
from bench.chaos.traffic import Outcome

if TYPE_CHECKING:
    from bench.chaos.run import Run

CALL_TIMEOUT_S = 1.0  # the pool client's call_timeout_s: what one unanswered lease or alloc costs
# How much slower than the slowest baseline prompt a prompt may be, beyond the call timeout: the
# live traffic beside it varies what each prompt waits for on two cores.
SLACK_S = 2.0
SEGMENTS_TTL_S = 1.0  # how long an instance's pool client keeps its list of segments
COUNTERS = ("segment_timeouts", "segments_passed_over")
PROMPT_CLIENT = 200  # long_prompt's client number for these prompts: none of the long-prompt load's


async def _client_counters(run: Run) -> dict[str, int]:
    """``COUNTERS`` summed over the instances' pool clients (each instance's /stats)."""
    stats = (await run.held()).get("instance_stats", {})
    return {name: sum((s.get("pool_client") or {}).get(name, 0) for s in stats.values()) for name in COUNTERS}


async def _fresh_prompts(run: Run, first: int) -> list[Outcome]:
    """``frozen_prompts`` new long prompts at once (each stores its objects in the pool)."""
    return list(await asyncio.gather(*(
        send_long(run, long_prompt(run.cfg.seed, PROMPT_CLIENT, k, POOL_PROMPT_WORDS), f"frozen-{k}")
        for k in range(first, first + run.cfg.frozen_prompts))))


async def stop_pool_node(run: Run) -> None:
    cluster, cfg = run.cluster, run.cfg
    baseline = await _fresh_prompts(run, 0)
    before = await _client_counters(run) if cfg.frozen_prompts else {}
    meta = ["--etcd", cluster.etcd.url] if cluster.etcd is not None else ["--metadata", embedded_metadata_url(run)]
    proc, segment = await start_pool_node(meta, cluster.secret, cfg.log_path.parent / "pool-node.log")
    cluster.pool_node = proc
    fault: dict[str, Any] = {"kind": "SIGSTOP then kill -9", "role": "pool node", "old_pid": proc.pid,
                             "new_pid": None, "segment": segment, "stopped_s": cfg.pool_stop_s, "at_s": run._elapsed()}
    run.faults.append(fault)
    progress(f"pool node {segment} pid {proc.pid}: SIGSTOP as soon as it is ready, for {cfg.pool_stop_s:g} s"
             f"{f', {cfg.frozen_prompts} fresh long prompts meanwhile' if cfg.frozen_prompts else ''}")

    async def listed() -> bool:
        stats = await conductor_stats(run.client, cluster)
        return bool(stats) and segment in ((stats.get("pool") or {}).get("segments") or {})

    async def while_frozen() -> tuple[bool, list[Outcome], dict[str, Any]]:
        seen = bool(await wait_until(listed, 30.0, interval_s=0.2))
        if cfg.frozen_prompts:
            await asyncio.sleep(SEGMENTS_TTL_S)  # every instance's pool client has it on its list now
        frozen = await _fresh_prompts(run, cfg.frozen_prompts)
        return seen, frozen, await bounded_probe(run, cfg.pool_stop_s)

    t0 = time.monotonic()
    fault["listed"], frozen, during = await signal_window(proc, cfg.pool_stop_s, while_frozen())
    fault["frozen_for_s"] = round(time.monotonic() - t0, 1)
    proc.kill()
    proc.wait(10)
    after = await run.probe()
    fault.update(served_while_stopped=during["served"], served=after["served"], served_after_s=after["served_after_s"])
    fault["recovered"] = bool(during["served"] and after["served"])
    fault["summary"] = (f"listed while frozen: {fault['listed']}; served while stopped after {during['served_after_s']} "
                        f"s, after the kill {after['served_after_s']} s")
    if cfg.frozen_prompts:
        grown = {name: n - before[name] for name, n in (await _client_counters(run)).items()}
        base_s = [round(o.latency_s, 2) for o in baseline]
        frozen_s = [round(o.latency_s, 2) for o in frozen]
        bound = max(base_s) + CALL_TIMEOUT_S + SLACK_S
        fault["frozen_node"] = {
            "baseline_s": base_s, "frozen_s": frozen_s, "bound_s": round(bound, 2),
            "slowed": sum(s > bound for s in frozen_s), "not_completed": sum(o.result != "completed" for o in frozen),
            "node_never_asked": int(grown["segment_timeouts"] == 0), **grown}
        fault["summary"] += (f"; fresh long prompts {base_s} s before, {frozen_s} s while frozen (bound "
                             f"{bound:.1f} s); segment timeouts +{grown['segment_timeouts']}, segments passed "
                             f"over +{grown['segments_passed_over']}")
    progress(f"pool node: {fault['summary']}")


def embedded_metadata_url(run: Run) -> str:
    found = re.search(r"KVCache pool metadata at (\S+)", run.cluster.server.log())
    if not found:
        raise RuntimeError("the Conductor did not log its metadata server's address")
    return found.group(1)
