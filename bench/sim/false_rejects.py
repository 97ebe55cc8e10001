"""How often a rejecting policy is wrong (issue 41 item 3): of the requests it rejected, the share
that would have met both SLOs had it admitted them.

The simulator is deterministic, so it can say what would have happened: replay the same trace
with the policy overruled for one rejected request (``Simulator(admit=...)``), everything else as
before, and see whether that request completes within both SLOs. One replay per request; a
seeded sample of ``samples`` of the rejected ones keeps it to minutes. A replay stops at the
arrivals after the latest moment the request could finish within its SLOs (TTFT SLO plus its
decode steps at the TBT SLO each: a TBT over the worst 10% of gaps bounds their mean): what
arrives later cannot change whether it met them.

A deployment in the field rejected 8,270 requests while serving 3,125, and 979 of 1,000 of its
rejections could have been served (issue 41): this is the number that says so.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import numpy as np

from bench.sim.metrics import effective
from bench.sim.simulator import COMPLETED, SimResult, simulate
from bench.trace import TraceEntry


def false_rejects(result: SimResult, entries: Sequence[TraceEntry], samples: int = 20, seed: int = 0) -> dict[str, Any]:
    """Replay ``samples`` of ``result``'s rejected requests (at most; seeded) each admitted alone.
    ``entries``: the trace ``result`` ran (any order)."""
    cfg = result.config
    ordered = sorted(entries, key=lambda e: e.timestamp_ms)
    rejected = np.flatnonzero(result.status != COMPLETED)
    rng = np.random.default_rng([seed, 41])
    picked = sorted(rng.choice(rejected, size=min(samples, rejected.size), replace=False).tolist())
    arrivals = result.arrival_s.tolist()
    met = []
    for i in picked:
        latest = arrivals[i] + cfg.ttft_slo_s + max(int(result.output_length[i]) - 1, 0) * cfg.tbt_slo_s
        replay = simulate(cfg, ordered[: bisect.bisect_right(arrivals, latest)], admit=frozenset({i}))
        met.append(bool(effective(replay)[i]))
    return {"rejected": int(rejected.size), "sampled": len(picked), "would_have_met": int(sum(met)),
            "rate": sum(met) / len(met) if met else None, "requests": picked}
