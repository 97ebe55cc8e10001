"""Paged KV bookkeeping: prefix keys, the block pool, block tables and the block manager."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from paged_kv import BlockManager, BlockPool, BlockTable, OutOfBlocks, block_key, chain_keys
from paged_kv.block_pool import Retention
from paged_kv.prefix_keys import reusable_keys, salt_root

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# prefix keys
# --------------------------------------------------------------------------------------------
def test_chain_keys_equal_prefixes_give_equal_keys():
    a = list(range(40))
    b = list(range(40)) + [999, 998, 997]
    ka, kb = chain_keys(a, 8), chain_keys(b, 8)
    assert len(ka) == 5 and len(kb) == 5
    assert ka == kb
    assert len(set(ka)) == 5
    assert all(isinstance(k, bytes) and len(k) == 16 for k in ka)


def test_chain_keys_change_propagates_forward_only():
    bs, nblocks = 4, 6
    base = list(range(100, 100 + bs * nblocks))
    ref = chain_keys(base, bs)
    for i in range(nblocks):
        for off in (0, bs - 1):
            mod = list(base)
            mod[i * bs + off] += 1
            keys = chain_keys(mod, bs)
            assert keys[:i] == ref[:i]
            for j in range(i, nblocks):
                assert keys[j] != ref[j]


def test_chain_keys_commit_to_whole_prefix_not_just_block():
    # Block 1 is identical in both, but block 0 differs: block 1's key must differ.
    a = [1, 2, 3, 4, 9, 9, 9, 9]
    b = [5, 6, 7, 8, 9, 9, 9, 9]
    assert chain_keys(a, 4)[1] != chain_keys(b, 4)[1]
    # And the chain equals block_key folded by hand.
    k0 = block_key(None, a[:4])
    assert chain_keys(a, 4) == [k0, block_key(k0, a[4:])]


def test_chain_keys_partial_trailing_block_has_no_key():
    assert chain_keys([1, 2, 3], 4) == []
    assert chain_keys([], 4) == []
    assert len(chain_keys(list(range(11)), 4)) == 2
    assert chain_keys(list(range(11)), 4) == chain_keys(list(range(8)), 4)
    assert len(chain_keys(list(range(12)), 4)) == 3


def test_chain_keys_parent_continues_chain():
    toks = list(range(32))
    full = chain_keys(toks, 8)
    tail = chain_keys(toks[16:], 8, parent=full[1])
    assert tail == full[2:]


def test_chain_keys_rejects_bad_block_size():
    with pytest.raises(ValueError):
        chain_keys([1, 2, 3], 0)


def test_prefix_keys_stable_across_processes():
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]
    here = [k.hex() for k in chain_keys(toks, 8)]
    code = (
        "from paged_kv import chain_keys\n"
        f"print(','.join(k.hex() for k in chain_keys({toks!r}, 8)))\n"
    )
    outs = []
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
            check=True, timeout=60,
        )
        outs.append(res.stdout.strip().split(","))
    assert outs[0] == here
    assert outs[1] == here


# --------------------------------------------------------------------------------------------
# BlockPool
# --------------------------------------------------------------------------------------------
def _key(i: int) -> bytes:
    return block_key(None, [i])


def test_pool_rejects_nonpositive_size():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_allocate_release_refcounts():
    pool = BlockPool(8)
    pool.check_integrity()
    a = pool.allocate(3)
    assert len(set(a)) == 3
    assert all(pool.ref_counts[b] == 1 for b in a)
    assert pool.num_free == 5 and pool.num_in_use == 3
    assert pool.usage() == pytest.approx(3 / 8)
    pool.check_integrity()
    pool.acquire(a[:2])
    assert [pool.ref_counts[b] for b in a] == [2, 2, 1]
    pool.release(a)
    assert [pool.ref_counts[b] for b in a] == [1, 1, 0]
    assert pool.num_free == 6
    pool.check_integrity()
    pool.release(a[:2])
    assert pool.num_free == 8 and pool.num_in_use == 0
    pool.check_integrity()


def test_pool_double_free_raises():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.release(a)
    with pytest.raises(RuntimeError):
        pool.release([a[0]])
    pool.check_integrity()
    assert pool.num_free == 4


def test_pool_out_of_blocks():
    pool = BlockPool(4)
    a = pool.allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    # A failed allocation takes nothing.
    assert pool.num_free == 1
    pool.check_integrity()
    b = pool.allocate(1)
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.release(a + b)
    pool.check_integrity()
    assert pool.num_free == 4
    assert isinstance(OutOfBlocks("x"), RuntimeError)


def test_pool_cached_blocks_evicted_only_when_no_free_block():
    pool = BlockPool(6)
    a = pool.allocate(2)
    for i, b in enumerate(a):
        pool.register(b, _key(i))
    pool.release(a)
    assert pool.num_cached_unused == 2
    assert pool.num_free == 6
    pool.check_integrity()
    # Four genuinely free blocks remain: allocating them must not touch the cache.
    c = pool.allocate(4)
    assert not set(c) & set(a)
    assert pool.num_evictions == 0
    assert pool.lookup([_key(0), _key(1)]) == a
    pool.check_integrity()
    # Now the next allocation must evict.
    d = pool.allocate(1)
    assert d[0] in a
    assert pool.num_evictions == 1
    assert pool.keys[d[0]] is None
    pool.check_integrity()
    pool.release(c + d)
    pool.check_integrity()


def test_pool_lru_order_tail_first_within_table():
    pool = BlockPool(6)
    t1 = pool.allocate(3)
    for i, b in enumerate(t1):
        pool.register(b, _key(10 + i))
    t2 = pool.allocate(2)
    for i, b in enumerate(t2):
        pool.register(b, _key(20 + i))
    pool.release(t2)  # released first: oldest, tail first
    pool.release(t1)
    pool.check_integrity()
    expected = [t2[1], t2[0], t1[2], t1[1], t1[0]]
    filler = pool.allocate(1)  # the one free block
    assert filler[0] not in t1 + t2
    evicted = [pool.allocate(1)[0] for _ in range(5)]
    assert evicted == expected
    assert pool.num_evictions == 5
    assert pool.cached_keys() == []
    pool.check_integrity()
    pool.release(filler + evicted)
    pool.check_integrity()


def test_pool_acquire_cached_block_removes_it_from_evictable():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.register(a[0], _key(1))
    pool.register(a[1], _key(2))
    pool.release(a)
    assert pool.num_cached_unused == 2
    hit = pool.lookup([_key(1)])
    assert hit == [a[0]]
    pool.acquire(hit)
    assert pool.ref_counts[a[0]] == 1
    assert pool.num_cached_unused == 1
    assert pool.num_free == 2
    pool.check_integrity()
    # Exhaust everything else: the acquired block is never handed out.
    rest = pool.allocate(2)
    assert a[0] not in rest
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    assert pool.keys[a[0]] == _key(1)
    assert pool.lookup([_key(1)]) == [a[0]]
    pool.check_integrity()
    pool.release(rest + hit)
    pool.check_integrity()


def test_pool_lookup_longest_prefix():
    pool = BlockPool(4)
    a = pool.allocate(3)
    keys = [_key(i) for i in range(3)]
    for b, k in zip(a, keys):
        pool.register(b, k)
    assert pool.lookup(keys) == a
    assert pool.lookup([keys[0], _key(99), keys[2]]) == [a[0]]
    assert pool.lookup([_key(99)] + keys) == []
    # lookup takes no reference
    assert [pool.ref_counts[b] for b in a] == [1, 1, 1]
    pool.release(a)
    pool.check_integrity()


def test_pool_register_twice_and_duplicate_key():
    pool = BlockPool(5)
    a, b, c = pool.allocate(3)
    with pytest.raises(RuntimeError):
        pool.register(pool._free[0], _key(0))  # unreferenced block
    pool.register(a, _key(1))
    pool.register(a, _key(2))  # second register of a keyed block is ignored
    assert pool.keys[a] == _key(1)
    assert pool.lookup([_key(2)]) == []
    # duplicate key on another block: the index keeps the older block
    pool.register(b, _key(1))
    assert pool.keys[b] == _key(1)
    assert pool.lookup([_key(1)]) == [a]
    assert pool.cached_keys() == [_key(1)]
    pool.check_integrity()
    pool.release([a, b, c])
    assert pool.num_cached_unused == 2  # both keyed copies are cached
    pool.check_integrity()
    # Evict: free ones first (c plus the 2 untouched), then LRU: release order was c, b, a.
    got = pool.allocate(3)
    assert set(got) & {a, b} == set()
    evicted = pool.allocate(1)[0]
    assert evicted == b  # the unreachable duplicate goes first (released before a)
    assert pool.lookup([_key(1)]) == [a]  # evicting the duplicate keeps a's index entry
    pool.check_integrity()
    evicted2 = pool.allocate(1)[0]
    assert evicted2 == a
    assert pool.lookup([_key(1)]) == []
    pool.check_integrity()
    pool.release(got + [evicted, evicted2])
    pool.check_integrity()
    assert pool.num_free == 5 and pool.num_cached_unused == 0


def test_pool_reset_prefix_cache():
    pool = BlockPool(6)
    a = pool.allocate(4)
    for i, b in enumerate(a):
        pool.register(b, _key(i))
    pool.release(a[2:])  # two cached, two in use (keyed)
    assert pool.num_cached_unused == 2
    pool.reset_prefix_cache()
    pool.check_integrity()
    assert pool.num_cached_unused == 0
    assert pool.cached_keys() == []
    assert pool.lookup([_key(0)]) == []
    assert all(k is None for k in pool.keys)
    assert pool.num_free == 4 and pool.num_in_use == 2
    # in-use blocks stay referenced; releasing them makes them free, not cached
    pool.release(a[:2])
    assert pool.num_cached_unused == 0
    assert pool.num_free == 6
    pool.check_integrity()


# --------------------------------------------------------------------------------------------
# BlockManager
# --------------------------------------------------------------------------------------------
def _fill(bm: BlockManager, toks: list[int]) -> BlockTable:
    """Run a whole prompt through: match, grow, commit. Returns the table."""
    t = BlockTable()
    bm.match_prefix(t, toks)
    bm.grow(t, len(toks))
    bm.commit(t, toks, len(toks))
    return t


def test_bm_rejects_bad_block_size():
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_bm_exact_multiple_prompt_hits_all_but_last_block():
    bs = 4
    bm = BlockManager(16, bs)
    toks = list(range(3 * bs))
    t1 = _fill(bm, toks)
    assert len(t1.keys) == 3
    ids = list(t1.block_ids)
    bm.free(t1)
    bm.check_integrity()
    assert bm.pool.num_cached_unused == 3
    t2 = BlockTable()
    assert bm.match_prefix(t2, toks) == 2 * bs
    assert t2.block_ids == ids[:2]
    assert t2.keys == chain_keys(toks, bs)[:2]
    bm.check_integrity()
    bm.free(t2)
    bm.check_integrity()


def test_bm_prompt_of_k_blocks_plus_one_hits_k_blocks():
    bs = 4
    bm = BlockManager(16, bs)
    toks = list(range(3 * bs + 1))
    t1 = _fill(bm, toks)
    ids = list(t1.block_ids)
    assert len(ids) == 4 and len(t1.keys) == 3
    bm.free(t1)
    t2 = BlockTable()
    assert bm.match_prefix(t2, toks) == 3 * bs
    assert t2.block_ids == ids[:3]
    bm.grow(t2, len(toks))
    assert len(t2.block_ids) == 4
    bm.check_integrity()
    # a longer prompt with the same prefix hits too; a diverging one hits less
    t3 = BlockTable()
    assert bm.match_prefix(t3, toks[:bs] + [777] * (2 * bs + 1)) == bs
    assert t3.block_ids == ids[:1]
    assert bm.pool.ref_counts[ids[0]] == 2
    bm.free(t2)
    bm.free(t3)
    bm.check_integrity()
    # short prompts never hit
    t4 = BlockTable()
    assert bm.match_prefix(t4, toks[:bs]) == 0
    assert bm.match_prefix(t4, toks[:1]) == 0
    assert t4.block_ids == []
    bm.check_integrity()


def test_bm_match_prefix_on_nonempty_table_raises():
    bm = BlockManager(4, 4)
    t = BlockTable()
    bm.grow(t, 3)
    with pytest.raises(RuntimeError):
        bm.match_prefix(t, [1, 2, 3])
    bm.free(t)
    bm.check_integrity()


def test_bm_commit_publishes_only_full_computed_blocks():
    bs = 4
    bm = BlockManager(16, bs)
    toks = list(range(10))
    t = BlockTable()
    bm.grow(t, len(toks))
    assert len(t.block_ids) == 3
    bm.commit(t, toks, 3)
    assert t.keys == [] and bm.pool.cached_keys() == []
    bm.commit(t, toks, 4)
    assert t.keys == chain_keys(toks, bs)[:1]
    bm.commit(t, toks, 7)
    assert len(t.keys) == 1
    bm.commit(t, toks, 10)  # block 2 (tokens 8,9) is partial
    assert t.keys == chain_keys(toks, bs)
    assert len(t.keys) == 2
    assert set(bm.pool.cached_keys()) == set(t.keys)
    assert bm.pool.keys[t.block_ids[2]] is None
    # committing again is idempotent
    bm.commit(t, toks, 10)
    assert len(t.keys) == 2
    bm.check_integrity()
    bm.free(t)
    assert t.block_ids == [] and t.keys == []
    assert bm.pool.num_cached_unused == 2
    bm.check_integrity()


def test_bm_shared_prefix_shares_physical_blocks():
    bs = 4
    bm = BlockManager(16, bs)
    prefix = list(range(2 * bs))
    a_toks = prefix + [100, 101, 102]
    b_toks = prefix + [200, 201, 202, 203, 204]
    a = _fill(bm, a_toks)
    b = BlockTable()
    assert bm.match_prefix(b, b_toks) == 2 * bs
    bm.grow(b, len(b_toks))
    assert b.block_ids[:2] == a.block_ids[:2]
    assert set(b.block_ids[2:]).isdisjoint(a.block_ids)
    for blk in a.block_ids[:2]:
        assert bm.pool.ref_counts[blk] == 2
    bm.commit(b, b_toks, len(b_toks))
    assert len(b.keys) == 3
    bm.check_integrity()
    in_use = bm.pool.num_in_use
    assert in_use == 3 + 2  # 3 for a, 2 private for b
    a_ids = list(a.block_ids)
    bm.free(a)
    bm.check_integrity()
    # b's shared blocks stay referenced and keyed
    for blk in b.block_ids[:2]:
        assert bm.pool.ref_counts[blk] == 1
        assert bm.pool.keys[blk] is not None
    assert bm.pool.ref_counts[a_ids[2]] == 0
    # Fill the pool completely: b's blocks must never be handed out.
    other = BlockTable()
    bm.grow(other, bm.pool.num_free * bs)
    assert set(other.block_ids).isdisjoint(b.block_ids)
    assert bm.pool.num_free == 0
    bm.check_integrity()
    bm.free(other)
    bm.free(b)
    bm.check_integrity()
    assert bm.pool.num_in_use == 0


def test_a_salted_table_shares_blocks_only_under_its_own_salt():
    """Issue 52 item 3: a cache salt roots the chain, so equal prompts under different salts (two
    users under --cache-scope per-key) never hit each other's blocks; under one salt they do."""
    bs = 4
    bm = BlockManager(16, bs)
    toks = list(range(3 * bs))
    assert salt_root(None) is None and salt_root("alice") != salt_root("bob")
    alice = BlockTable(root=salt_root("alice"))
    assert bm.match_prefix(alice, toks) == 0
    bm.grow(alice, len(toks))
    bm.commit(alice, toks, len(toks))
    assert alice.keys == chain_keys(toks, bs, salt_root("alice"))
    assert set(alice.keys).isdisjoint(chain_keys(toks, bs))  # nothing shared with the unsalted chain
    for root, hit in ((None, 0), (salt_root("bob"), 0), (salt_root("alice"), 2 * bs)):
        probe = BlockTable(root=root)
        assert bm.match_prefix(probe, toks) == hit, root
        bm.free(probe)
    # What the Conductor and the instances look up (reusable_keys) is the same salted chain.
    assert reusable_keys(toks, bs, "alice") == alice.keys[:2]
    bm.free(alice)
    bm.check_integrity()


