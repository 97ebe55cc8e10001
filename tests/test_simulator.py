"""The trace-replay cluster simulator: hand-made traces with known outcomes, determinism, CLI."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.sim.config import SimConfig
from bench.sim.decode import DecodeInstance
from bench.sim.hitrate import lru_hit_rate, pool_hit_rate, pool_hits
from bench.sim.false_rejects import false_rejects
from bench.sim.metrics import effective, summarize
from bench.sim.simulator import COMPLETED, REJECTED_AT_DECODE, REJECTED_ON_ARRIVAL, Simulator, simulate
from bench.simulate import main
from bench.trace import TraceEntry, load_trace
from cluster.policies.cost_model import DecodeStepModel, PipelinedPrefillCost
from cluster.policies.elastic_roles import ElasticConfig
from bench.sim.prefill import PrefillInstance
from cluster.policies.prefix_index import LRUBlockCache

BS = 512


def shared_prefix_trace(n, gap_ms=100_000, output=3):
    """``n`` requests, far apart, sharing blocks 0-2 and each adding one block of its own."""
    return [TraceEntry(i * gap_ms, 4 * BS, output, [0, 1, 2, 1000 + i]) for i in range(n)]


def random_trace(n, seed=0, gap_ms=400):
    rng = np.random.default_rng(seed)
    entries, next_id = [], 100
    roots = [[i] for i in range(5)]
    for i in range(n):
        blocks = int(rng.integers(1, 40))
        root = roots[int(rng.integers(0, len(roots)))]
        keys = list(root) + list(range(next_id, next_id + blocks))
        next_id += blocks
        roots.append(keys[: len(keys) // 2])
        entries.append(TraceEntry(i * gap_ms, len(keys) * BS - 100, int(rng.integers(2, 300)), keys))
    return entries


def test_lru_hit_rate_by_hand():
    # Request 1 misses; each later one reuses 3 of its 4 blocks: 3 * 3 / 16.
    assert lru_hit_rate(shared_prefix_trace(4), None) == pytest.approx(9 / 16)
    assert lru_hit_rate(shared_prefix_trace(4), 0) == 0.0



def test_pool_hit_rate_by_hand():
    bs = 16
    # A: blocks 1,2 + 8 tokens; B: A's two blocks + one of its own + 8 tokens (the next turn).
    a = TraceEntry(0, 2 * bs + 8, 1, [1, 2, 3])
    b = TraceEntry(0, 3 * bs + 8, 1, [1, 2, 4, 5])
    # Unbounded: B reuses A's 2 full blocks; A stored [1, 2] + its own tail block (8 prompt
    # tokens + 1 output token do not fill one: no own block).
    assert pool_hit_rate([a, b], None, bs) == pytest.approx(2 * bs / (a.input_length + b.input_length))
    assert pool_hit_rate([a, b], 0, bs) == 0.0
    # The block of the last prompt token is never reused: a prompt of exactly 2 blocks repeated
    # reuses only its first block.
    c = TraceEntry(0, 2 * bs, 1, [1, 2])
    assert pool_hit_rate([c, c], None, bs) == pytest.approx(bs / (4 * bs))
    # Outputs fill blocks of the request's own: with 40 output tokens A stores [1, 2] and two
    # own blocks (8 + 39 tokens with KV -> 47 // 16 = 2 more), 4 in all. With room for 4,
    # [1, 2] survive; a third request's 4 stored blocks push them out (LRU), so the fourth
    # (B again) misses.
    a_long = TraceEntry(0, 2 * bs + 8, 40, [1, 2, 3])
    other = TraceEntry(0, 4 * bs + 8, 1, [7, 8, 9, 10, 11])
    total = a_long.input_length + b.input_length
    assert pool_hit_rate([a_long, b], 4, bs) == pytest.approx(2 * bs / total)
    assert pool_hit_rate([a_long, other, b], 4, bs) == 0.0
    assert pool_hit_rate([a_long, other, b], None, bs) == pytest.approx(2 * bs / (total + other.input_length))
    # A prefix hit is the leading run only: a chain whose head was evicted is unreachable,
    # and LRU evicts tails before heads (room for 1 block keeps [1], not [2]).
    assert pool_hit_rate([c, b], 1, bs) == pytest.approx(bs / (c.input_length + b.input_length))
    assert pool_hits([a_long, other, b, c], None, bs) == [0, 0, 2 * bs, bs]
    with pytest.raises(ValueError):
        pool_hit_rate([a], -1, bs)


def test_pool_hit_rate_matches_the_lru_curve_when_nothing_else_differs():
    # Prompts of whole blocks plus one token, BS-token outputs: pool_hit_rate stores the prompt
    # blocks and one block of the request's own, as lru_hit_rate stores the prompt blocks and the
    # last (partial, unique) one; neither reuses the last token's block.
    entries = [TraceEntry(e.timestamp_ms, (e.input_length // BS) * BS + 1, BS, e.hash_ids[: e.input_length // BS + 1])
               for e in random_trace(60, seed=3)]
    for cap in (None, 0, 10, 50, 200):
        tokens = None if cap is None else cap * BS
        assert pool_hit_rate(entries, cap, BS) == pytest.approx(lru_hit_rate(entries, tokens, BS))

def test_shared_prefix_hit_rate_and_ttft_in_the_simulator():
    cfg = SimConfig(n_prefill=1, n_decode=1, scheduler="global")
    r = simulate(cfg, shared_prefix_trace(4))
    s = summarize(r)
    assert s["prefix_hit_rate"] == pytest.approx(9 / 16)
    # Requests are far apart: TTFT is exactly the prefill time of the uncached tokens.
    true = cfg.prefill_model()
    assert r.ttft_s[0] == pytest.approx(true.seconds(4 * BS))
    assert r.ttft_s[1:] == pytest.approx([true.seconds(4 * BS, 3 * BS)] * 3)
    assert (r.status == COMPLETED).all()


def test_single_request_decodes_alone_at_the_single_sequence_step_time():
    cfg = SimConfig(n_prefill=1, n_decode=1)
    r = simulate(cfg, [TraceEntry(0, 1000, 11, [0, 1])])
    step = cfg.decode_model()
    # 10 decode steps after the first token; context grows from 1000 to 1009 tokens.
    steps = [step.step_s(1, 1000 + k) for k in range(10)]
    ready = r.ttft_s[0] + cfg.transfer_model().seconds(1000)
    assert r.finish_s[0] == pytest.approx(ready + sum(steps))
    assert r.tbt_s[0] == pytest.approx(ready - r.ttft_s[0] + steps[0])  # longest gap includes the KV copy


def test_global_cache_pulls_from_a_busy_holder_and_replicates():
    # Request 0 caches the prefix on one instance and keeps it busy; request 1 arrives while it
    # is busy, so the other instance pulls the prefix and now both hold it.
    big = TraceEntry(0, 60 * BS, 2, list(range(60)))
    follow = TraceEntry(10, 61 * BS, 2, list(range(60)) + [999])
    cfg = SimConfig(n_prefill=2, n_decode=1, scheduler="global", hot_keys=1, replica_interval_s=1.0)
    follow_up = TraceEntry(60_000, 1, 1, [7777])  # a later arrival so the replica sampler runs
    r = simulate(cfg, [big, follow, follow_up])
    assert r.pulled_tokens[1] == 60 * BS and r.prefix_tokens[1] == 60 * BS
    assert r.hot_key_replicas[-1] == 2.0


def test_decode_instance_batches_continuously():
    finished = {}
    step = DecodeStepModel(base_s=1.0, per_seq_s=0.0, per_context_token_s=0.0, kv_capacity_tokens=100)
    d = DecodeInstance(0, step, lambda rid, t: finished.setdefault(rid, t))
    d.join(0, prompt=10, decode_steps=3)
    d.advance_to(1.5)  # step 1 ends at 1.0, step 2 is under way at 1.5 and runs to 2.0
    d.join(1, prompt=20, decode_steps=2)
    assert d.batch_size == 2 and d.context_tokens == 10 + 2 + 20
    d.drain()
    assert finished == {0: 3.0, 1: 4.0}
    d.join(2, prompt=90, decode_steps=5)
    d.join(3, prompt=50, decode_steps=1)  # 90 + 50 > 100 tokens of HBM: waits for room
    assert d.batch_size == 1 and len(d.waiting) == 1
    d.drain()
    assert finished[3] == 4.0 + 5 + 1


def long_requests(arrivals_s):
    n = 100_000  # with the calibrated step model, two such contexts fit a 0.07 s TBT, three do not
    return [TraceEntry(t * 1000, n, 2000, list(range(1000 * k, 1000 * k + 196))) for k, t in enumerate(arrivals_s)]


OVERLOAD = SimConfig(n_prefill=8, n_decode=1, tbt_slo_s=0.07, decode_time_s=1000.0)


def test_simultaneous_burst_only_prediction_rejects_before_prefill():
    entries = long_requests([0.0] * 8)
    per_stage = simulate(replace(OVERLOAD, admission="per_stage"), entries)
    early = simulate(replace(OVERLOAD, admission="early"), entries)
    predictive = simulate(replace(OVERLOAD, admission="predictive"), entries)
    # Nobody is decoding yet, so early rejection sees an idle pool and wastes 6 prefills too.
    assert list(per_stage.status) == [COMPLETED] * 2 + [REJECTED_AT_DECODE] * 6
    assert list(early.status) == list(per_stage.status)
    # Prediction counts the two already routed requests landing first.
    assert list(predictive.status) == [COMPLETED] * 2 + [REJECTED_ON_ARRIVAL] * 6
    assert summarize(predictive)["wasted_prefill_s"] == 0.0


def test_early_rejection_refuses_while_decode_is_full():
    entries = long_requests([0.0, 0.0] + [60.0] * 6)
    early = simulate(replace(OVERLOAD, admission="early"), entries)
    assert list(early.status) == [COMPLETED] * 2 + [REJECTED_ON_ARRIVAL] * 6
    assert (simulate(replace(OVERLOAD, admission="none"), entries).status == COMPLETED).all()


def test_simulator_is_deterministic_for_a_seed():
    entries = random_trace(300)
    cfg = SimConfig(n_prefill=4, n_decode=2, scheduler="random", admission="predictive", speed=4.0, seed=5)
    a, b = simulate(cfg, entries), simulate(cfg, entries)
    for field in ("status", "ttft_s", "tbt_s", "finish_s", "prefix_tokens", "pulled_tokens"):
        assert np.array_equal(getattr(a, field), getattr(b, field), equal_nan=True), field
    assert a.prefill_load == b.prefill_load and a.decode_load == b.decode_load
    c = simulate(replace(cfg, seed=6), entries)
    assert not np.array_equal(a.ttft_s, c.ttft_s, equal_nan=True)


@pytest.mark.parametrize("admission", ["none", "per_stage", "early", "predictive", "late_binding"])
def test_every_request_is_accounted_for(admission):
    entries = random_trace(200, seed=1, gap_ms=150)
    r = simulate(SimConfig(n_prefill=2, n_decode=2, admission=admission, speed=3.0), entries)
    s = summarize(r)
    assert s["completed"] + s["rejected"] == len(entries)
    done = r.status == COMPLETED
    assert not np.isnan(r.finish_s[done]).any()
    assert (r.finish_s[done] >= r.arrival_s[done] + r.ttft_s[done]).all()


def test_a_rejected_request_replayed_admitted_says_whether_the_rejection_was_wrong():
    """Issue 41 item 3, in the simulator: early rejection refuses 6 requests arriving while decode
    is full; replayed admitted alone, each of them completes. On the truncated trace a replay
    answers as on the whole one."""
    entries = long_requests([0.0, 0.0] + [60.0] * 6)
    cfg = replace(OVERLOAD, admission="early")
    r = simulate(cfg, entries)
    fr = false_rejects(r, entries, samples=3)
    assert fr["rejected"] == 6 and fr["sampled"] == 3 and set(fr["requests"]) <= set(range(2, 8))
    for i in fr["requests"]:
        whole = simulate(cfg, entries, admit=frozenset({i}))
        assert whole.status[i] == COMPLETED and (whole.status == COMPLETED).sum() == 3
    assert fr["would_have_met"] == sum(bool(effective(simulate(cfg, entries, admit=frozenset({i})))[i])
                                       for i in fr["requests"])
    assert fr["rate"] == fr["would_have_met"] / 3
    none = false_rejects(simulate(replace(cfg, admission="none"), entries), entries)
    assert none["sampled"] == 0 and none["rate"] is None


def test_config_is_validated():
    with pytest.raises(ValueError):
        SimConfig(scheduler="fastest")
    with pytest.raises(ValueError):
        SimConfig(admission="maybe")
    with pytest.raises(ValueError):
        SimConfig(n_prefill=0)
    with pytest.raises(ValueError):
        SimConfig(tbt_target=1.5)
    with pytest.raises(ValueError):
        SimConfig(cpp_stages=2, elastic=ElasticConfig())


@pytest.mark.parametrize("experiment", ["schedulers", "hitrate", "global", "overload", "switch_cost"])
def test_cli_writes_json_and_png(tmp_path, experiment, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps({"timestamp": e.timestamp_ms, "input_length": e.input_length,
                        "output_length": e.output_length, "hash_ids": e.hash_ids})
            for e in random_trace(60, seed=2)
        )
    )
    out = tmp_path / "out"
    main([experiment, "--trace", str(trace), "--out", str(out)])
    data = json.loads((out / f"{experiment}.json").read_text())
    assert data
    assert list(out.glob("*.png"))
    assert "paper" in capsys.readouterr().out


def test_late_binding_moves_kv_to_the_decode_instance_that_freed_up():
    # Each decode instance fits one 100k-token context at a 0.05 s TBT. A decodes long on
    # instance 0, B briefly on instance 1; C is routed to instance 0 (a tie) while B still runs,
    # but by the time C's KV is ready only instance 1 has room.
    a, b, c = long_requests([0.0, 0.0, 26.0])
    b = replace(b, output_length=100)
    cfg = replace(OVERLOAD, n_decode=2, tbt_slo_s=0.05)
    per_stage = simulate(replace(cfg, admission="per_stage"), [a, b, c])
    late = simulate(replace(cfg, admission="late_binding"), [a, b, c])
    assert list(per_stage.status) == [COMPLETED, COMPLETED, REJECTED_AT_DECODE]
    assert (late.status == COMPLETED).all()
    # C decodes after its KV is copied from instance 0's DRAM to instance 1.
    step = cfg.decode_model()
    ready = late.arrival_s[2] + late.ttft_s[2] + cfg.transfer_model().seconds(100_000)
    assert late.finish_s[2] > ready + 1999 * step.step_s(1, 100_000)


# -- the KVCache pool ---------------------------------------------------------------------------


# Sums over ``random_trace(300)`` on 4P + 2D at 4x with early rejection, from the simulator before
# the pool existed: (sum of TTFTs, prefix tokens, pulled tokens, completed, sum of TBTs).
BEFORE_THE_POOL = {
    "random": (3989.357524893976, 1223680, 0, 173, 15.499129290393391),
    "load_balancing": (4281.350688782442, 1294336, 0, 178, 16.66462784059352),
    "local": (4386.838886205704, 1407488, 0, 179, 16.924229992292428),
    "global": (4366.506733814373, 1580032, 202240, 183, 17.523821550553787),
}


@pytest.mark.parametrize("scheduler", sorted(BEFORE_THE_POOL))
def test_pool_off_leaves_results_unchanged(scheduler):
    cfg = SimConfig(n_prefill=4, n_decode=2, scheduler=scheduler, speed=4.0, admission="early")
    assert cfg.pool_capacity_tokens == 0 and not cfg.pool_enabled
    r = simulate(cfg, random_trace(300))
    ttft, prefix, pulled, completed, tbt = BEFORE_THE_POOL[scheduler]
    assert float(np.nansum(r.ttft_s)) == pytest.approx(ttft, rel=1e-12)
    assert (int(r.prefix_tokens.sum()), int(r.pulled_tokens.sum())) == (prefix, pulled)
    assert int((r.status == COMPLETED).sum()) == completed
    assert float(np.nansum(r.tbt_s)) == pytest.approx(tbt, rel=1e-12)
    assert not r.pool_tokens.any() and r.pool_evictions == 0 and r.pool_blocks_held == 0


def test_pool_mode_uses_the_live_conductors_scheduler():
    from bench.sim.simulator import Simulator
    from cluster.policies.scheduling import GlobalCacheAwareScheduler

    entries = shared_prefix_trace(1)
    pooled = Simulator(SimConfig(pool_capacity_tokens=None), entries).scheduler
    assert isinstance(pooled, GlobalCacheAwareScheduler) and not pooled.pull_from_instances
    assert Simulator(SimConfig(), entries).scheduler.pull_from_instances


def second_turn_elsewhere():
    """Turn 1 of a conversation (60 blocks) prefills on instance 0 and is long done when a big
    unrelated request takes instance 0; turn 2 arrives just after, so instance 1 serves it."""
    turn1 = TraceEntry(0, 60 * BS, 1, list(range(60)))
    other = TraceEntry(100_000, 120 * BS, 1, list(range(5000, 5120)))
    turn2 = TraceEntry(100_010, 61 * BS, 1, list(range(60)) + [999])
    return [turn1, other, turn2]


def test_second_turn_on_another_instance_hits_through_the_pool():
    cfg = SimConfig(n_prefill=2, n_decode=1, pool_capacity_tokens=1_000_000)
    r = simulate(cfg, second_turn_elsewhere())
    assert r.prefix_tokens[2] == 60 * BS and r.pool_tokens[2] == 60 * BS
    assert r.pulled_tokens[2] == 0
    # Instance 1 is idle: TTFT = loading the 60 blocks from the pool + prefilling the rest.
    true = cfg.prefill_model()
    expected = cfg.transfer_model().seconds(60 * BS) + true.seconds(61 * BS, 60 * BS)
    assert r.ttft_s[2] == pytest.approx(expected)
    assert r.ttft_s[2] < r.ttft_s[1]  # it did not queue behind the big request on instance 0
    assert r.pool_blocks_held == 60 + 120 + 1
    # Without the pool, global pulls the prefix from instance 0 instead; local-only caches miss.
    no_pool = simulate(replace(cfg, pool_capacity_tokens=0), second_turn_elsewhere())
    assert no_pool.pulled_tokens[2] == 60 * BS and not no_pool.pool_tokens.any()
    # A local cache does not know turn 1 on instance 1: a pool of one instance's worth of DRAM
    # serves it while the instances' own caches hold nothing.
    no_local = simulate(replace(cfg, cache_capacity_tokens=0), second_turn_elsewhere())
    assert no_local.pool_tokens[2] == 60 * BS


def test_pool_stores_a_prompt_only_when_its_prefill_ends():
    # Turn 2 arrives while turn 1 is still prefilling: nothing is in the pool yet.
    turn1 = TraceEntry(0, 60 * BS, 1, list(range(60)))
    turn2 = TraceEntry(1, 61 * BS, 1, list(range(60)) + [999])
    cfg = SimConfig(n_prefill=2, n_decode=1, cache_capacity_tokens=0, pool_capacity_tokens=None)
    r = simulate(cfg, [turn1, turn2])
    assert r.pool_tokens[1] == 0 and r.prefix_tokens[1] == 0


def test_pool_capacity_evicts_least_recently_used_blocks():
    a, b, c = ([1, 2, 3], [7, 8, 9], [10, 11, 12])

    def run(capacity_blocks, keys):
        entries = [TraceEntry(k * 100_000, 3 * BS, 1, list(ks)) for k, ks in enumerate(keys)]
        capacity = None if capacity_blocks is None else capacity_blocks * BS
        # Instances cache nothing: every hit is the pool's.
        cfg = SimConfig(n_prefill=2, n_decode=1, cache_capacity_tokens=0, pool_capacity_tokens=capacity)
        r = simulate(cfg, entries)
        assert (r.pool_tokens == r.prefix_tokens).all()
        return list(r.pool_tokens // BS), r

    # Room for 4 blocks: B pushes out A's tail first (2, 3), so A again finds only its head.
    hits, r = run(4, [a, b, a])
    assert hits == [0, 0, 1] and r.pool_evictions >= 2
    assert run(6, [a, b, a])[0] == [0, 0, 3]
    assert run(None, [a, b, c, a, b])[0] == [0, 0, 0, 3, 3]
    # Room for 6: A's hit refreshes it, so C evicts B (least recently used), not A.
    assert run(6, [a, b, a, c, a, b])[0] == [0, 0, 3, 0, 3, 0]
    assert run(0, [a, a])[0] == [0, 0]  # 0 means no pool at all


def test_pool_config_is_validated():
    with pytest.raises(ValueError):
        SimConfig(pool_capacity_tokens=-1)
    with pytest.raises(ValueError):
        SimConfig(scheduler="local", pool_capacity_tokens=1_000_000)
    assert SimConfig(pool_capacity_tokens=None).pool_capacity_blocks is None
    assert SimConfig(pool_capacity_tokens=10 * BS).pool_capacity_blocks == 10


CONVERSATION = Path(__file__).resolve().parents[2] / "shared" / "eval" / "traces" / "conversation_trace.jsonl"


@pytest.mark.skipif(not CONVERSATION.exists(), reason="conversation trace not available")
def test_pool_hit_rate_beats_local_caches_on_a_conversation_slice():
    entries = load_trace(str(CONVERSATION))[:2500]
    # Fig. 10's cluster with smaller caches, so that the slice fills them.
    base = SimConfig(n_prefill=10, n_decode=1, cache_capacity_tokens=200_000, output_tokens=1)
    hit = {
        name: summarize(simulate(cfg, entries))["prefix_hit_rate"]
        for name, cfg in {
            "local": replace(base, scheduler="local"),
            "pool": replace(base, scheduler="global", pool_capacity_tokens=10 * 200_000),
        }.items()
    }
    assert hit["pool"] >= hit["local"] > 0


def test_cli_global_pool_capacity_flag(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(
        json.dumps({"timestamp": e.timestamp_ms, "input_length": e.input_length,
                    "output_length": e.output_length, "hash_ids": e.hash_ids})
        for e in random_trace(40, seed=4)
    ))
    for flag, capacity in (("unbounded", None), ("51200", 51200)):
        out = tmp_path / flag
        main(["global", "--trace", str(trace), "--out", str(out), "--pool-tokens", flag])
        data = json.loads((out / "global.json").read_text())["custom"]
        assert data["pool_capacity_tokens"] == capacity and data["pool"]["config"]["pool_capacity_tokens"] == capacity
    with pytest.raises(SystemExit):
        main(["global", "--trace", str(trace), "--out", str(tmp_path / "x"), "--pool-tokens", "0"])


def test_a_pipelined_group_is_one_node_with_one_stage_and_faster_on_long_prompts():
    node = SimConfig().prefill_model()
    one = PipelinedPrefillCost(node, 1, 4096)
    assert one.seconds(50_000, 10_000) == pytest.approx(node.seconds(50_000, 10_000))
    two = PipelinedPrefillCost(node, 2, 4096, min_tokens=8192)
    # Under the minimum: one chunk through both stages, no faster than one node.
    assert two.seconds(5000) == pytest.approx(node.seconds(5000))
    # The chunks' work telescopes to the node's; the pipeline adds one last chunk's stage time.
    chunks = two.chunk_stage_seconds(65_536, 8192)
    assert len(chunks) == 14 and chunks == sorted(chunks)  # later chunks attend to more context
    assert 2 * sum(chunks) == pytest.approx(node.seconds(65_536, 8192) - node.c_0)
    assert two.seconds(65_536, 8192) == pytest.approx(node.c_0 + sum(chunks) + chunks[-1])
    assert node.seconds(65_536, 8192) / two.seconds(65_536, 8192) > 1.8


def test_a_group_takes_the_next_prompt_as_soon_as_its_first_stage_is_free():
    group = PrefillInstance(0, LRUBlockCache(None), stages=2)
    first = group.run(0.0, [1.0, 1.0, 1.0], 0.0)  # stage 0 busy until 3, stage 1 until 4
    assert first == pytest.approx(4.0) and group.queue_s(0.0) == pytest.approx(3.0)
    second = group.run(0.5, [2.0], 0.0)  # stage 0 from 3 to 5, stage 1 from 5 to 7
    assert second == pytest.approx(7.0)
    single = PrefillInstance(1, LRUBlockCache(None))
    assert single.run(1.0, [2.0], 2.5, overhead_s=0.5) == pytest.approx(5.0)


def test_cpp_groups_cut_long_prompts_ttft_in_the_simulator():
    trace = [TraceEntry(i * 200_000, 64 * BS, 2, list(range(100 * i, 100 * i + 64))) for i in range(3)]
    flat = simulate(SimConfig(n_prefill=2, n_decode=1), trace)
    piped = simulate(SimConfig(n_prefill=2, n_decode=1, cpp_stages=2, cpp_min_tokens=8192), trace)
    assert (piped.status == COMPLETED).all()
    assert np.all(piped.ttft_s < 0.6 * flat.ttft_s)
    with pytest.raises(ValueError):
        SimConfig(n_prefill=3, cpp_stages=2)


def test_cli_cpp(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": e.timestamp_ms, "input_length": e.input_length,
                                            "output_length": e.output_length, "hash_ids": e.hash_ids})
                                for e in random_trace(60, seed=2)))
    main(["cpp", "--trace", str(trace), "--out", str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "cpp.json").read_text())
    assert set(data) == {"X=1", "X=2", "X=4"} and all(d["completed"] == 60 for d in data.values())
    assert "long TTFT s" in capsys.readouterr().out


# -- elastic roles (issue 32) -------------------------------------------------------------------

# Quick enough for a few hundred requests: a decision every 5 s on the last 20 s.
QUICK_ROLES = ElasticConfig(interval_s=5.0, horizon_s=20.0, min_dwell_s=20.0, switch_cost_s=1.0, decode_time_s=20.0)


def distinct_requests(n, gap_ms, blocks, output):
    return [TraceEntry(i * gap_ms, blocks * BS, output, list(range(1000 * i, 1000 * i + blocks))) for i in range(n)]


def test_elastic_roles_that_never_switch_change_nothing():
    entries = random_trace(200, seed=1, gap_ms=150)
    fixed = SimConfig(n_prefill=2, n_decode=2, admission="late_binding", speed=3.0)
    never = simulate(replace(fixed, elastic=replace(QUICK_ROLES, margin=1.0)), entries)  # a gain is <= 1
    r = simulate(fixed, entries)
    assert not never.switches
    for field in ("status", "ttft_s", "tbt_s", "finish_s"):
        assert np.array_equal(getattr(r, field), getattr(never, field), equal_nan=True), field


def test_decode_short_of_capacity_takes_a_prefill_node():
    # Short prompts, long outputs: 1 decode node refuses most; 3 prefill nodes idle.
    entries = distinct_requests(400, 150, 4, 1500)
    fixed = SimConfig(n_prefill=3, n_decode=1, admission="late_binding", tbt_slo_s=0.05)
    sim = Simulator(replace(fixed, elastic=QUICK_ROLES), entries)
    elastic = sim.run()
    assert [role for _, _, role in elastic.switches] == ["decode", "decode"]  # down to 1 prefill node
    # A prefill node turned decode keeps its prefix cache for when it comes back.
    assert all(len(sim.prefill[node].cache) for _, node, _ in elastic.switches)
    assert elastic.switches[0][0] >= QUICK_ROLES.min_dwell_s  # the roles dwell from the start
    assert max(elastic.decode_instances) == 3 and min(elastic.prefill_instances) == 1
    s = summarize(elastic)
    assert s["completed"] + s["rejected"] == len(entries)
    assert s["rejected"] < summarize(simulate(fixed, entries))["rejected"]


def test_prefill_short_of_capacity_takes_a_decode_node_that_drains_first():
    # Long prompts: 1 prefill node queues past the TTFT SLO; 3 decode nodes have room.
    entries = distinct_requests(150, 1000, 40, 400)
    fixed = SimConfig(n_prefill=1, n_decode=3, admission="late_binding")
    sim = Simulator(replace(fixed, elastic=QUICK_ROLES), entries)
    r = sim.run()
    [(ordered, node, role)] = r.switches
    assert role == "prefill" and max(r.prefill_instances) == 2
    s = summarize(r)
    assert s["slo_attainment"] > summarize(simulate(fixed, entries))["slo_attainment"] + 0.3
    assert s["completed"] + s["rejected"] == len(entries)
    done = r.status == COMPLETED
    assert (r.finish_s[done] >= r.arrival_s[done] + r.ttft_s[done]).all()
    # What was routed to the node went elsewhere; what ran on it finished there, and only then
    # (and the switch cost later) did it take the prefill role.
    d = sim.decode[node]
    steps_before = int(np.searchsorted(d.step_end, ordered, side="right"))
    assert all(d.join_step[i] <= steps_before for i in np.flatnonzero(sim.decode_of == node))
    assert d.step_end[-1] > ordered  # it had a batch to finish
    assert sim.roles.changed_at[node] == pytest.approx(d.step_end[-1] + QUICK_ROLES.switch_cost_s)


# -- local prefill (issue 39): the live Conductor's policy, prefilling on the decode instance ----

def test_a_local_prefill_rides_on_the_decode_steps_and_joins_at_its_last_chunk():
    firsts, finished = {}, {}
    step = DecodeStepModel(base_s=1.0, per_seq_s=0.0, per_context_token_s=0.0, kv_capacity_tokens=1000)
    d = DecodeInstance(0, step, lambda rid, t: finished.setdefault(rid, t), lambda rid, t: firsts.setdefault(rid, t))
    d.join(0, 10, 5)  # a running stream: steps of 1 s
    d.prefill_locally(1, 20, [0.5, 0.25], 2)
    assert d.state().local_prefill_s == 0.75 and d.state().batch_size == 2  # counted as running, as the ledger does
    d.advance_to(2.0)
    # Steps of 1.5 s then 1.25 s while the chunks compute; the first token at the second one's end.
    assert d.step_end[:2] == [1.5, 2.75] and firsts == {1: 2.75}
    d.drain()
    assert finished[1] == 2.75 + 2 * 1.0 and finished[0] == 2.75 + 3 * 1.0


def burst(n, prompt=4 * BS, output=20):
    return [TraceEntry(0, prompt, output, [10 * i + k for k in range(4)]) for i in range(n)]


def test_local_prefill_takes_a_queued_prompt_where_both_slos_hold():
    """A burst queues on the one prefill node; with a loose TBT SLO some requests prefill on the
    idle decode node instead, and every request still completes, sooner on average."""
    base = SimConfig(n_prefill=1, n_decode=1, ttft_slo_s=60.0, tbt_slo_s=1.0, profile_noise=0.0)
    remote = simulate(base, burst(6))
    local = simulate(replace(base, local_prefill=True), burst(6))
    assert not remote.local_prefill.any()
    assert 0 < local.local_prefill.sum() < 6
    assert (local.status == COMPLETED).all() and not np.isnan(local.ttft_s).any()
    assert np.nanmean(local.ttft_s) < np.nanmean(remote.ttft_s)
    # The first request found the prefill node idle: remote was sooner, and it went there.
    assert not local.local_prefill[0]


def test_local_prefill_never_breaks_the_tbt_slo_it_is_given():
    """With a 50 ms TBT SLO a step that also computes a 512-token chunk (about 30 + 42 ms here)
    would break it: every request prefills remotely, and the results are those without the policy."""
    base = SimConfig(n_prefill=1, n_decode=1, ttft_slo_s=60.0, tbt_slo_s=0.05, profile_noise=0.0)
    remote = simulate(base, burst(6))
    local = simulate(replace(base, local_prefill=True), burst(6))
    assert not local.local_prefill.any()
    assert np.array_equal(local.ttft_s, remote.ttft_s) and np.array_equal(local.finish_s, remote.finish_s)
