"""The continuous-batching scheduler, driven without a model.

The engine's postprocess is simulated: after ``schedule()`` every scheduled chunk advances
``num_computed_tokens`` and commits its blocks (``samples`` is read *before* that, exactly as
the model runner does), then each sampling sequence gets a deterministic token and is finished
once it has ``max_tokens`` outputs.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from paged_kv import BlockManager, chain_keys


def token_for(seq: Sequence) -> int:
    """The token a deterministic model would sample next: a function of the request and position.

    Recomputation after preemption must therefore reproduce exactly the same output.
    """
    return (hash(seq.request_id) % 997 + 31 * seq.num_tokens) % 5000 + 1000


def expected_output(request_id: str, prompt_len: int, max_tokens: int) -> list[int]:
    return [(hash(request_id) % 997 + 31 * (prompt_len + i)) % 5000 + 1000 for i in range(max_tokens)]


class Chunk(NamedTuple):
    """A scheduled chunk as it was at schedule time (``samples`` is only meaningful then)."""

    seq: Sequence
    num_new_tokens: int
    samples: bool


def make_seq(rid: str, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), object())


class Harness:
    def __init__(self, *, num_blocks=64, block_size=4, budget=32, max_num_seqs=256, prefix=True, **config):
        cfg = EngineConfig(
            device="cpu",
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=prefix,
            **config,
        )
        self.bm = BlockManager(num_blocks, block_size, prefix)
        self.sched = Scheduler(cfg, self.bm)
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.steps: list[dict] = []
        self.finished: list[Sequence] = []

    def add(self, seq: Sequence) -> Sequence:
        self.sched.add(seq)
        return seq

    def add_received(self, seq: Sequence) -> Sequence:
        """Join ``seq`` as a decode instance does: its prompt's KV was received into its blocks
        and its first token sampled by the prefill instance."""
        self.bm.grow(seq.block_table, seq.num_prompt_tokens)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.bm.commit(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        seq.append_token(token_for(seq))
        self.sched.add_running(seq)
        return seq

    def step(self) -> list[Chunk]:
        sched, bm = self.sched, self.bm
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        preempt_before = sched.num_preemptions
        batch = sched.schedule()
        preempted = sched.num_preemptions - preempt_before

        # ---- invariants of the schedule itself ----
        assert sum(s.num_new_tokens for s in batch) <= self.budget
        assert len(batch) <= self.max_num_seqs
        seqs = [s.seq for s in batch]
        assert len(set(map(id, seqs))) == len(seqs)
        for s in batch:
            assert s.num_new_tokens >= 1
            assert s.seq.num_computed_tokens + s.num_new_tokens <= s.seq.num_tokens
            assert s.seq.status is SequenceStatus.RUNNING
            # its table can hold the chunk
            assert len(s.seq.block_table.block_ids) * bm.block_size >= (
                s.seq.num_computed_tokens + s.num_new_tokens
            )
        # decodes / continuing sequences come first, newly admitted ones after them
        was_running = [any(s.seq is r for r in running_before) for s in batch]
        assert was_running == sorted(was_running, reverse=True)
        newly = [s.seq for s, w in zip(batch, was_running) if not w]
        if preempted:
            assert newly == [], "admitted a sequence in a step with a preemption"
        for seq in newly:
            assert any(seq is w for w in waiting_before)
        if newly:
            assert len(sched.running) <= self.max_num_seqs
        # every sequence is in exactly one place
        assert set(map(id, sched.running)).isdisjoint(map(id, sched.waiting))
        for seq in sched.waiting:
            assert seq.status is SequenceStatus.WAITING
            assert seq.block_table.block_ids == []
        for seq in sched.running:
            assert seq.status is SequenceStatus.RUNNING

        # ---- simulated engine postprocess (llm_engine.step order) ----
        chunks = [Chunk(s.seq, s.num_new_tokens, s.samples) for s in batch]  # before advancing
        sampling = [c for c in chunks if c.samples]
        for s in batch:
            s.seq.num_computed_tokens += s.num_new_tokens
            bm.commit(s.seq.block_table, s.seq.token_ids, s.seq.num_computed_tokens)
        for s in sampling:
            seq = s.seq
            seq.append_token(token_for(seq))
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
                self.finished.append(seq)
        self.check()
        self.steps.append(
            dict(
                batch=[(s.seq.request_id, s.num_new_tokens) for s in batch],
                sampled=[s.seq.request_id for s in sampling],
                preempted=preempted,
                newly=[s.request_id for s in newly],
            )
        )
        return chunks

    def check(self) -> None:
        bm = self.bm
        bm.check_integrity()
        owners: dict[int, list[Sequence]] = {}
        for seq in self.sched.running:
            for blk in seq.block_table.block_ids:
                owners.setdefault(blk, []).append(seq)
            assert seq.num_computed_tokens < seq.num_tokens
        for blk, seqs in owners.items():
            assert bm.pool.ref_counts[blk] == len(seqs)
            if len(seqs) > 1:
                # only a committed, keyed prefix block may be shared
                key = bm.pool.keys[blk]
                assert key is not None
                for seq in seqs:
                    i = seq.block_table.block_ids.index(blk)
                    assert seq.block_table.keys[i] == key
        assert bm.pool.num_in_use == len(owners)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "scheduler did not drain"
        self.check()
        assert self.bm.pool.num_in_use == 0
        assert self.bm.pool.num_free == self.bm.num_blocks


# --------------------------------------------------------------------------------------------
def test_single_sequence_chunked_prefill_then_decode():
    h = Harness(budget=16, block_size=4, num_blocks=64)
    seq = h.add(make_seq("a", list(range(50)), max_tokens=3))
    b = h.step()
    assert [(s.num_new_tokens, s.samples) for s in b] == [(16, False)]
    assert seq.num_computed_tokens == 16 and seq.num_output_tokens == 0
    assert len(seq.block_table.block_ids) == 4
    b = h.step()
    assert [(s.num_new_tokens, s.samples) for s in b] == [(16, False)]
    b = h.step()
    assert [(s.num_new_tokens, s.samples) for s in b] == [(16, False)]
    b = h.step()
    assert [(s.num_new_tokens, s.samples) for s in b] == [(2, True)]
    assert seq.num_output_tokens == 1 and seq.num_computed_tokens == 50
    b = h.step()
    assert [(s.num_new_tokens, s.samples) for s in b] == [(1, True)]
    h.run()
    assert seq.is_finished and seq.finish_reason == "length"
    assert seq.output_token_ids == expected_output("a", 50, 3)
    assert [s["sampled"] for s in h.steps] == [[], [], [], ["a"], ["a"], ["a"]]


def test_a_long_prompt_is_cut_into_chunks_and_a_short_one_goes_whole():
    """A CPP group's chunking: prompts of at least ``chunk_min_prompt_tokens`` compute
    ``prefill_chunk_tokens`` per step; a shorter one takes the step's budget, in one chunk."""
    h = Harness(budget=40, block_size=4, num_blocks=64, prefill_chunk_tokens=8, chunk_min_prompt_tokens=24)
    short, long = h.add(make_seq("short", list(range(23)), max_tokens=1)), h.add(make_seq("long", list(range(30)), 1))
    assert [(s.seq.request_id, s.num_new_tokens) for s in h.step()] == [("short", 23), ("long", 8)]
    assert [s.num_new_tokens for s in h.step()] == [8]
    h.run()
    assert short.is_finished and long.is_finished
    with pytest.raises(ValueError):
        EngineConfig(device="cpu", prefill_chunk_tokens=0)