def test_bm_blocks_needed_can_grow_grow_arithmetic():
    bs = 4
    bm = BlockManager(5, bs)
    t = BlockTable()
    assert bm.blocks_needed(t, 0) == 0
    assert bm.blocks_needed(t, 1) == 1
    assert bm.blocks_needed(t, 4) == 1
    assert bm.blocks_needed(t, 5) == 2
    assert bm.blocks_needed(t, 20) == 5
    assert bm.can_grow(t, 20)
    assert not bm.can_grow(t, 21)
    bm.grow(t, 6)
    assert len(t.block_ids) == 2
    assert bm.blocks_needed(t, 8) == 0
    assert bm.blocks_needed(t, 3) == 0  # never negative
    bm.grow(t, 8)
    assert len(t.block_ids) == 2
    assert bm.blocks_needed(t, 9) == 1
    assert bm.can_grow(t, 20) and not bm.can_grow(t, 21)
    with pytest.raises(OutOfBlocks):
        bm.grow(t, 21)
    assert len(t.block_ids) == 2
    bm.check_integrity()
    bm.grow(t, 20)
    assert len(t.block_ids) == 5 and bm.pool.num_free == 0
    # slot mapping
    for pos in (0, 3, 4, 19):
        assert t.slot(pos, bs) == t.block_ids[pos // bs] * bs + pos % bs
    bm.check_integrity()
    bm.free(t)
    bm.check_integrity()
    assert bm.pool.num_free == 5


def test_bm_disabled_prefix_caching_never_hits():
    bs = 4
    bm = BlockManager(8, bs, enable_prefix_caching=False)
    toks = list(range(3 * bs + 1))
    t = _fill(bm, toks)
    assert t.keys == []
    assert bm.pool.cached_keys() == []
    bm.free(t)
    assert bm.pool.num_cached_unused == 0
    t2 = BlockTable()
    assert bm.match_prefix(t2, toks) == 0
    assert t2.block_ids == []
    bm.check_integrity()


def test_bm_random_stress():
    rng = random.Random(1234)
    bs = 4
    num_blocks = 48
    bm = BlockManager(num_blocks, bs)
    # A few shared "system prompts" so prefix hits and sharing happen often.
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    # table id -> (table, tokens, num_computed)
    live: dict[int, list] = {}
    next_id = 0
    stats = {"hits": 0, "oob": 0, "alloc": 0, "free": 0, "grow": 0}

    def check():
        bm.check_integrity()
        pool = bm.pool
        owners: dict[int, list[int]] = {}
        for tid, (t, toks, comp) in live.items():
            assert len(set(t.block_ids)) == len(t.block_ids)
            assert len(t.keys) <= len(t.block_ids)
            assert t.keys == chain_keys(toks, bs)[: len(t.keys)]
            for i, blk in enumerate(t.block_ids):
                owners.setdefault(blk, []).append(tid)
            for i, k in enumerate(t.keys):
                # every committed block still carries its key (no reset in this test)
                assert pool.keys[t.block_ids[i]] == k
        for blk, tids in owners.items():
            assert pool.ref_counts[blk] == len(tids), (blk, tids)
            if len(tids) > 1:
                # only a full, keyed prefix block may be shared, at the same logical index
                key = pool.keys[blk]
                assert key is not None
                idxs = {live[tid][0].block_ids.index(blk) for tid in tids}
                assert len(idxs) == 1
                (idx,) = idxs
                for tid in tids:
                    t, toks, _ = live[tid]
                    assert idx < len(t.keys) and t.keys[idx] == key
        for blk in range(num_blocks):
            if blk not in owners:
                assert pool.ref_counts[blk] == 0

    for _ in range(3000):
        op = rng.random()
        if op < 0.3 or not live:
            # allocate a new table: prefix + random suffix, match, grow for the first chunk
            toks = list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            t = BlockTable()
            cached = bm.match_prefix(t, toks)
            assert cached % bs == 0 and cached <= len(toks) - 1
            if cached:
                stats["hits"] += 1
            chunk = min(len(toks), cached + rng.randrange(1, 9))
            if bm.can_grow(t, chunk):
                bm.grow(t, chunk)
                live[next_id] = [t, toks, cached]
                next_id += 1
                stats["alloc"] += 1
            else:
                with pytest.raises(OutOfBlocks):
                    bm.grow(t, chunk)
                bm.free(t)
                stats["oob"] += 1
        elif op < 0.6:
            # advance a table: compute what is allocated, commit, then maybe append + grow
            tid = rng.choice(list(live))
            entry = live[tid]
            t, toks, comp = entry
            capacity = len(t.block_ids) * bs
            new_comp = min(len(toks), capacity, comp + rng.randrange(1, 9))
            entry[2] = new_comp
            bm.commit(t, toks, new_comp)
            if new_comp == len(toks):
                toks.append(rng.randrange(50))  # a "sampled" token
            target = min(len(toks), new_comp + rng.randrange(1, 9))
            if bm.can_grow(t, target):
                bm.grow(t, target)
                stats["grow"] += 1
            else:
                stats["oob"] += 1
        elif op < 0.75:
            tid = rng.choice(list(live))
            t, toks, comp = live[tid]
            bm.commit(t, toks, comp)  # commit is idempotent
        else:
            tid = rng.choice(list(live))
            t = live.pop(tid)[0]
            bm.free(t)
            assert t.block_ids == [] and t.keys == []
            stats["free"] += 1
        check()

    for tid in list(live):
        bm.free(live.pop(tid)[0])
    check()
    assert bm.pool.num_in_use == 0
    assert bm.pool.num_free == num_blocks
    # The scenario actually exercised sharing, hits, exhaustion and eviction.
    assert stats["hits"] > 50
    assert stats["oob"] > 10
    assert bm.pool.num_evictions > 10


# -- soft retention (issue 42) ------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _cached(pool: BlockPool, n: int, first_key: int, retain: Retention | None = None) -> list[int]:
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.register(b, _key(first_key + i))
    pool.release(blocks, retain)
    return blocks


def test_retained_blocks_are_evicted_after_cold_ones_and_never_block_an_allocation():
    clock = _Clock()
    pool = BlockPool(8, retained_share=0.5, clock=clock)
    session = _cached(pool, 3, 0, Retention(until=clock.now + 60))
    cold = _cached(pool, 3, 10)  # released later: under plain LRU the session's would go first
    assert pool.num_retained == 3 and pool.num_free == 8
    pool.check_integrity()
    taken = pool.allocate(5)  # 2 free blocks, then the 3 cold ones; the session's stay
    assert set(cold) <= set(taken) and pool.lookup([_key(0), _key(1), _key(2)]) == session
    more = pool.allocate(2)  # nothing cold is left: retention is a bias, not a pin
    assert set(more) <= set(session) and pool.num_retained_evictions == 2
    assert pool.num_free == 1
    pool.check_integrity()


def test_an_expired_retention_goes_first_and_priority_orders_the_rest():
    clock = _Clock()
    pool = BlockPool(6, retained_share=1.0, clock=clock)
    low = _cached(pool, 2, 0, Retention(clock.now + 60, priority=-1))
    high = _cached(pool, 2, 10, Retention(clock.now + 60, priority=5))
    expired = _cached(pool, 2, 20, Retention(clock.now + 1, priority=9))
    clock.now += 2
    assert set(pool.allocate(2)) == set(expired)
    assert pool.num_retained_evictions == 0  # its deadline had passed
    assert set(pool.allocate(2)) == set(low)  # then the lower priority, tail first
    assert pool.lookup([_key(10), _key(11)]) == high
    pool.check_integrity()


def test_a_hint_that_would_overflow_the_share_turns_its_oldest_blocks_cold():
    clock = _Clock()
    pool = BlockPool(10, retained_share=0.3, clock=clock)  # at most 3 retained blocks
    first = _cached(pool, 2, 0, Retention(clock.now + 60))
    clock.now += 1
    second = _cached(pool, 3, 10, Retention(clock.now + 60))  # 5 > 3: the 2 lowest-ranked turn cold
    assert pool.num_retained == 3
    pool.check_integrity()
    pool.allocate(5)  # the free blocks
    assert set(pool.allocate(2)) == set(first)  # the demoted ones went as cold ones
    assert pool.lookup([_key(10), _key(11), _key(12)]) == second
    pool.check_integrity()


def test_a_hit_takes_a_retained_block_back():
    pool = BlockPool(4, retained_share=1.0)
    blocks = _cached(pool, 2, 0, Retention(until=float("inf")))
    hits = pool.lookup([_key(0), _key(1)])
    pool.acquire(hits)
    assert pool.num_retained == 0 and pool.num_free == 2
    pool.release(hits)  # released without a hint this time: plain cold blocks
    assert pool.num_retained == 0 and pool.num_cached_unused == 2
    pool.reset_prefix_cache()
    assert pool.num_free == 4 and blocks
    pool.check_integrity()


def test_retention_share_is_checked():
    with pytest.raises(ValueError):
        BlockPool(4, retained_share=1.5)
