"""Summary statistics of a simulated run, as a JSON-ready dict."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from bench.sim.simulator import COMPLETED, REJECTED_AT_DECODE, REJECTED_ON_ARRIVAL, SimResult


def distribution(values: np.ndarray) -> dict[str, float]:
    v = values[~np.isnan(values)]
    if v.size == 0:
        return {"count": 0, "mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"count": int(v.size), "mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def effective(r: SimResult) -> np.ndarray:
    """Per request: completed with both SLOs met (FAST'25's effective requests)."""
    # A request without decode steps has no TBT and cannot break the TBT SLO.
    tbt_ok = np.isnan(r.tbt_s) | (r.tbt_s <= r.config.tbt_slo_s)
    return (r.status == COMPLETED) & (r.ttft_s <= r.config.ttft_slo_s) & tbt_ok


def summarize(r: SimResult) -> dict[str, Any]:
    cfg = r.config
    done = r.status == COMPLETED
    prefilled = ~np.isnan(r.ttft_s)
    effective_ = effective(r)
    span = float(np.nanmax(r.finish_s)) if done.any() else 0.0
    n = len(r.status)
    in_prefilled = r.input_length[prefilled].sum()
    return {
        "requests": n,
        "completed": int(done.sum()),
        "rejected": int((r.status != COMPLETED).sum()),
        "rejected_on_arrival": int((r.status == REJECTED_ON_ARRIVAL).sum()),
        "rejected_at_decode": int((r.status == REJECTED_AT_DECODE).sum()),
        "wasted_prefill_s": float(r.prefill_s[r.status == REJECTED_AT_DECODE].sum()),
        "ttft_s": distribution(np.where(done, r.ttft_s, np.nan)),
        "tbt_s": distribution(np.where(done, r.tbt_s, np.nan)),
        "slo_attainment": float(effective_.sum() / n),
        "goodput_req_per_s": float(effective_.sum() / span) if span else 0.0,
        "goodput_tokens_per_s": float(r.output_length[effective_].sum() / span) if span else 0.0,
        "prefix_hit_rate": float(r.prefix_tokens[prefilled].sum() / in_prefilled) if in_prefilled else 0.0,
        "pulled_token_share": float(r.pulled_tokens[prefilled].sum() / in_prefilled) if in_prefilled else 0.0,
        "pool_loaded_token_share": float(r.pool_tokens[prefilled].sum() / in_prefilled) if in_prefilled else 0.0,
        "pool_evictions": r.pool_evictions,
        "pool_blocks_held": r.pool_blocks_held,
        "prefill_s_per_request": float(r.prefill_s[prefilled].mean()) if prefilled.any() else 0.0,
        "local_prefill_share": float(r.local_prefill[prefilled].mean()) if prefilled.any() else 0.0,
        "hot_key_replicas_mean": float(np.mean(r.hot_key_replicas)) if r.hot_key_replicas else 0.0,
        "hot_key_replicas_last": float(r.hot_key_replicas[-1]) if r.hot_key_replicas else 0.0,
        "load": {"t": r.sample_t, "prefill": r.prefill_load, "decode": r.decode_load,
                 "prefill_instances": r.prefill_instances, "decode_instances": r.decode_instances},
        "switches": len(r.switches),
        "role_switches": r.switches,
        "replicas": {"t": r.replica_t, "hot_key_mean": r.hot_key_replicas},
        "makespan_s": span,
        "wall_s": r.wall_s,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("model", "hardware")},
    }