def test_token_budget_respected_and_everything_finishes():
    h = Harness(budget=24, block_size=4, num_blocks=256)
    rng = random.Random(7)
    seqs = []
    for i in range(12):
        n = rng.randrange(1, 60)
        seqs.append(h.add(make_seq(f"r{i}", [rng.randrange(900) for _ in range(n)], rng.randrange(1, 8))))
    h.run()
    for s in seqs:
        assert s.num_output_tokens == s.params.max_tokens
        assert s.output_token_ids == expected_output(s.request_id, s.num_prompt_tokens, s.params.max_tokens)
    # the budget was used fully whenever there was enough work
    assert max(sum(n for _, n in st["batch"]) for st in h.steps) == 24


def test_decodes_scheduled_before_new_prefills():
    h = Harness(budget=8, block_size=4, num_blocks=64)
    a = h.add(make_seq("a", [1, 2, 3], 10))
    b = h.add(make_seq("b", [4, 5], 10))
    c = h.add(make_seq("c", [6, 7, 8], 10))
    first = h.step()
    assert [(s.seq.request_id, s.num_new_tokens) for s in first] == [("a", 3), ("b", 2), ("c", 3)]
    d = h.add(make_seq("d", list(range(100, 120)), 2))
    batch = h.step()
    # three decodes of one token each first, then d gets the rest of the budget
    assert [(s.seq.request_id, s.num_new_tokens) for s in batch] == [
        ("a", 1), ("b", 1), ("c", 1), ("d", 5)
    ]
    assert [s.samples for s in batch] == [True, True, True, False]
    batch = h.step()
    assert [(s.seq.request_id, s.num_new_tokens) for s in batch] == [
        ("a", 1), ("b", 1), ("c", 1), ("d", 5)
    ]
    h.run()
    for s in (a, b, c, d):
        assert s.num_output_tokens == s.params.max_tokens


