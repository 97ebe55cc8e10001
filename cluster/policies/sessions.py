"""Sticky placement for sessions: pure code, called by the Conductor and the simulator.

A session's next turn resends its last turn's prompt and output plus a little, and that KV is
where the last turn ran: in the prefix cache of its prefill (or colocated) instance, retained
there (``paged_kv.block_pool.Retention``), in its decode instance's cache, and in the pool. The
scheduler (Algorithm 1) already weighs what each instance holds against its queue; stickiness
adds a preference on top: the session's instance is kept unless its predicted TTFT (or, for the
decode instance, TBT) misses the SLO, the *load term*. Then the scheduler's choice stands, and
the request's prefix moves with it the cheapest way its cost model finds (loaded from the pool,
pulled from the holder, or recomputed: ``scheduling.GlobalCacheAwareScheduler``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.policies.scheduling import PrefillPlan


@dataclass(frozen=True)
class Affinity:
    """Where a session's last turn ran, as indices into this placement's instance lists (None:
    not among them: no last turn, or that instance is down)."""

    prefill: int | None = None
    decode: int | None = None


def sticky_prefill(best: PrefillPlan, sticky: PrefillPlan | None, slo_ttft_s: float | None,
                   slack_s: float = math.inf) -> PrefillPlan:
    """The session's plan unless its TTFT misses ``slo_ttft_s`` (None: no SLO known) or is more
    than ``slack_s`` longer than the scheduler's ``best``; else ``best``."""
    if sticky is None:
        return best
    limit = best.ttft_s + slack_s
    if slo_ttft_s is not None:
        limit = min(limit, max(slo_ttft_s, best.ttft_s))
    return sticky if sticky.ttft_s <= limit else best


def sticky_decode(order: Sequence[int], sticky: int | None, tbt_with: Callable[[int], float],
                  slo_tbt_s: float | None) -> list[int]:
    """``order`` (decode instances, most preferred first) with the session's instance first
    when its TBT with the request stays within ``slo_tbt_s``: its cache holds the session's KV,
    so less of it is sent."""
    order = list(order)
    if sticky is None or sticky not in order or slo_tbt_s is None or tbt_with(sticky) > slo_tbt_s:
        return order
    order.remove(sticky)
    return [sticky, *order]


def prestage_delay(thinks: Sequence[float], lead: float = 0.5) -> float | None:
    """How long after a session's turn ends to pre-stage its KV for the next one:
    ``lead`` of its shortest recent think time, when the think so far is still below
    every recent one and its next turn likely near; None before it has thought once."""
    if not thinks:
        return None
    return lead * min(thinks)
