"""Triton elementwise kernels (store_kv, rms_norm, rope, silu_and_mul) against their torch twins.

Without CUDA these run in Triton's interpreter (``tests/conftest.py`` sets it), where bf16
arithmetic is unreliable: bf16 cases only run on a GPU.
"""

import pytest
import torch

from mooncake_kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from mooncake_kernels.norms import rms_norm_torch, rms_norm_triton
from mooncake_kernels.rope import rotary_embedding_torch, rotary_embedding_triton
from mooncake_kernels.store_kv import store_kv_torch, store_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 needs a GPU")),
]
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _close(a, b, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_heads", [(64, 2), (80, 4), (128, 1)])
def test_store_kv_shuffled_and_negative_slots(dtype, head_dim, num_heads):
    g = _gen(head_dim * 7 + num_heads)
    t, nb, bs = 13, 6, 8
    # k and v as strided views out of one fused projection, as the model produces them.
    qkv = _randn(g, t, 3 * num_heads * head_dim, dtype=dtype)
    k = qkv[:, num_heads * head_dim : 2 * num_heads * head_dim].view(t, num_heads, head_dim)
    v = qkv[:, 2 * num_heads * head_dim :].view(t, num_heads, head_dim)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[[2, 9]] = -1
    slots = slots.to(DEVICE)
    caches = [torch.full((nb, num_heads, bs, head_dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    store_kv_triton(k, v, caches[0], caches[1], slots)
    store_kv_torch(k, v, caches[2], caches[3], slots)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.isnan(), want.isnan())  # exactly the valid slots written
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))  # and bit-exact copies
    assert int(caches[0].isnan().logical_not().sum()) == (t - 2) * num_heads * head_dim


def test_store_kv_int32_slots_converts_dtype():
    g = _gen(1)
    k, v = _randn(g, 5, 2, 64), _randn(g, 5, 2, 64)
    slots = torch.tensor([7, 0, -1, 31, 16], dtype=torch.int32, device=DEVICE)
    kc = torch.full((4, 2, 8, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    vc = kc.clone()
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv_triton(k, v, kc, vc, slots)
    store_kv_torch(k, v, kc2, vc2, slots)
    assert torch.equal(kc.nan_to_num(0.0), kc2.nan_to_num(0.0))
    assert torch.equal(vc.nan_to_num(0.0), vc2.nan_to_num(0.0))


@pytest.mark.parametrize("padded", [False, True])
def test_store_kv_with_the_steps_slots_worked_out_once_writes_the_same(padded):
    from mooncake_kernels.store_kv import CacheSlots

    g = _gen(3)
    k, v = _randn(g, 6, 2, 16), _randn(g, 6, 2, 16)
    slots = torch.tensor([9, 0, -1 if padded else 5, 31, 16, 22], device=DEVICE)
    given = CacheSlots.of(slots, 8)
    assert (given.keep is None) == (not padded)
    caches = [torch.full((4, 2, 8, 16), float("nan"), device=DEVICE) for _ in range(4)]
    store_kv_torch(k, v, caches[0], caches[1], slots)
    store_kv_torch(k, v, caches[2], caches[3], slots, given)
    for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)) and torch.equal(got.isnan(), want.isnan())


def test_store_kv_rejects_bad_args():
    k = torch.zeros(3, 2, 64, device=DEVICE)
    kc = torch.zeros(4, 2, 8, 64, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_triton(k, k, kc, kc, slots[:2])
    with pytest.raises(ValueError, match="int32/int64"):
        store_kv_triton(k, k, kc, kc, slots.float())
    with pytest.raises(ValueError, match="does not match"):
        store_kv_triton(torch.zeros(3, 2, 32, device=DEVICE), torch.zeros(3, 2, 32, device=DEVICE), kc, kc, slots)
    with pytest.raises(ValueError, match="last dim"):
        kt = torch.zeros(3, 64, 2, device=DEVICE).transpose(1, 2)
        store_kv_triton(kt, kt, kc, kc, slots)


# ---------------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 80, 128, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_2d(dtype, n, with_residual):
    g = _gen(n * 2 + with_residual)
    x, w = _randn(g, 9, n, dtype=dtype), _randn(g, n, dtype=dtype)
    if with_residual:
        r = _randn(g, 9, n, dtype=dtype)
        out, new_r = rms_norm_triton(x, w, 1e-6, r)
        want, want_r = rms_norm_torch(x, w, 1e-6, r)
        assert torch.equal(new_r, want_r)
        assert new_r.dtype == dtype and out.dtype == dtype
    else:
        out, want = rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)
    _close(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 9, 64), (2, 3, 7, 128)])
