"""Triton paged decode attention against its torch twin (the spec), in Triton's interpreter on CPU.

Each case builds a fresh seeded paged cache with shuffled physical blocks, fills the slots that
belong to no context with large values (reading them would show), and poisons the output and
the split-K workspace with NaN so an element the kernel fails to write fails the comparison.
"""

import math
import zlib

import pytest
import torch

from mooncake_kernels.decode_attention import (
    DecodeWorkspace,
    choose_num_splits,
    decode_attention_torch,
    decode_attention_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is wrong in Triton's interpreter")


def make_case(seed, lens, hkv, group, d, bs, dtype, spare_blocks=3):
    g = torch.Generator().manual_seed(seed)
    s = len(lens)
    nblk = [-(-n // bs) for n in lens]
    max_blocks = max(nblk) + 1  # one padding column beyond the longest context
    num_blocks = sum(nblk) + spare_blocks
    k = torch.randn(num_blocks, hkv, bs, d, generator=g)
    v = torch.randn(num_blocks, hkv, bs, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (s, max_blocks), generator=g, dtype=torch.int32)
    used = torch.zeros(num_blocks, bs, dtype=torch.bool)
    at = 0
    for i, (n, nb) in enumerate(zip(lens, nblk)):
        ids = perm[at:at + nb]
        at += nb
        tables[i, :nb] = ids.int()
        for j, b in enumerate(ids.tolist()):
            used[b, : min(bs, n - j * bs)] = True
    # Slots holding no context token: large keys/values, so reading one changes the result.
    k.masked_fill_(~used[:, None, :, None], 30.0)
    v.masked_fill_(~used[:, None, :, None], 1e3)
    q = torch.randn(s, hkv * group, d, generator=g)
    cast = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return (cast(q), cast(k), cast(v), tables.to(DEVICE),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE))


def run_and_check(case, dtype, num_splits, workspace_splits=None):
    q, k, v, bt, sl = case
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref = decode_attention_torch(q, k, v, bt, sl, scale)
    out = torch.full_like(q, float("nan"))
    ws = None
    if workspace_splits is not None:
        ws = DecodeWorkspace(q.shape[0] + 1, q.shape[1], q.shape[2], workspace_splits, q.device)
        ws.partial.fill_(float("nan"))
        ws.lse.fill_(float("nan"))
    got = decode_attention_triton(q, k, v, bt, sl, scale, num_splits=num_splits, workspace=ws, out=out)
    assert got is out
    assert not torch.isnan(got).any(), "unwritten (NaN) output elements"
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return got


# (lens, hkv, group, head_dim, block_size, dtype, num_splits): each axis value appears at least once.
CASES = [
    ([1, 17, 40], 2, 1, 64, 16, torch.float32, 1),
    ([33, 5], 1, 3, 80, 16, torch.float16, 2),
    ([100, 1, 64], 1, 4, 128, 64, torch.float32, 4),
    ([130, 7], 2, 8, 64, 64, torch.float16, None),
    ([1], 2, 4, 128, 16, torch.float16, 1),
    ([50, 3, 64], 1, 8, 80, 16, torch.float32, 4),
    ([70, 12], 1, 3, 128, 64, torch.float32, 2),
    ([300, 2], 1, 4, 96, 256, torch.float16, 2),  # tiles smaller than a block
    ([75, 129], 2, 1, 96, 32, torch.float32, None),
    pytest.param([90, 1, 33], 2, 4, 128, 16, torch.bfloat16, 2, marks=needs_cuda),
    pytest.param([200, 64], 1, 8, 64, 64, torch.bfloat16, 1, marks=needs_cuda),
]


@pytest.mark.parametrize("lens,hkv,group,d,bs,dtype,num_splits", CASES)
def test_matches_twin(lens, hkv, group, d, bs, dtype, num_splits):
    seed = zlib.crc32(repr((lens, hkv, group, d, bs, dtype, num_splits)).encode())
    case = make_case(seed, lens, hkv, group, d, bs, dtype)
    run_and_check(case, dtype, num_splits, workspace_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_counts_agree(dtype):
    # Contexts from 1 token to several tiles: some splits get no tiles for the short ones.
    case = make_case(7, [1, 45, 160, 97], 2, 4, 80, 16, dtype)
    outs = [run_and_check(case, dtype, n, workspace_splits=8) for n in (1, 2, 4)]
    for o in outs[1:]:
        torch.testing.assert_close(o.float(), outs[0].float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_temporary_workspace_and_strided_inputs():
    # q as a slice of a fused qkv projection (row stride > Hq * D) and a permuted-view cache.
    d, hkv, group, bs = 64, 2, 3, 16
    q, k, v, bt, sl = make_case(11, [20, 37], hkv, group, d, bs, torch.float32)
    qkv = torch.randn(q.shape[0], (hkv * group + 2 * hkv) * d, device=DEVICE)
    qs = qkv[:, : hkv * group * d].view(q.shape[0], hkv * group, d)
    qs.copy_(q)
    assert not qs.is_contiguous()
    k2 = k.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)  # same values, head-major storage
    bt_wide = torch.zeros(bt.shape[0], bt.shape[1] * 2, dtype=torch.int32, device=DEVICE)
    bt_wide[:, ::2] = bt
    bt_strided = bt_wide[:, ::2]
    ref = decode_attention_torch(q, k, v, bt, sl, 0.125)
    got = decode_attention_triton(qs, k2, v, bt_strided, sl, 0.125, num_splits=2)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_dispatch_uses_triton(monkeypatch):
    import mooncake_kernels as kernels

    monkeypatch.setattr(kernels.dispatch, "_mode", "triton")
    q, k, v, bt, sl = make_case(3, [9, 30], 1, 4, 64, 16, torch.float32)
    got = kernels.decode_attention(q, k, v, bt, sl, 0.125)
    torch.testing.assert_close(got, decode_attention_torch(q, k, v, bt, sl, 0.125), atol=1e-4, rtol=1e-4)


def test_choose_num_splits():
    assert choose_num_splits(1, 8, 128, 132) == 1  # short context
    assert choose_num_splits(64, 8, 32768, 132) == 1  # enough programs already
    n = choose_num_splits(1, 8, 32768, 132)
    assert 2 <= n <= 32 and 8 * n >= 132
    assert choose_num_splits(1, 1, 1024, 132) == 1024 // 256  # >= 256 tokens per split
    assert choose_num_splits(1, 1, 10**6, 132) == 32


def _args(**over):
    q = torch.zeros(2, 4, 64)
    kc = torch.zeros(5, 2, 16, 64)
    a = dict(q=q, k_cache=kc, v_cache=kc.clone(), block_tables=torch.zeros(2, 3, dtype=torch.int32),
             seq_lens=torch.ones(2, dtype=torch.int32), scale=0.125)
    a.update(over)
    return a


@pytest.mark.parametrize("over,msg", [
    (dict(q=torch.zeros(2, 256)), "q must be"),
    (dict(k_cache=torch.zeros(5, 2, 16)), "caches must be"),
    (dict(v_cache=torch.zeros(5, 2, 32, 64)), "!= v_cache"),
    (dict(q=torch.zeros(2, 3, 64)), "multiple of Hkv"),
    (dict(q=torch.zeros(2, 4, 32)), "head_dim"),
    (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), "block_tables must be 2-D int32"),
    (dict(block_tables=torch.zeros(6, dtype=torch.int32)), "block_tables must be 2-D int32"),
    (dict(seq_lens=torch.ones(2, dtype=torch.int64)), "seq_lens must be 1-D int32"),
    (dict(seq_lens=torch.ones(3, dtype=torch.int32)), "batch mismatch"),
    (dict(q=torch.zeros(2, 4, 64, dtype=torch.float16)), "cache dtypes"),
    (dict(q=torch.zeros(2, 4, 64, dtype=torch.int32)), "q must be float32/float16/bfloat16"),
    (dict(seq_lens=torch.ones(2, dtype=torch.int32, device="meta")), "is on meta"),
])
def test_errors(over, msg):
    with pytest.raises(ValueError, match=msg):
        decode_attention_triton(**_args(**over))


def test_error_workspace_and_out():
    a = _args()
    with pytest.raises(ValueError, match="too small"):
        decode_attention_triton(**a, num_splits=4, workspace=DecodeWorkspace(2, 4, 64, 2, "cpu"))
    with pytest.raises(ValueError, match="out must match q"):
        decode_attention_triton(**a, out=torch.zeros(2, 4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention_triton(**a, num_splits=0)


def test_the_twin_reads_a_batch_of_mixed_lengths_in_length_groups():
    from mooncake_kernels.paged import LENGTH_GROUP_FACTOR, DecodeContext

    lens = [700, 3, 40, 1000, 41, 90, 5]
    q, k, v, bt, sl = make_case(7, lens, hkv=2, group=3, d=32, bs=16, dtype=torch.float32)
    context = DecodeContext.build(bt, sl, 2, 16)
    rows = sorted(i for g in context.groups for i in g.rows.tolist())
    assert rows == list(range(len(lens)))  # each sequence in exactly one group
    for g in context.groups:
        group_lens = [lens[i] for i in g.rows.tolist()]
        assert g.max_len == max(group_lens) <= LENGTH_GROUP_FACTOR * min(group_lens)
    assert len(context.groups) > 1
    got = decode_attention_torch(q, k, v, bt, sl, 0.2, context)
    # Each sequence alone (one group, no padding at all) is the reference.
    for i in range(len(lens)):
        alone = decode_attention_torch(q[i : i + 1], k, v, bt[i : i + 1], sl[i : i + 1], 0.2)
        torch.testing.assert_close(got[i : i + 1], alone, atol=1e-5, rtol=1e-5)
    # Built here or given: the same result.
    torch.testing.assert_close(decode_attention_torch(q, k, v, bt, sl, 0.2), got)


def test_a_batch_of_similar_lengths_is_one_group_read_in_order():
    from mooncake_kernels.paged import DecodeContext

    lens = [300, 310, 299, 500]
    _, _, _, bt, sl = make_case(8, lens, hkv=2, group=3, d=32, bs=16, dtype=torch.float32)
    context = DecodeContext.build(bt, sl, 2, 16)
    assert len(context.groups) == 1 and context.groups[0].rows is None and context.groups[0].max_len == 500
    assert context.groups[0].beyond is not None  # the shorter contexts are padded, and masked
    # A lone sequence is never padded: its scores need no mask.
    assert DecodeContext.build(bt[:1], sl[:1], 2, 16).groups[0].beyond is None
