"""Conductor policies on hand-made cluster states with answers worked out by hand."""

import math

import pytest

from bench.sim.baselines import LateBindingRejection, PerStageRejection
from cluster.policies.early_rejection import SLO, AcceptAll, EarlyRejection, PredictiveEarlyRejection
from cluster.policies.cost_model import (
    A800_X8,
    LLAMA3_70B,
    DecodeStepModel,
    HardwareSpec,
    ModelSpec,
    PrefillCostModel,
    TransferModel,
)
from cluster.policies.local_prefill import LocalPrefill
from cluster.policies.snapshot import DecodeInstanceState, PrefillInstanceState, RequestInfo
from cluster.policies.prefix_index import LRUBlockCache, prefix_tokens
from cluster.policies.scheduling import (
    DecodeLoadBalancer,
    DecodePlan,
    GlobalCacheAwareScheduler,
    LoadBalancingScheduler,
    LocalCacheAwareScheduler,
    PrefillEstimator,
    PrefillPlan,
    RandomScheduler,
)

BS = 512
# 1 s per uncached token keeps the arithmetic readable; 1 token of KV moves in 0.1 s.
COST = PrefillCostModel(c_uu=0.0, c_up=0.0, c_u=1.0)
TRANSFER = TransferModel(bytes_per_s=10.0, kv_bytes_per_token=1)
EST = PrefillEstimator(COST, TRANSFER, block_size=BS)
STEP = DecodeStepModel(base_s=0.01, per_seq_s=0.01, per_context_token_s=0.0, kv_capacity_tokens=10**6)
SLO_ = SLO(ttft_s=30.0, tbt_s=0.1)


def cache_with(*prompts):
    c = LRUBlockCache(None)
    for keys in prompts:
        c.insert(keys)
    return c


def request(keys, n=None, rid=0):
    return RequestInfo(request_id=rid, input_length=n if n is not None else len(keys) * BS, block_keys=keys)


def decode_state(index, batch, starts=None, incoming=()):
    starts = list(starts) if starts is not None else [0.0] * batch
    return DecodeInstanceState(
        index=index,
        running_start_s=starts,
        running_prompt=[0] * len(starts),
        context_tokens=0,
        incoming_ready_s=[t for t, _ in incoming],
        incoming_prompt=[p for _, p in incoming],
    )


# --- prefix index ---------------------------------------------------------------------------


def test_match_stops_at_first_missing_key():
    c = cache_with([1, 2, 3])
    assert c.match_len([1, 2, 3, 4]) == 3
    assert c.match_len([1, 9, 3]) == 1  # key 3 is cached, but its chain is broken at 9
    assert c.match_len([9, 1, 2]) == 0


def test_lru_evicts_chain_tails_before_heads():
    c = LRUBlockCache(capacity_blocks=4)
    c.insert([1, 2, 3])
    c.insert([1, 4, 5])  # 5 blocks wanted, 4 fit: the oldest tail (3) goes, the shared head stays
    assert 3 not in c and all(k in c for k in (1, 2, 4, 5))
    assert c.evictions == 1 and len(c) == 4


def test_prefix_tokens_caps_partial_last_block():
    assert prefix_tokens(3, input_length=1200, block_size=BS) == 1200
    assert prefix_tokens(2, input_length=1200, block_size=BS) == 1024


# --- cost models ----------------------------------------------------------------------------


def test_flop_model_matches_eq1():
    hw = HardwareSpec(peak_flops=1e15, hbm_bytes_per_s=1e12, hbm_bytes=1e12, nic_bytes_per_s=1e9, prefill_mfu=0.5)
    m = PrefillCostModel.from_flops(LLAMA3_70B, hw)
    n, p = 8192, 2048
    expected = (LLAMA3_70B.prefill_flops(n) - LLAMA3_70B.prefill_flops(p)) / 0.5e15
    assert m.seconds(n, p) == pytest.approx(expected, rel=1e-12)
    assert m.seconds(n, n) == 0.0


def test_kv_bytes_per_token_is_320_kib_for_llama3_70b():
    assert LLAMA3_70B.kv_bytes_per_token == 320 * 1024
    assert TransferModel.from_specs(LLAMA3_70B, A800_X8).seconds(128_000) == pytest.approx(0.419, abs=1e-3)