def test_samples_only_on_last_chunk():
    h = Harness(budget=7, block_size=4, num_blocks=64)
    seq = h.add(make_seq("x", list(range(30)), 1))
    chunks = []
    while h.sched.has_unfinished():
        for s in h.step():
            chunks.append((s.num_new_tokens, s.samples))
    assert chunks == [(7, False), (7, False), (7, False), (7, False), (2, True)]
    assert seq.num_output_tokens == 1
    h.run()


def test_max_num_seqs_respected():
    h = Harness(budget=64, block_size=4, num_blocks=128, max_num_seqs=2)
    seqs = [h.add(make_seq(f"s{i}", [i + 1] * 5, 3)) for i in range(5)]
    b = h.step()
    assert [s.seq.request_id for s in b] == ["s0", "s1"]
    assert len(h.sched.running) == 2 and len(h.sched.waiting) == 3
    h.run()
    assert max(len(st["batch"]) for st in h.steps) <= 2
    assert all(s.num_output_tokens == 3 for s in seqs)
    # FIFO admission
    order = []
    for st in h.steps:
        order += st["newly"]
    assert order == ["s0", "s1", "s2", "s3", "s4"]


def test_admission_waits_for_blocks():
    # 6 blocks of 4 tokens; each prompt of 8 tokens takes 2 blocks (3 once it decodes).
    h = Harness(budget=64, block_size=4, num_blocks=6, prefix=False)
    seqs = [h.add(make_seq(f"s{i}", [10 * i + j for j in range(8)], 1)) for i in range(4)]
    b = h.step()
    assert [s.seq.request_id for s in b] == ["s0", "s1", "s2"]
    assert [s.request_id for s in h.sched.waiting] == ["s3"]
    assert seqs[3].block_table.block_ids == [] and seqs[3].num_computed_tokens == 0
    # All three finish after their single sampled token, freeing blocks for s3.
    assert all(s.is_finished for s in seqs[:3])
    b = h.step()
    assert [s.seq.request_id for s in b] == ["s3"]
    h.run()
    assert seqs[3].num_output_tokens == 1


