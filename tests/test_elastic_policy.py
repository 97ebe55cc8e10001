"""The elastic-roles policy (issue 32) on hand-made views: whether, which, hysteresis, its invariants."""

import random
from dataclasses import replace

import pytest

from cluster.policies.cost_model import DecodeStepModel
from cluster.policies.early_rejection import SLO
from cluster.policies.elastic_roles import (
    ElasticConfig,
    ElasticRolePolicy,
    PredictionLog,
    Role,
    RoleView,
    TBTPrediction,
    TTFTPrediction,
)
from cluster.policies.prefix_index import LRUBlockCache
from cluster.policies.snapshot import DecodeInstanceState, PrefillInstanceState

# A step takes 10 ms + 1 ms per sequence: a batch of more than 90 breaks the 0.1 s TBT SLO.
STEP = DecodeStepModel(base_s=0.01, per_seq_s=0.001, per_context_token_s=0.0, kv_capacity_tokens=10**9)
SLO_ = SLO(ttft_s=30.0, tbt_s=0.1)
CONFIG = ElasticConfig(interval_s=30.0, horizon_s=100.0, min_dwell_s=100.0, margin=0.02, switch_cost_s=10.0,
                       decode_time_s=20.0)
POLICY = ElasticRolePolicy(CONFIG, SLO_, STEP)
NOW = 1000.0


def prefill(index, queue_s=0.0):
    return PrefillInstanceState(index=index, queue_s=queue_s, cache=LRUBlockCache(None))


def decode(index, joined=(), context=0):
    """A decode instance whose running requests joined at the times ``joined``."""
    return DecodeInstanceState(index=index, running_start_s=list(joined), running_prompt=[1] * len(joined),
                               context_tokens=context, incoming_ready_s=[], incoming_prompt=[])


def ttft(n, serving, queue_s=10.0, rest_s=1.0, instance=0):
    return [TTFTPrediction(instance, serving, queue_s, rest_s)] * n


def tbt(n, serving, batch):
    return [TBTPrediction(serving, batch, 0)] * n


def view(n_prefill=4, n_decode=4, ttft_=None, tbt_=None, **kw):
    """Prefill instances 0..n_prefill-1 (queues 4, 3, 2, 1 s...: the last is the shortest),
    decode instances after them, idle; by default 100 requests meeting both SLOs."""
    return RoleView(
        now=NOW,
        prefill=[prefill(i, float(n_prefill - i)) for i in range(n_prefill)],
        decode=[decode(n_prefill + i) for i in range(n_decode)],
        ttft=ttft(100, n_prefill) if ttft_ is None else ttft_,
        tbt=tbt(100, n_decode, 50) if tbt_ is None else tbt_,
        **kw,
    )


def test_a_balanced_cluster_stays_as_it_is():
    assert POLICY.decide(view()) is None
    assert POLICY.decide(view(ttft_=[])) is None  # nothing arrived: nothing to go by


def test_decode_overloaded_takes_the_least_loaded_prefill_instance():
    # Batches of 95 on 4 decode instances break the SLO; on 5 they are 76 and meet it. Prefill
    # with 3 instances still meets its SLO (10 s * 4/3 + 1 s).
    switch = POLICY.decide(view(tbt_=tbt(100, 4, 95)))
    assert switch.to_role is Role.DECODE
    assert switch.instance == 3  # the shortest queue, 1 s: the quickest to drain
    assert switch.transit_s == pytest.approx(1.0 + CONFIG.switch_cost_s)
    # All 100 saved over the horizon less the transit; no prefill request lost.
    assert switch.gain == pytest.approx(1.0 - 11.0 / 100.0)


def test_a_prefill_instance_whose_cache_serves_the_pool_is_kept():
    # Instance 3 has the shortest queue, but its own cache saved 5 s of prefill this horizon.
    cached = [TTFTPrediction(3, 4, 10.0, 1.0, cached_s=0.05)] * 100
    switch = POLICY.decide(view(ttft_=cached, tbt_=tbt(100, 4, 95)))
    assert switch.instance == 2


def test_prefill_overloaded_takes_the_decode_instance_that_drains_first():
    # Half the requests wait 25 s: they break the SLO on 4 instances (25 s + 6 s), meet it on 5
    # (20 s + 6 s). Decode then gets twice the requests: batches of 20 on 4 instances become
    # 20 * 4/3 * 2 = 53 on 3, still within the SLO.
    ttft_ = ttft(50, 4, queue_s=5.0) + ttft(50, 4, queue_s=25.0, rest_s=6.0)
    v = view(ttft_=ttft_, tbt_=tbt(50, 4, 20))
    v = replace(v, decode=[decode(4, [NOW - 1]), decode(5, [NOW - 15]), decode(6, [NOW - 15], 9), decode(7, [NOW - 2])])
    switch = POLICY.decide(v)
    assert switch.to_role is Role.PREFILL
    # 5 and 6 drain in 5 s (20 s of decode from 15 s ago); 5 holds less KV.
    assert switch.instance == 5
    assert switch.transit_s == pytest.approx(5.0 + CONFIG.switch_cost_s)
    assert switch.gain == pytest.approx(0.5 * (1 - 15.0 / 100.0))


