"""Issue 42 item 5 in the simulator: the agentic trace generator and the session policies
(bench/sim/sessions.py) on a small trace."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim.sessions import (POLICIES, AgenticConfig, SessionSimConfig, agentic_trace, simulate_sessions,
                                turn_tokens)

SMALL = AgenticConfig(duration_s=120.0, session_rate=0.8, one_shot_rate=1.0)


def test_the_trace_is_repeatable_and_each_turn_resends_the_last():
    trace = agentic_trace(SMALL)
    assert trace == agentic_trace(SMALL) and trace != agentic_trace(replace(SMALL, seed=1))
    s = max(trace.sessions, key=lambda s: len(s.turns))
    lengths = [turn_tokens(s, k, SMALL.system_tokens) for k in range(len(s.turns))]
    for k in range(1, len(s.turns)):
        # The turn before, its answer, and what this turn appends.
        assert lengths[k] == lengths[k - 1] + s.turns[k - 1].output + s.turns[k].appended
    kinds = {t.kind for s in trace.sessions for t in s.turns[1:]}
    assert kinds == {"tool", "user"} and trace.one_shots


def test_under_one_shot_traffic_retention_beats_lru_and_belady_bounds_them_all():
    trace = agentic_trace(SMALL)
    config = SessionSimConfig()
    rows = {p.name: simulate_sessions(trace, p, config) for p in POLICIES}
    hit = {name: r.hit_tokens / r.prompt_tokens for name, r in rows.items()}
    lru, retained = hit["LRU, cache-aware routing (no hints)"], hit["retention, not sticky"]
    assert retained > lru
    assert hit["Belady's optimum, sticky (ceiling)"] >= max(hit.values()) - 1e-9
    assert hit["LRU, least-loaded routing, no pool (a plain balancer)"] < lru
    sticky = rows["sticky + retention (hints, shipped)"]
    assert sticky.kept > rows["retention, not sticky"].kept  # next turns kept where the last ran
    assert all(len(r.ttft_s) == len(sticky.ttft_s) for r in rows.values())  # every next turn served


def test_the_system_prompt_must_be_whole_blocks():
    with pytest.raises(ValueError):
        simulate_sessions(agentic_trace(replace(SMALL, system_tokens=1000)), POLICIES[0])