def test_rms_norm_twin_on_cpu_is_the_fp32_formula_bit_for_bit(dtype, shape):
    """The twin runs torch's fused CPU rms_norm; it must be the spec's formula exactly: fp32
    math, the weight multiplied in fp32, one rounding to the input's dtype."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(dtype)
    assert torch.equal(rms_norm_torch(x, w, 1e-5), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 80, 128])
def test_rms_norm_per_head_strided(dtype, d):
    """q/k norm: x [T, H, D] a strided view into a fused QKV output, fp32 weight."""
    g = _gen(d)
    t, h = 7, 3
    qkv = _randn(g, t, 2 * h * d + 16, dtype=dtype)
    x = qkv[:, 16 : 16 + h * d].view(t, h, d)
    w = _randn(g, d)
    out = rms_norm_triton(x, w, 1e-5)
    assert out.shape == (t, h, d) and out.dtype == dtype
    _close(out, rms_norm_torch(x, w, 1e-5), dtype)


def test_rms_norm_3d_with_residual_and_4d():
    g = _gen(3)
    x, r, w = _randn(g, 2, 5, 128), _randn(g, 2, 5, 128), _randn(g, 128)
    out, new_r = rms_norm_triton(x, w, 1e-6, r)
    want, want_r = rms_norm_torch(x, w, 1e-6, r)
    _close(out, want, torch.float32)
    assert torch.equal(new_r, want_r)
    x4 = _randn(g, 2, 3, 4, 64)
    _close(rms_norm_triton(x4, w[:64], 1e-6), rms_norm_torch(x4, w[:64], 1e-6), torch.float32)


def test_rms_norm_rejects_bad_args():
    x = torch.zeros(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, torch.ones(64, device=DEVICE), 1e-6, torch.zeros(4, 32, device=DEVICE))
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, torch.ones(64, device=DEVICE), 1e-6, x.half())


# -------------------------------------------------------------------------------------- rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_rope(dtype, head_dim):
    g = _gen(head_dim)
    t, h, max_pos = 11, 3, 200
    qkv = _randn(g, t, 2 * h * head_dim, dtype=dtype)
    x = qkv[:, h * head_dim :].view(t, h, head_dim)  # strided view, as in the model
    angles = torch.rand(max_pos, head_dim // 2, generator=g) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(DEVICE)
    positions = torch.randint(0, max_pos, (t,), generator=g).to(DEVICE)
    rows = cos_sin[positions]
    out = rotary_embedding_triton(x, rows)
    assert out.shape == x.shape and out.dtype == dtype
    _close(out, rotary_embedding_torch(x, rows), dtype)


def test_rope_rejects_bad_args():
    x = torch.zeros(3, 2, 64, device=DEVICE)
    cs = torch.zeros(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="one row per token"):
        rotary_embedding_triton(x, cs[:2])
    with pytest.raises(ValueError, match="one row per token"):
        rotary_embedding_triton(x, cs[:, :32])


# ------------------------------------------------------------------------------ silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 64), (3, 4, 2 * 80), (2, 2 * 1000)])
def test_silu_and_mul(dtype, shape):
    g = _gen(shape[-1])
    x = _randn(g, *shape, dtype=dtype) * 3
    out = silu_and_mul_triton(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    # The twin rounds silu(gate) to the dtype before the product; the kernel rounds once.
    _close(out, silu_and_mul_torch(x.float()).to(dtype), dtype)
    _close(out, silu_and_mul_torch(x), torch.float32 if dtype == torch.float32 else torch.bfloat16)


def test_silu_and_mul_rejects_odd_dim():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(torch.zeros(2, 7, device=DEVICE))