def test_more_prefill_sends_decode_more_requests():
    # Prefill misses 40 of 100 requests and would take all of them with one more instance; a
    # decode instance less alone would leave batches of 60 * 4/3 = 80 (within the SLO), but the
    # 40 admitted on top make them 80 * 100/60 = 133: a decode instance cannot be spared.
    ttft_ = ttft(60, 4, queue_s=5.0) + ttft(40, 4, queue_s=25.0, rest_s=6.0)
    v = view(ttft_=ttft_, tbt_=tbt(60, 4, 60))
    assert POLICY.decide(v) is None


def test_the_margin_is_a_dead_band():
    # 1 request in 100 missing its TBT saves at most 1%: under the 2% margin.
    assert POLICY.decide(view(tbt_=tbt(99, 4, 50) + tbt(1, 4, 95))) is None
    assert POLICY.decide(view(tbt_=tbt(95, 4, 50) + tbt(5, 4, 95))).to_role is Role.DECODE


def test_the_switch_is_not_undone_on_the_same_predictions():
    v = view(tbt_=tbt(100, 4, 95))
    switch = POLICY.decide(v)
    # The next decision: the instance has moved; the predictions still say who served them.
    after = RoleView(
        now=NOW + CONFIG.interval_s,
        prefill=[s for s in v.prefill if s.index != switch.instance],
        decode=[*v.decode, decode(switch.instance)],
        ttft=v.ttft,
        tbt=v.tbt,
        changed_at={switch.instance: NOW},
    )
    assert POLICY.decide(after) is None


def test_a_switch_that_cannot_pay_back_within_the_horizon_is_not_made():
    costly = ElasticRolePolicy(replace(CONFIG, switch_cost_s=CONFIG.horizon_s), SLO_, STEP)
    assert costly.decide(view(tbt_=tbt(100, 4, 95))) is None


def test_never_leaves_a_role_empty():
    # Decode is overloaded at any split; the last prefill instance stays.
    v = view(n_prefill=1, n_decode=3, ttft_=ttft(100, 1, queue_s=1.0), tbt_=tbt(100, 3, 200))
    assert POLICY.decide(v) is None
    two = ElasticRolePolicy(replace(CONFIG, min_per_role=2), SLO_, STEP)
    assert two.decide(view(n_prefill=2, ttft_=ttft(100, 2, queue_s=1.0), tbt_=tbt(100, 4, 95))) is None
    assert POLICY.decide(view(n_prefill=2, ttft_=ttft(100, 2, queue_s=1.0), tbt_=tbt(100, 4, 95))) is not None


def test_one_switch_in_flight_and_no_giving_back_within_a_dwell():
    overloaded = view(tbt_=tbt(100, 4, 95))
    assert POLICY.decide(replace(overloaded, switching=True)) is None
    # Prefill took instance 0 50 s ago (the dwell is 100 s): it gives none back yet...
    assert POLICY.decide(replace(overloaded, changed_at={0: NOW - 50})) is None
    assert POLICY.decide(replace(overloaded, changed_at={0: NOW - 100})).instance == 3
    # ...but decode, which took one, may take another.
    assert POLICY.decide(replace(overloaded, changed_at={4: NOW - 50})).instance == 3


def test_config_is_validated():
    for bad in (dict(interval_s=0), dict(horizon_s=-1), dict(margin=-0.1), dict(min_per_role=0)):
        with pytest.raises(ValueError):
            ElasticConfig(**bad)


def test_the_log_keeps_one_horizon():
    log = PredictionLog(horizon_s=60.0)
    for t in range(0, 100, 10):
        log.add_ttft(float(t), TTFTPrediction(0, 1, float(t), 0.0))
        log.add_tbt(float(t), TBTPrediction(1, t, 0))
    ttft_, tbt_ = log.window(100.0)
    assert [p.queue_s for p in ttft_] == [50.0, 60.0, 70.0, 80.0, 90.0]
    assert [p.batch for p in tbt_] == [50, 60, 70, 80, 90]


def toy_window(rng, n_prefill, n_decode, queued_s, batched, noise):
    """One interval of a toy cluster of 8: 200 requests, whose waits are ``queued_s`` of prefill
    spread over the prefill instances and whose decode batches ``batched`` sequences (as many
    as prefill admits) over the decode ones, each times 1 +- ``noise``; the rest of a TTFT is 2 s."""
    ttft_ = [TTFTPrediction(0, n_prefill, queued_s / n_prefill * rng.uniform(1 - noise, 1 + noise), 2.0)
             for _ in range(200)]
    admitted = sum(p.queue_s + p.rest_s <= SLO_.ttft_s for p in ttft_) / len(ttft_)
    tbt_ = [TBTPrediction(n_decode, round(batched * admitted / n_decode * rng.uniform(1 - noise, 1 + noise)), 0)
            for _ in range(200)]
    return ttft_, tbt_


