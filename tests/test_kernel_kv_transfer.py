"""KV page gather/scatter for transfer: Triton launchers against the torch twins, and round trips."""

import pytest
import torch

import mooncake_kernels as kernels
from mooncake_kernels.kv_transfer import gather_kv_torch, gather_kv_triton, scatter_kv_torch, scatter_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 needs a GPU")),
]
L, H, BS, D = 4, 2, 8, 16  # layers, kv heads, block size, head dim


def _cache(seed, num_blocks, dtype, num_layers=L):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_layers, 2, num_blocks, H, BS, D, generator=g).to(device=DEVICE, dtype=dtype)


def _selected(layers):
    if layers is None:
        return range(L)
    return layers if isinstance(layers, range) else range(L)[layers]


def _nan_cache(num_blocks, dtype):
    return torch.full((L, 2, num_blocks, H, BS, D), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers", [None, range(1, 3), range(2, 3), slice(0, 4, 2), slice(-2, None)])
def test_gather_matches_twin_and_round_trips(dtype, layers):
    src = _cache(5, 10, dtype)
    src_ids = torch.tensor([7, 2, 9, 0, 4], dtype=torch.int32, device=DEVICE)
    dst_ids = torch.tensor([1, 12, 3, 8, 0], dtype=torch.int64, device=DEVICE)
    buf = gather_kv_triton(src, src_ids, layers)
    want = gather_kv_torch(src, src_ids, layers)
    sel = _selected(layers)
    n_layers = len(sel)
    assert buf.shape == (n_layers, 2, 5, H, BS, D) and buf.is_contiguous()
    assert torch.equal(buf, want)

    dst, dst_twin = _nan_cache(13, dtype), _nan_cache(13, dtype)
    scatter_kv_triton(buf, dst, dst_ids, layers)
    scatter_kv_torch(want, dst_twin, dst_ids, layers)
    assert torch.equal(dst.isnan(), dst_twin.isnan())
    assert torch.equal(dst.nan_to_num(0.0), dst_twin.nan_to_num(0.0))
    for i, layer in enumerate(sel):
        for j in range(5):
            assert torch.equal(dst[layer, :, int(dst_ids[j])], src[layer, :, int(src_ids[j])])
            assert torch.equal(dst[layer, :, int(dst_ids[j])], buf[i, :, j])
    # Nothing else was touched.
    written = torch.zeros(L, 13, dtype=torch.bool)
    written[list(sel)] = torch.zeros(13, dtype=torch.bool).index_fill(0, dst_ids.cpu(), True)
    assert bool(dst.isnan().all(dim=(1, 3, 4, 5)).cpu().eq(~written).all())


def test_gather_into_out_and_per_layer():
    src = _cache(6, 10, torch.float32)
    ids = torch.tensor([3, 3, 1], device=DEVICE)  # repeated source ids are fine
    out = torch.full((1, 2, 3, H, BS, D), float("nan"), device=DEVICE)
    got = gather_kv_triton(src, ids, range(2, 3), out=out)
    assert got is out
    assert torch.equal(out, gather_kv_torch(src, ids, range(2, 3)))
    assert torch.equal(out[0, :, 0], src[2, :, 3])
    unchecked = gather_kv_triton(src, ids, range(2, 3), check_ids=False)
    assert torch.equal(unchecked, out)
    twin_out = torch.full_like(out, float("nan"))
    assert torch.equal(gather_kv_torch(src, ids, range(2, 3), out=twin_out), out)


def test_interface_dispatch_and_empty():
    src = _cache(7, 6, torch.float32)
    buf = kernels.gather_kv(src, [5, 0])  # a list of ids is accepted too
    assert torch.equal(buf, gather_kv_torch(src, [5, 0]))
    dst = _nan_cache(6, torch.float32)
    kernels.scatter_kv(buf, dst, [0, 5])
    assert torch.equal(dst[:, :, 0], src[:, :, 5]) and torch.equal(dst[:, :, 5], src[:, :, 0])
    empty = gather_kv_triton(src, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert empty.shape == (L, 2, 0, H, BS, D)
    scatter_kv_triton(empty, dst, torch.empty(0, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("fn", ["triton", "torch"])
@pytest.mark.parametrize("bad", [[0, 6], [-1, 2], [10**6]])
def test_bad_block_ids_rejected(fn, bad):
    gather = gather_kv_triton if fn == "triton" else gather_kv_torch
    scatter = scatter_kv_triton if fn == "triton" else scatter_kv_torch
    src = _cache(8, 6, torch.float32)
    ids = torch.tensor(bad, device=DEVICE)
    with pytest.raises(ValueError, match="block ids"):
        gather(src, ids)
    buf = torch.zeros(L, 2, len(bad), H, BS, D, device=DEVICE)
    with pytest.raises(ValueError, match="block ids"):
        scatter(buf, src, ids)
    with pytest.raises(ValueError, match="int32/int64"):
        gather(src, torch.tensor([0.0, 1.0], device=DEVICE))
    with pytest.raises(ValueError, match="1-D"):
        gather(src, torch.zeros(1, 2, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("fn", ["triton", "torch"])
def test_buffer_mismatch_rejected(fn):
    gather = gather_kv_triton if fn == "triton" else gather_kv_torch
    scatter = scatter_kv_triton if fn == "triton" else scatter_kv_torch
    cache = _cache(9, 6, torch.float32)
    ids = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="shape"):
        scatter(torch.zeros(L, 2, 3, H, BS, D, device=DEVICE), cache, ids)  # 3 pages for 2 ids
    with pytest.raises(ValueError, match="shape"):
        scatter(torch.zeros(L, 2, 2, H, BS, D, device=DEVICE), cache, ids, range(0, 2))  # 4 layers for 2
    with pytest.raises(ValueError, match="shape"):
        scatter(torch.zeros(L, 2, 2, H, BS, 2 * D, device=DEVICE), cache, ids)
    with pytest.raises(ValueError, match="dtype"):
        scatter(torch.zeros(L, 2, 2, H, BS, D, dtype=torch.float16, device=DEVICE), cache, ids)
    with pytest.raises(ValueError, match="shape"):
        gather(cache, ids, out=torch.zeros(L, 2, 1, H, BS, D, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        gather(cache, ids, out=torch.zeros(L, 2, H, 2, BS, D, device=DEVICE).transpose(2, 3))
    with pytest.raises(ValueError, match="layers"):
        gather(cache, ids, range(2, 5))
    with pytest.raises(ValueError, match="layers"):
        gather(cache, ids, slice(None, None, -1))
    with pytest.raises(ValueError, match="kv_cache"):
        gather(cache[0], ids)