def test_polynomial_fit_recovers_coefficients():
    true = PrefillCostModel(c_uu=2e-9, c_up=4e-9, c_u=1e-4, c_0=0.05)
    ns = [512, 1024, 4096, 16384, 65536, 131072] * 3
    ps = [0] * 6 + [n // 2 for n in ns[:6]] + [n * 9 // 10 for n in ns[:6]]
    fit = PrefillCostModel.fit(ns, ps, [true.seconds(n, p) for n, p in zip(ns, ps)])
    for n, p in [(3000, 0), (50000, 40000), (128000, 1000)]:
        assert fit.seconds(n, p) == pytest.approx(true.seconds(n, p), rel=1e-6)


def test_a_fit_never_makes_a_longer_cached_prefix_slower():
    """Calibration samples of a 2-thread CPU, with the noise of a busy machine: fitted with a free
    prefix coefficient they gave c_up = 3 c_uu, and a prompt of 2,846 tokens looked faster with
    16 cached tokens than with 144 (test_cluster's hot-prefix scenario then went astray)."""
    true = PrefillCostModel(c_uu=2.4e-6, c_up=4.8e-6, c_u=3.3e-3, c_0=0.19)
    ns = [64, 128, 256, 512, 1024] * 2
    ps = [0] * 5 + [n // 2 for n in ns[:5]]
    noise = [1.0, 1.1, 0.93, 1.05, 0.97, 1.12, 0.9, 1.08, 1.15, 0.95]
    fit = PrefillCostModel.fit(ns, ps, [true.seconds(n, p) * e for n, p, e in zip(ns, ps, noise)])
    assert fit.c_up == pytest.approx(2 * fit.c_uu)
    for n in (300, 1000, 2846, 8000):
        times = [fit.seconds(n, p) for p in range(0, n, max(1, n // 50))]
        assert times == sorted(times, reverse=True), n


def test_configs_reject_nonsense():
    with pytest.raises(ValueError):
        ModelSpec(layers=0, hidden=1, a=1, b=1, gqa=1, elem_bytes=2, params=1)
    with pytest.raises(ValueError):
        HardwareSpec(peak_flops=1, hbm_bytes_per_s=1, hbm_bytes=1, nic_bytes_per_s=1, prefill_mfu=1.5)
    with pytest.raises(ValueError):
        SLO(0, 1)
    with pytest.raises(ValueError):
        GlobalCacheAwareScheduler(EST, kvcache_balancing_threshold=0.5)
    with pytest.raises(ValueError):
        PrefillInstanceState(index=0, queue_s=-1.0, cache=LRUBlockCache(None))


# --- prefill schedulers ---------------------------------------------------------------------


def test_all_requests_share_a_prefix_local_cache_aware_hits_it():
    # Instance 1 holds the shared 3-block prefix; the request adds one block of its own.
    insts = [
        PrefillInstanceState(0, 0.0, cache_with([7, 8])),
        PrefillInstanceState(1, 0.0, cache_with([1, 2, 3, 100])),
    ]
    plan = LocalCacheAwareScheduler(EST).select(request([1, 2, 3, 200]), insts)
    assert plan.instance == 1 and plan.prefix_tokens == 3 * BS and plan.source is None
    assert plan.ttft_s == pytest.approx(BS)  # one uncached block at 1 s per token


def test_load_balancing_ignores_cache_and_takes_shortest_queue():
    insts = [
        PrefillInstanceState(0, 5.0, cache_with([1, 2, 3])),
        PrefillInstanceState(1, 1.0, cache_with([])),
    ]
    plan = LoadBalancingScheduler(EST).select(request([1, 2, 3, 4]), insts)
    assert plan.instance == 1 and plan.prefix_tokens == 0
    assert plan.ttft_s == pytest.approx(1.0 + 4 * BS)


def test_global_scheduler_avoids_overloaded_holder_and_pulls_its_prefix():
    # Instance 0 holds 3 of 4 blocks but is busy for 10,000 s; instance 1 is idle and empty.
    insts = [
        PrefillInstanceState(0, 10_000.0, cache_with([1, 2, 3])),
        PrefillInstanceState(1, 0.0, cache_with([])),
    ]
    plan = GlobalCacheAwareScheduler(EST, kvcache_balancing_threshold=2.0).select(request([1, 2, 3, 4]), insts)
    assert (plan.instance, plan.source) == (1, 0)
    assert plan.prefix_tokens == 3 * BS and plan.local_prefix_tokens == 0
    assert plan.transfer_s == pytest.approx(3 * BS * 0.1)
    assert plan.ttft_s == pytest.approx(3 * BS * 0.1 + BS)


@pytest.mark.parametrize("threshold, pulls", [(1.2, True), (2.0, False)])
def test_balancing_threshold_decides_the_copy(threshold, pulls):
    # Instance 1 holds 4 blocks, instance 0 holds 6: ratio 1.5. Instance 0 is busy so the
    # choice is instance 1, which pulls blocks 5-6 only if 1.5 > threshold.
    keys = [1, 2, 3, 4, 5, 6, 7, 8]
    insts = [
        PrefillInstanceState(0, 50_000.0, cache_with(keys[:6])),
        PrefillInstanceState(1, 0.0, cache_with(keys[:4])),
    ]
    plan = GlobalCacheAwareScheduler(EST, threshold).select(request(keys), insts)
    assert plan.instance == 1
    if pulls:
        assert plan.source == 0 and plan.prefix_tokens == 6 * BS and plan.transfer_tokens == 2 * BS
    else:
        assert plan.source is None and plan.prefix_tokens == 4 * BS and plan.transfer_s == 0.0


def test_global_scheduler_loads_the_pool_prefix_before_pulling_an_equal_one():
    # Instance 0 holds 3 blocks but is busy; the pool holds the same 3: instance 1 loads them
    # from the pool (no pull from instance 0), paying the same transfer time.
    insts = [
        PrefillInstanceState(0, 10_000.0, cache_with([1, 2, 3])),
        PrefillInstanceState(1, 0.0, cache_with([])),
    ]
    req = RequestInfo(0, 4 * BS, [1, 2, 3, 4], pool_blocks=3)
    plan = GlobalCacheAwareScheduler(EST, kvcache_balancing_threshold=2.0).select(req, insts)
    assert (plan.instance, plan.source, plan.from_pool) == (1, None, True)
    assert plan.prefix_tokens == 3 * BS and plan.transfer_s == pytest.approx(3 * BS * 0.1)


def test_with_a_pool_instances_never_pull_from_each_other():
    insts = [
        PrefillInstanceState(0, 10_000.0, cache_with([1, 2, 3])),
        PrefillInstanceState(1, 0.0, cache_with([])),
    ]
    scheduler = GlobalCacheAwareScheduler(EST, 2.0, pull_from_instances=False)
    plan = scheduler.select(request([1, 2, 3, 4]), insts)  # the pool does not hold it
    assert (plan.instance, plan.source, plan.from_pool, plan.prefix_tokens) == (1, None, False, 0)


def test_pool_prefix_is_not_loaded_when_the_instance_holds_as_much():
    insts = [PrefillInstanceState(0, 0.0, cache_with([1, 2, 3]))]
    req = RequestInfo(0, 4 * BS, [1, 2, 3, 4], pool_blocks=2)
    plan = GlobalCacheAwareScheduler(EST, 2.0).select(req, insts)
    assert (plan.from_pool, plan.prefix_tokens, plan.transfer_s) == (False, 3 * BS, 0.0)


def test_pool_blocks_must_fit_the_prompt():
    with pytest.raises(ValueError):
        RequestInfo(0, 2 * BS, [1, 2], pool_blocks=3)


def test_random_scheduler_is_deterministic_for_a_seed():
    insts = [PrefillInstanceState(i, 0.0, cache_with([])) for i in range(8)]

    def picks(seed):
        sched = RandomScheduler(EST, seed)
        return [sched.select(request([i]), insts).instance for i in range(20)]

    assert picks(3) == picks(3)
    assert len(set(picks(3))) > 1


def test_decode_balancer_counts_routed_requests():
    # Instance 0 runs 2 sequences; instance 1 runs 1 but has 3 more on their way.
    states = [decode_state(0, 2), decode_state(1, 1, incoming=[(5.0, 0)] * 3)]
    plan = DecodeLoadBalancer(STEP).select(request([1], n=1), states)
    assert plan.instance == 0
    assert plan.predicted_tbt_s == pytest.approx(0.01 + 0.01 * 3 + 1 * 0.0)


# --- admission ------------------------------------------------------------------------------


def prefill_plan(ttft_s):
    return PrefillPlan(instance=0, prefix_tokens=0, local_prefix_tokens=0, source=None, queue_s=ttft_s,
                       transfer_s=0.0, prefill_s=0.0)


def test_per_stage_rejects_only_on_ttft_at_arrival_and_decode_checks_itself():
    pol = PerStageRejection(SLO_, STEP)
    full = [decode_state(0, 9)]  # 0.01 + 0.01 * 10 = 0.11 s with one more > 0.1 s SLO
    assert pol.on_arrival(0.0, request([1], n=1), prefill_plan(10.0), DecodePlan(0, 0.11), full).accept
    assert not pol.on_arrival(0.0, request([1], n=1), prefill_plan(31.0), DecodePlan(0, 0.0), full).accept
    assert pol.on_decode(request([1], n=1), full, planned=0) is None
    assert pol.on_decode(request([1], n=1), [decode_state(0, 7)], planned=0) == 0


def test_early_rejection_moves_the_decode_check_to_arrival():
    pol = EarlyRejection(SLO_, STEP)
    d = pol.on_arrival(0.0, request([1], n=1), prefill_plan(1.0), DecodePlan(0, 0.0), [decode_state(0, 9)])
    assert not d.accept and d.decode_load == pytest.approx(1.1)
    assert pol.on_arrival(0.0, request([1], n=1), prefill_plan(1.0), DecodePlan(0, 0.0), [decode_state(0, 7)]).accept


def test_prediction_expects_old_decodes_to_have_finished():
    # 9 sequences started at t=0; with t_d = 10 s they are predicted gone by the time a request
    # arriving at t=8 with a 5 s TTFT reaches decode (t=13). Early rejection refuses it.
    pool = [decode_state(0, 9, starts=[0.0] * 9)]
    args = (8.0, request([1], n=1), prefill_plan(5.0), DecodePlan(0, 0.0), pool)
    assert not EarlyRejection(SLO_, STEP).on_arrival(*args).accept
    d = PredictiveEarlyRejection(SLO_, STEP, decode_time_s=10.0).on_arrival(*args)
    assert d.accept and d.decode_load == pytest.approx((0.01 + 0.01) / 0.1)
    # With t_d = 20 s they are still running, and requests landing before t=13 add to them.
    assert not PredictiveEarlyRejection(SLO_, STEP, decode_time_s=20.0).on_arrival(*args).accept


def test_prediction_averages_over_the_pool():
    # Instance 0 would be at 0.11 s, instance 1 idle at 0.01 s: mean 0.06 s < 0.1 s.
    pool = [decode_state(0, 9, starts=[100.0] * 9), decode_state(1, 0)]
    d = PredictiveEarlyRejection(SLO_, STEP, 10.0).on_arrival(
        100.0, request([1], n=1), prefill_plan(1.0), DecodePlan(0, 0.0), pool
    )
    assert d.accept and d.decode_load == pytest.approx(0.6)


def test_prediction_also_retires_routed_requests_after_t_d():
    # Nine requests land at t=1; with t_d = 5 s their decode has ended by t=10, when a request
    # arriving at t=0 with a 10 s TTFT reaches decode. With t_d = 20 s they are still there.
    pool = [decode_state(0, 0, incoming=[(1.0, 0)] * 9)]
    args = (0.0, request([1], n=1), prefill_plan(10.0), DecodePlan(0, 0.0), pool)
    d = PredictiveEarlyRejection(SLO_, STEP, decode_time_s=5.0).on_arrival(*args)
    assert d.accept and d.decode_load == pytest.approx((0.01 + 0.01) / 0.1)
    d = PredictiveEarlyRejection(SLO_, STEP, decode_time_s=20.0).on_arrival(*args)
    assert not d.accept and d.decode_load == pytest.approx((0.01 + 0.01 * 10) / 0.1)


def test_prediction_removes_the_generated_tokens_of_finished_decodes():
    # Two sequences with 100-token prompts joined at t=0 and t=5; at t=10 they hold 300 tokens,
    # i.e. 100 generated, split 2:1 by age. With t_d = 8 s only the first ends before t=11:
    # it leaves with 100 + 66.7 tokens, the one remaining holds 133.3, plus the new 50.
    step = DecodeStepModel(base_s=0.01, per_seq_s=0.0, per_context_token_s=1e-4, kv_capacity_tokens=10**6)
    state = DecodeInstanceState(index=0, running_start_s=[0.0, 5.0], running_prompt=[100, 100],
                                context_tokens=300, incoming_ready_s=[], incoming_prompt=[])
    d = PredictiveEarlyRejection(SLO_, step, decode_time_s=8.0).on_arrival(
        10.0, request([1], n=50), prefill_plan(1.0), DecodePlan(0, 0.0), [state]
    )
    assert d.decode_load == pytest.approx((0.01 + 1e-4 * (300 + 50 - 100 - 200 / 3)) / 0.1)


def test_tbt_target_keeps_headroom():
    pol = PerStageRejection(SLO_, STEP, tbt_target=0.8)
    assert pol.on_decode(request([1], n=1), [decode_state(0, 5)], 0) == 0  # 0.07 s <= 0.08 s
    assert pol.on_decode(request([1], n=1), [decode_state(0, 7)], 0) is None  # 0.09 s: within SLO, not target


def test_late_binding_moves_to_an_instance_with_room():
    pol = LateBindingRejection(SLO_, STEP)
    pool = [decode_state(0, 9), decode_state(1, 3), decode_state(2, 5)]
    assert pol.on_decode(request([1], n=1), pool, planned=0) == 1
    assert pol.on_decode(request([1], n=1), pool, planned=2) == 2  # planned fits: stay
    assert pol.on_decode(request([1], n=1), [decode_state(0, 9), decode_state(1, 9)], planned=0) is None


def test_accept_all_never_rejects():
    pol = AcceptAll(SLO_, STEP)
    assert pol.on_arrival(0.0, request([1], n=1), prefill_plan(1e6), DecodePlan(0, 9.0), [decode_state(0, 99)]).accept
    assert pol.on_decode(request([1], n=1), [decode_state(0, 99)], planned=0) == 0
    assert math.isclose(STEP.step_s(99, 0), 1.0)


# -- local prefill (issue 39) ----------------------------------------------------------------------

def test_local_prefill_predicts_from_the_decode_instances_models():
    """1 s a token to prefill (nothing cached, no quadratic term), steps of 0.01 s a sequence,
    chunks of 2 tokens: a 5-token prompt is 5 s over 3 chunks on a batch of 2 (3 with it)."""
    prefill = PrefillCostModel(c_uu=0.0, c_up=0.0, c_u=1.0, c_0=0.0)
    step = DecodeStepModel(base_s=0.0, per_seq_s=0.01, per_context_token_s=0.0, kv_capacity_tokens=10**6)
    policy = LocalPrefill(prefill, step, SLO(ttft_s=100.0, tbt_s=2.0), chunk_tokens=2, block_size=BS)
    d = DecodeInstanceState(index=3, running_start_s=[0.0, 0.0], running_prompt=[1, 1], context_tokens=2,
                            incoming_ready_s=[], incoming_prompt=[], local_prefill_s=4.0)
    p = policy.plan(request([], n=5), d)
    assert (p.instance, p.prefix_tokens, p.prefill_s) == (3, 0, 5.0)
    assert p.stall_s == pytest.approx(0.03 + 5.0 / 3) and p.ttft_s == pytest.approx(4.0 + 5.0 + 3 * 0.03)
    # Local only where it takes at most 0.8 of the remote plan's TTFT and both SLOs hold.
    assert policy.choose(request([], n=5), prefill_plan(11.5), d).local  # 9.09 <= 9.2
    assert not policy.choose(request([], n=5), prefill_plan(11.0), d).local  # sooner, not by the margin
    tight = LocalPrefill(prefill, step, SLO(ttft_s=100.0, tbt_s=1.5), chunk_tokens=2, block_size=BS)
    assert not tight.choose(request([], n=5), prefill_plan(20.0), d).local  # a 1.7 s stall breaks 1.5 s
    late = LocalPrefill(prefill, step, SLO(ttft_s=9.0, tbt_s=2.0), chunk_tokens=2, block_size=BS)
    assert not late.choose(request([], n=5), prefill_plan(20.0), d).local  # 9.09 s misses the TTFT SLO
    # An idle prefill instance, nothing pulled, the same prefix: the same compute either way, and
    # only two calibrations' noise would choose: it stays remote however much slower it predicts.
    idle = PrefillPlan(instance=0, prefix_tokens=0, local_prefix_tokens=0, source=None, queue_s=0.0,
                       transfer_s=0.0, prefill_s=20.0)
    assert not policy.choose(request([], n=5), idle, d).local


def test_local_prefill_counts_the_prefix_the_decode_instance_caches():
    prefill = PrefillCostModel(c_uu=0.0, c_up=0.0, c_u=1.0, c_0=0.0)
    step = DecodeStepModel(base_s=0.0, per_seq_s=0.0, per_context_token_s=0.0, kv_capacity_tokens=10**6)
    policy = LocalPrefill(prefill, step, SLO(ttft_s=100.0, tbt_s=100.0), chunk_tokens=BS, block_size=BS)
    cache = LRUBlockCache(None)
    cache.insert([1, 2])
    d = DecodeInstanceState(index=0, running_start_s=[], running_prompt=[], context_tokens=0,
                            incoming_ready_s=[], incoming_prompt=[], cache=cache)
    p = policy.plan(request([1, 2, 3], n=3 * BS), d)
    assert p.prefix_tokens == 2 * BS and p.prefill_s == BS