CLEAR = (130.0, 250, 0.5)  # 5 prefill + 3 decode miss least, well ahead of 4 + 4
CLOSE = (120.0, 300, 0.6)  # 4 + 4 and 5 + 3 miss about as many


def toy_misses(n_prefill, toy):
    """The toy's share of requests missing an SLO with a fixed split."""
    ttft_, tbt_ = toy_window(random.Random(1), n_prefill, 8 - n_prefill, *toy)
    return (POLICY.ttft_misses(ttft_, n_prefill) + POLICY.tbt_misses(tbt_, 8 - n_prefill)) / 200


def run_loop(policy, toy, ticks=60, seed=0):
    """The toy in a closed loop from 4 + 4, switches taking effect at once; returns the number
    of prefill instances after each decision."""
    rng = random.Random(seed)
    roles = {i: Role.PREFILL if i < 4 else Role.DECODE for i in range(8)}
    changed: dict[int, float] = {i: 0.0 for i in range(8)}
    counts = []
    for k in range(1, ticks + 1):
        now = k * policy.config.interval_s
        p = [i for i in roles if roles[i] is Role.PREFILL]
        d = [i for i in roles if roles[i] is Role.DECODE]
        ttft_, tbt_ = toy_window(rng, len(p), len(d), *toy)
        v = RoleView(now=now, prefill=[prefill(i) for i in p], decode=[decode(i) for i in d], ttft=ttft_, tbt=tbt_,
                     changed_at=changed)
        switch = policy.decide(v)
        if switch is not None:
            roles[switch.instance] = switch.to_role
            changed[switch.instance] = now
        counts.append(sum(r is Role.PREFILL for r in roles.values()))
    return counts


def test_roles_settle_on_the_best_split():
    best = min(range(1, 8), key=lambda n: toy_misses(n, CLEAR))
    assert best == 5
    for seed in range(3):
        counts = run_loop(POLICY, CLEAR, seed=seed)
        assert counts[-1] == best and counts.index(best) < 10
        assert counts[counts.index(best):] == [best] * (len(counts) - counts.index(best))


def reversal_gaps(counts):
    """Decisions between a move and the next one in the other direction."""
    moves = [(k, b - a) for k, (a, b) in enumerate(zip(counts, counts[1:])) if b != a]
    return [k2 - k1 for (k1, d1), (k2, d2) in zip(moves, moves[1:]) if d1 != d2]


def test_no_flapping_around_a_balanced_split():
    assert abs(toy_misses(4, CLOSE) - toy_misses(5, CLOSE)) < 0.02
    dwell = CONFIG.min_dwell_s / CONFIG.interval_s
    eager = ElasticRolePolicy(replace(CONFIG, margin=0.0, min_dwell_s=0.0), SLO_, STEP)
    for seed in range(3):
        # The noise moves an instance back and forth at once without the dwell; with it, a move
        # back waits a dwell at least.
        assert min(reversal_gaps(run_loop(eager, CLOSE, seed=seed))) == 1
        assert all(gap >= dwell for gap in reversal_gaps(run_loop(POLICY, CLOSE, seed=seed)))


def test_an_empty_role_is_refilled_first_whatever_the_dwell_and_the_arrivals():
    """Issue 41: a role left with no instance (its last one died, or two deciders emptied it)
    takes the other role's least loaded one at the next decision, with nothing arrived and every
    instance inside its dwell; a role that has only its minimum gives none."""
    settled = {i: NOW for i in range(8)}  # every instance took its role just now
    to_decode = POLICY.decide(view(3, 0, ttft_=[], tbt_=[], changed_at=settled))
    assert to_decode.to_role is Role.DECODE and to_decode.instance == 2  # the shortest queue (1 s)
    busy = [decode(3, joined=[NOW - 1.0]), decode(4, joined=[NOW - 15.0])]  # drained in 19 s and 5 s
    v = RoleView(now=NOW, prefill=[], decode=busy, ttft=[], tbt=[], changed_at=settled)
    to_prefill = POLICY.decide(v)
    assert to_prefill.to_role is Role.PREFILL and to_prefill.instance == 4
    assert to_prefill.transit_s == pytest.approx(5.0 + CONFIG.switch_cost_s)
    assert POLICY.decide(view(1, 0, ttft_=[], tbt_=[])) is None  # one prefill instance: its minimum
    assert POLICY.decide(view(3, 0, ttft_=[], tbt_=[], switching=True)) is None  # one switch at a time
    two = ElasticRolePolicy(replace(CONFIG, min_per_role=2), SLO_, STEP)
    assert two.decide(view(3, 1, ttft_=[], tbt_=[])).to_role is Role.DECODE  # prefill keeps its 2
    assert two.decide(view(2, 1, ttft_=[], tbt_=[])) is None  # prefill has only its minimum