def test_admission_stops_at_first_that_does_not_fit():
    # FIFO: a big head-of-line request blocks smaller ones behind it.
    h = Harness(budget=100, block_size=4, num_blocks=10, prefix=False)
    a = h.add(make_seq("a", list(range(20)), 4))  # 5 blocks
    b = h.add(make_seq("b", list(range(24)), 1))  # 6 blocks: does not fit next to a
    c = h.add(make_seq("c", [1, 2], 1))  # would fit, but is behind b
    batch = h.step()
    assert [s.seq.request_id for s in batch] == ["a"]
    assert [s.request_id for s in h.sched.waiting] == ["b", "c"]
    assert b.block_table.block_ids == [] and b.num_computed_tokens == 0
    h.run()
    assert [s.num_output_tokens for s in (a, b, c)] == [4, 1, 1]


def test_preemption_of_most_recent_and_recompute():
    bs = 4
    h = Harness(budget=64, block_size=bs, num_blocks=6, prefix=False)
    # Each prompt of 8 tokens fills 2 blocks; the first decode needs a 3rd.
    seqs = [h.add(make_seq(f"p{i}", [100 * i + j for j in range(8)], 8)) for i in range(3)]
    b = h.step()
    assert [s.seq.request_id for s in b] == ["p0", "p1", "p2"]
    assert h.bm.pool.num_free == 0
    # Next step: p0 decodes position 8, needs a 3rd block: p2 (most recent) is preempted,
    # which frees 2 blocks, enough for p0 and p1.
    b = h.step()
    st = h.steps[-1]
    assert st["preempted"] == 1
    assert st["newly"] == []
    assert [(c.seq.request_id, c.num_new_tokens) for c in b] == [("p0", 1), ("p1", 1)]
    assert h.bm.pool.num_free == 0
    p2 = seqs[2]
    assert p2.status is SequenceStatus.WAITING
    assert h.sched.waiting[0] is p2
    assert p2.block_table.block_ids == [] and p2.num_computed_tokens == 0
    assert p2.num_preemptions == 1
    assert p2.num_output_tokens == 1  # the token it sampled is kept
    h.run()
    assert h.sched.num_preemptions >= 1
    for s in seqs:
        assert s.is_finished
        assert s.num_output_tokens == 8
        assert s.output_token_ids == expected_output(s.request_id, 8, 8)
    # a step with a preemption never admits
    for st in h.steps:
        if st["preempted"]:
            assert st["newly"] == []


def test_preempted_sequence_recomputes_prompt_and_outputs_in_chunks():
    bs = 4
    h = Harness(budget=5, block_size=bs, num_blocks=5, prefix=False)
    a = h.add(make_seq("a", list(range(8)), 10))  # grows to 18 tokens: 5 blocks
    b = h.add(make_seq("b", list(range(50, 53)), 8))  # grows to 11 tokens: 3 blocks
    h.run()
    assert a.output_token_ids == expected_output("a", 8, 10)
    assert b.output_token_ids == expected_output("b", 3, 8)
    assert h.sched.num_preemptions >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    # after its preemption b's recompute never samples before it catches up
    for st in h.steps:
        assert sum(n for _, n in st["batch"]) <= 5


def test_running_sequence_preempts_itself_when_it_is_the_most_recent():
    bs = 4
    h = Harness(budget=64, block_size=bs, num_blocks=3, prefix=False)
    a = h.add(make_seq("a", list(range(5)), 3))  # 2 blocks, never needs a 3rd
    b = h.add(make_seq("b", list(range(10, 13)), 4))  # 1 block, needs a 2nd at position 4
    h.step()
    assert h.bm.pool.num_free == 0
    h.step()  # a computes position 5, b position 3
    b_ids = list(b.block_table.block_ids)
    chunks = h.step()  # b needs a block for position 4: the most recent running one is b itself
    assert [(c.seq.request_id, c.num_new_tokens) for c in chunks] == [("a", 1)]
    assert h.steps[-1]["preempted"] == 1
    assert b.status is SequenceStatus.WAITING and h.sched.waiting[0] is b
    assert b.block_table.block_ids == [] and b.num_computed_tokens == 0
    assert all(h.bm.pool.ref_counts[x] == 0 for x in b_ids)
    assert b.num_output_tokens == 2
    h.run()
    assert a.output_token_ids == expected_output("a", 5, 3)
    assert b.output_token_ids == expected_output("b", 3, 4)


