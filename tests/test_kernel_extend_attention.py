"""Triton extend attention against its torch twin (in Triton's interpreter when there is no GPU)."""

from __future__ import annotations

import zlib

import pytest
import torch

import mooncake_kernels as kernels
from mooncake_kernels.extend_attention import extend_attention_torch, extend_attention_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HKV = 2
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 needs a GPU")


def make_case(seed, dtype, group, block_size, head_dim, seqs, spare_blocks=3):
    """Random inputs for ``seqs`` = [(prefix_len, new_tokens), ...] with shuffled physical blocks.

    Every cache block (also the unused ones) holds random data, so reading a wrong block shows.
    """
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-(p + n) // block_size) for p, n in seqs]
    num_blocks = sum(nbs) + spare_blocks
    shape = (num_blocks, HKV, block_size, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    # Rows padded with a valid block id (here a random one), as the engine does.
    tables = torch.randint(0, num_blocks, (len(seqs), max(nbs) + 1), generator=g, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    ns = [n for _, n in seqs]
    q = torch.randn(sum(ns), HKV * group, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor([p + n for p, n in seqs], dtype=torch.int32)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(ns).cumsum(0)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q), to(k_cache), to(v_cache), to(tables), to(seq_lens), to(qsl), head_dim**-0.5


def check(args, dtype, **kw):
    q = args[0]
    ref = extend_attention_torch(*args)
    out = torch.full_like(q, float("nan"))  # rows the kernel misses stay NaN and fail
    got = extend_attention_triton(*args, out=out, **kw)
    assert got is out and got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


# Each sequence list mixes: no cached prefix, a prefix that is not a multiple of block_size, a
# single new token, and enough new tokens for several query tiles (BLOCK_M = 128 // group_p).
# (33, 40) and (65, 140): a tile's last row sees exactly one key of the next 64-key step.
MIXED_SMALL_TILES = [(0, 37), (21, 5), (50, 1), (13, 70), (33, 40)]  # group >= 3: BLOCK_M <= 32
MIXED_LARGE_TILES = [(0, 150), (21, 5), (50, 1), (65, 140)]  # group 1: BLOCK_M = 128

CASES = [
    # (dtype, group, block_size, head_dim, seqs)
    (torch.float32, 1, 16, 64, MIXED_LARGE_TILES),
    (torch.float32, 3, 64, 80, MIXED_SMALL_TILES),
    (torch.float32, 8, 16, 128, MIXED_SMALL_TILES),
    (torch.float16, 4, 64, 128, MIXED_SMALL_TILES),
    (torch.float16, 8, 64, 64, MIXED_SMALL_TILES),
    (torch.float16, 1, 64, 80, MIXED_LARGE_TILES),
    (torch.float16, 3, 16, 64, [(100, 1), (0, 1), (64, 40)]),  # decode-like rows, aligned prefix
    (torch.float32, 4, 256, 96, [(300, 20), (0, 45), (255, 1)]),  # largest blocks, head_dim 96
    (torch.float32, 2, 32, 16, MIXED_SMALL_TILES),  # tiny-model head_dim (padded to 16)
    pytest.param(torch.bfloat16, 4, 16, 128, MIXED_SMALL_TILES, marks=needs_cuda),
    pytest.param(torch.bfloat16, 8, 64, 80, MIXED_SMALL_TILES, marks=needs_cuda),
]


@pytest.mark.parametrize("dtype,group,block_size,head_dim,seqs", CASES)
def test_matches_twin(dtype, group, block_size, head_dim, seqs):
    seed = zlib.crc32(repr((dtype, group, block_size, head_dim, seqs)).encode())
    check(make_case(seed, dtype, group, block_size, head_dim, seqs), dtype)


def test_given_max_query_len_and_strided_q():
    """``max_query_len`` passed in (no host sync) and q a strided view, as the engine's split gives."""
    q, kc, vc, bt, sl, qsl, scale = make_case(7, torch.float32, 4, 16, 64, [(5, 20), (0, 9)])
    t, hq, d = q.shape
    wide = torch.randn(t, hq * d + 32, device=DEVICE)
    qv = wide[:, 16 : 16 + hq * d].view(t, hq, d)
    qv.copy_(q)
    assert not qv.is_contiguous()
    check((qv, kc, vc, bt, sl, qsl, scale), torch.float32, max_query_len=20)


def test_empty_and_zero_length_sequences():
    args = make_case(3, torch.float32, 1, 16, 64, [(8, 3), (4, 0), (0, 2)])
    check(args, torch.float32)
    q, kc, vc, bt, sl, qsl, scale = args
    empty = extend_attention_triton(q[:0], kc, vc, bt[:0], sl[:0], qsl[:1], scale)
    assert empty.shape == (0, *q.shape[1:])


def test_dispatch_uses_triton():
    args = make_case(11, torch.float32, 4, 16, 64, [(19, 7), (0, 4)])
    before = kernels.mode()
    kernels.set_mode("triton")
    try:
        got = kernels.extend_attention(*args)
    finally:
        kernels.set_mode(before)
    torch.testing.assert_close(got, extend_attention_torch(*args), atol=1e-4, rtol=1e-4)


def _bad(fn):
    q, kc, vc, bt, sl, qsl, scale = make_case(5, torch.float32, 2, 16, 64, [(3, 4), (0, 2)])
    args = dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, seq_lens=sl, query_start_loc=qsl)
    fn(args)
    return args, scale


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(k_cache=a["k_cache"][0]), "k_cache and v_cache"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :, :8]), "k_cache and v_cache"),
        (lambda a: a.update(q=a["q"][..., :32]), "head_dim mismatch"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of Hkv"),
        (lambda a: a.update(q=a["q"].double()), "q must be float32/float16/bfloat16"),
        (lambda a: a.update(k_cache=a["k_cache"].half()), "dtype mismatch"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be 2-D int32"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be 1-D int32"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), "query_start_loc must be 1-D int32"),
        (lambda a: a.update(block_tables=a["block_tables"][:1]), "rows for 2 sequences"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]), "S \\+ 1"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"] - 1), "T = 6"),
        (lambda a: a.update(seq_lens=a["seq_lens"] - 2), "seq_lens\\[i\\] must be >="),
        (lambda a: a.update(
            query_start_loc=torch.tensor([0, 5, 4], dtype=torch.int32, device=DEVICE),
            q=a["q"][:4]), "non-decreasing"),
        (lambda a: a.update(seq_lens=a["seq_lens"].to("meta")), "is on meta"),
    ],
)
def test_launcher_errors(mutate, match):
    args, scale = _bad(mutate)
    with pytest.raises(ValueError, match=match):
        extend_attention_triton(scale=scale, **args)


def test_out_argument_checked():
    args = make_case(5, torch.float32, 2, 16, 64, [(3, 4)])
    with pytest.raises(ValueError, match="out must match q"):
        extend_attention_triton(*args, out=torch.empty_like(args[0]).half())