def test_sequence_that_fills_the_pool_exactly():
    bs = 4
    h = Harness(budget=64, block_size=bs, num_blocks=4, prefix=True)
    a = h.add(make_seq("a", list(range(6)), 10))  # 16 tokens = 4 blocks: fits exactly
    h.run()
    assert a.output_token_ids == expected_output("a", 6, 10)
    assert h.sched.num_preemptions == 0


def test_finish_running_and_waiting_frees_blocks():
    h = Harness(budget=8, block_size=4, num_blocks=8)
    a = h.add(make_seq("a", list(range(20)), 4))
    b = h.add(make_seq("b", list(range(100, 110)), 4))
    h.step()  # a gets 8 tokens of prefill; b waits (budget spent)
    assert a.status is SequenceStatus.RUNNING and a.block_table.block_ids
    assert b.status is SequenceStatus.WAITING
    in_use = h.bm.pool.num_in_use
    assert in_use == 2
    h.sched.finish(a, "abort")
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "abort"
    assert a.block_table.block_ids == []
    assert a not in h.sched.running
    assert h.bm.pool.num_in_use == 0
    h.check()
    h.sched.finish(b, "abort")
    assert b.status is SequenceStatus.FINISHED and b not in h.sched.waiting
    assert not h.sched.has_unfinished()
    h.check()
    assert h.bm.pool.num_in_use == 0
    # a's committed prompt blocks stay in the prefix cache
    assert h.bm.pool.num_cached_unused == 2
    assert h.sched.schedule() == []


def test_prefix_cache_hit_on_admission():
    bs = 4
    h = Harness(budget=64, block_size=bs, num_blocks=32)
    prompt = list(range(17))
    a = h.add(make_seq("a", prompt, 2))
    h.run()
    b = h.add(make_seq("b", prompt, 2))
    batch = h.step()
    assert batch[0].seq is b
    assert b.num_cached_tokens == 16
    assert batch[0].num_new_tokens == 1 and batch[0].samples
    h.run()
    assert b.output_token_ids == expected_output("b", 17, 2)
    assert a.num_cached_tokens == 0


def test_prefix_hit_rate_counts_each_request_once():
    # "b" shares 2 of its 3 full blocks with "a" but waits for blocks for several steps
    # (it is looked up again each step): the hit rate still counts its prompt once.
    bs = 4
    h = Harness(budget=64, block_size=bs, num_blocks=6)
    prompt = list(range(12))
    a = h.add(make_seq("a", prompt + [99] * 4, 6))
    h.step()
    b = h.add(make_seq("b", prompt[:8] + [77] * 5, 1))
    for _ in range(3):
        h.step()
        assert b in h.sched.waiting
    h.run()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 8
    assert h.sched.num_prompt_tokens_admitted == 16 + 13
    assert h.sched.num_prompt_tokens_hit == 8
    assert h.sched.prefix_cache_hit_rate() == 8 / 29


def test_shared_prefix_concurrent_sequences_share_blocks():
    bs = 4
    h = Harness(budget=64, block_size=bs, num_blocks=32)
    prefix = list(range(12))
    a = h.add(make_seq("a", prefix + [50], 5))
    h.step()
    b = h.add(make_seq("b", prefix + [60, 61], 5))
    h.step()
    assert b.num_cached_tokens == 12
    assert b.block_table.block_ids[:3] == a.block_table.block_ids[:3]
    for blk in a.block_table.block_ids[:3]:
        assert h.bm.pool.ref_counts[blk] == 2
    h.run()
    assert a.num_output_tokens == 5 and b.num_output_tokens == 5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_under_memory_pressure(seed):
    rng = random.Random(seed)
    bs = 4
    nb = 12
    h = Harness(budget=rng.choice([8, 16, 32]), block_size=bs, num_blocks=nb, max_num_seqs=6)
    prefixes = [[rng.randrange(500) for _ in range(rng.choice([4, 8]))] for _ in range(3)]
    seqs = []
    pending = []
    for i in range(30):
        prompt = list(rng.choice(prefixes)) + [rng.randrange(500) for _ in range(rng.randrange(1, 20))]
        max_tokens = rng.randrange(1, 15)
        assert len(prompt) + max_tokens <= nb * bs
        pending.append(make_seq(f"q{seed}-{i}", prompt, max_tokens))
    steps = 0
    while pending or h.sched.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                seqs.append(h.add(pending.pop(0)))
        if h.sched.has_unfinished():
            h.step()
        steps += 1
        assert steps < 5000
    h.run()
    for s in seqs:
        assert s.is_finished
        assert s.output_token_ids == expected_output(s.request_id, s.num_prompt_tokens, s.params.max_tokens)
    assert h.sched.num_preemptions > 0
    assert h.sched.num_prompt_tokens_hit > 0


# -- a decode instance: received sequences join the running batch past max_num_seqs -------------
@pytest.mark.parametrize("budget,max_num_seqs", [(64, 4), (3, 8)])
def test_received_sequences_beyond_a_step_take_turns(budget, max_num_seqs):
    h = Harness(budget=budget, block_size=4, num_blocks=128, max_num_seqs=max_num_seqs)
    received = [h.add_received(make_seq(f"r{i}", [i + 1] * 5, 8)) for i in range(10)]
    late = h.add(make_seq("late", [7] * 3, 2))
    per_step = min(budget, max_num_seqs)
    rounds = -(-len(received) // per_step)  # steps for every one of them to get a turn
    last_turn = {s.request_id: 0 for s in received}
    step = 0
    while any(not s.is_finished for s in received):
        step += 1
        running = len(h.sched.running)
        chunks = h.step()
        if running >= per_step:
            assert len(chunks) == per_step
        for c in chunks:
            last_turn[c.seq.request_id] = step
        for s in h.sched.running:
            if s.request_id in last_turn:
                assert step - last_turn[s.request_id] < rounds, f"{s.request_id} waited too long"
        # The queued request waits while the received ones fill the steps.
        if len(h.sched.running) >= max_num_seqs:
            assert late.status is SequenceStatus.WAITING
    h.run()
    for s in received + [late]:
        assert s.output_token_ids == expected_output(s.request_id, s.num_prompt_tokens, s.params.max_tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_received_sequences_under_memory_pressure(seed):
    # Rotating turns and preemption together: a victim is never one already in the batch (the
    # harness checks every scheduled sequence is still running).
    rng = random.Random(seed)
    h = Harness(budget=rng.choice([4, 8, 16]), block_size=4, num_blocks=16, max_num_seqs=3)
    seqs = []
    for i in range(20):
        seq = make_seq(f"m{seed}-{i}", [rng.randrange(500) for _ in range(rng.randrange(1, 9))], rng.randrange(8, 20))
        if rng.random() < 0.6 and h.bm.can_grow(seq.block_table, seq.num_prompt_tokens):
            seqs.append(h.add_received(seq))
        else:
            seqs.append(h.add(seq))
        if rng.random() < 0.5:
            h.step()
    h.run()
    for s in seqs:
        assert s.output_token_ids == expected_output(s.request_id, s.num_prompt_tokens, s.params.max_tokens)
    assert h.sched.num_preemptions > 0
