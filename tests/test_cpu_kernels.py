"""The native CPU kernels (``kernels/csrc/cpu_decode.cpp``) against the twins that specify them.

* the q4 and q8 block-quantized linears (the integer GEMM, ``kernels/csrc/int_gemm.h``) against
  :func:`quant_linear_torch` (which quantizes the activations per block as the kernel does and
  sums in float): equal within float32 rounding, for ragged shapes (an odd block count, a last
  panel part empty, 1-9 and 70 rows: every row tile and row chunk), and their packing both ways;
* the GEMM built for AVX2 alone (``MOONCAKE_ISA=avx2``) gives the same bits as this CPU's build;
* paged decode attention against :func:`decode_attention_torch`, float32 and bfloat16
  caches, GQA groups 1-4, block sizes 1-32, ragged lengths, shuffled block tables;
* a whole native decode layer against the eager layer, over real steps of a tiny Llama, Qwen2
  (qkv bias) and Qwen3 (q/k norm): the same logits and the same K/V written;
* bad input is refused with an error that says what is wrong, never read out of bounds.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu_runtime import return_freed_memory, rss_anon_bytes
from mooncake_kernels import cpu_ext
from mooncake_kernels.decode_attention import decode_attention_native, decode_attention_torch
from mooncake_kernels.dense_linear import dense_linear_native, dense_linear_torch, dense_native_available, pack_dense
from mooncake_kernels.quant_linear import (
    pack_q4, pack_q8, quant_linear_native, quant_linear_torch, unpack_q4, unpack_q8,
)
from tiny_models import make_tiny_model

torch.set_num_threads(2)


def _q4_weight(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    q = torch.randint(0, 16, (n, k), generator=g)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    m = -torch.rand(n, k // 32, generator=g) * 0.1
    return pack_q4(q, d, m)


@pytest.mark.parametrize("n,k", [(96, 64), (40, 96), (33, 32), (130, 288)])
def test_q4_pack_round_trips(n, k):
    g = torch.Generator().manual_seed(n * k)
    q = torch.randint(0, 16, (n, k), generator=g)
    d, m = torch.rand(n, k // 32, generator=g), torch.randn(n, k // 32, generator=g)
    packed = pack_q4(q, d, m)
    assert packed.shape == (-(-n // 16), k // 32, 320)
    q2, d2, m2 = unpack_q4(packed, n)
    assert torch.equal(q2.long(), q) and torch.equal(d2, d.half()) and torch.equal(m2, m.half())
    # The layout itself: column 0's first block, inputs 0..3 in the low nibbles of group 0's first
    # 4 bytes, inputs 4..7 in their high nibbles; column 1's in the next 4 bytes.
    first = packed[0, 0, :8].long()
    assert torch.equal(first[:4] & 15, q[0, :4]) and torch.equal(first[:4] >> 4, q[0, 4:8])
    assert torch.equal(first[4:] & 15, q[1, :4])
    w8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    p8, s8 = pack_q8(w8, torch.rand(n, generator=g))
    assert p8.shape == (-(-n // 16), k // 32, 512) and s8.numel() == p8.shape[0] * 16
    assert torch.equal(unpack_q8(p8, n), w8) and torch.equal(p8[0, 0, :4].long() - 128, w8[0, :4].long())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 70])
@pytest.mark.parametrize("n,k", [(96, 64), (40, 96), (130, 288)])
def test_quantized_linears_equal_their_twin(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g) * 3
    x[0, :32] = 0  # an all-zero block: scale 0, codes 0
    packed = _q4_weight(g, n, k)
    want = quant_linear_torch(x, packed, n)
    got = quant_linear_native(x, packed, n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # The twin is the float product with the activations on their 8-bit grid: close to x @ W.T.
    q, d, m = unpack_q4(packed, n)
    w = q.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
    exact = x @ w.T
    assert (want - exact).abs().max() < 0.02 * exact.abs().max()

    w8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    p8, scale = pack_q8(w8, torch.rand(n, generator=g) * 0.01)
    want = quant_linear_torch(x, p8, n, scale)
    got = quant_linear_native(x, p8, n, scale)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_avx2_build_gives_the_same_bits_as_this_cpus():
    """The GEMM's order of sums is one on every instruction set: the build without AVX-512
    (MOONCAKE_ISA=avx2, its own cache folder) computes the same q4 and q8 products to the bit. On
    an AVX2-only CPU both builds are the AVX2 path and the test still holds."""
    import subprocess
    import sys

    code = ("import sys, torch; from mooncake_kernels import cpu_ext; "
            "from mooncake_kernels.quant_linear import pack_q4, pack_q8, quant_linear_native; "
            "g = torch.Generator().manual_seed(7); n, k = 72, 160; "
            "p4 = pack_q4(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, 5, generator=g) * .02, "
            "-torch.rand(n, 5, generator=g) * .1); "
            "p8, s8 = pack_q8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g)); "
            "x = torch.randn(11, k, generator=g) * 3; "
            "torch.save((cpu_ext.load().int_gemm_path(), quant_linear_native(x, p4, n), "
            "quant_linear_native(x, p8, n, s8)), sys.argv[1])")
    results = []
    for isa in ("native", "avx2"):
        out = cpu_ext.cache_root() / f"gemm-bits-{isa}-{os.getpid()}.pt"
        env = {**os.environ, "MOONCAKE_ISA": isa}
        done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=600,
                              env=env)
        assert done.returncode == 0, done.stderr
        results.append(torch.load(out))
        out.unlink()
    (native_path, *native), (avx2_path, *avx2) = results
    assert avx2_path == "avx2", avx2_path
    print(f"{native_path} against {avx2_path}")
    assert all(torch.equal(a, b) for a, b in zip(native, avx2))


def _paged_case(g, lens, hkv, group, bs, d, dtype):
    blocks_needed = [-(-n // bs) for n in lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g)  # blocks of a sequence are scattered
    width = max(blocks_needed)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for s, nb in enumerate(blocks_needed):
        tables[s, :nb] = perm[at : at + nb].int()
        at += nb
    k = torch.randn(num_blocks, hkv, bs, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, hkv, bs, d, generator=g).to(dtype)
    q = torch.randn(len(lens), hkv * group, d, generator=g)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,group,bs,d", [(2, 1, 16, 64), (3, 3, 1, 32), (1, 4, 32, 128), (2, 2, 5, 16)])
def test_native_decode_attention_equals_its_twin(dtype, hkv, group, bs, d):
    g = torch.Generator().manual_seed(hkv * 100 + bs)
    lens = [1, 7, bs * 3, 150, 2]
    q, k, v, tables, seq_lens = _paged_case(g, lens, hkv, group, bs, d, dtype)
    want = decode_attention_torch(q, k, v, tables, seq_lens, d**-0.5)
    got = decode_attention_native(q, k, v, tables, seq_lens, d**-0.5)
    assert got.dtype == q.dtype and torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_native_decode_attention_refuses_bad_input():
    g = torch.Generator().manual_seed(0)
    q, k, v, tables, seq_lens = _paged_case(g, [5, 20], 2, 2, 4, 16, torch.float32)
    with pytest.raises(RuntimeError, match="beyond its block table"):
        decode_attention_native(q, k, v, tables, torch.tensor([5, 21], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="int32"):
        decode_attention_native(q, k, v, tables.long(), seq_lens, 0.25)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        decode_attention_native(q, k.half(), v.half(), tables, seq_lens, 0.25)
    with pytest.raises(RuntimeError, match="multiple"):
        decode_attention_native(q[:, :3], k, v, tables, seq_lens, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33, 300])
def test_packed_dense_linear_equals_its_twin(dtype, rows):
    if not dense_native_available(dtype):  # bfloat16 under an AVX2 limit (CI's second kernel run)
        with pytest.raises(ValueError, match="oneDNN packs"):
            pack_dense(torch.ones(16, 32, dtype=dtype))
        pytest.skip(f"oneDNN cannot multiply {dtype} on this CPU (or under ONEDNN_MAX_CPU_ISA)")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    packed = pack_dense(w)  # tuned for 32 rows; any number runs on it
    for b in (None, bias):
        got, want = dense_linear_native(x, packed, b), dense_linear_torch(x, w, b)
        assert got.dtype == dtype and got.shape == want.shape
        # Summation order only: float32 to its rounding, bfloat16 to one step of its output.
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.15)
        torch.testing.assert_close(got, want, **tol)
    three_d = dense_linear_native(x.view(1, rows, 64), packed)
    assert three_d.shape == (1, rows, 96)
    torch.testing.assert_close(three_d[0], dense_linear_native(x, packed))


def test_pack_dense_refuses_what_onednn_cannot_take():
    for bad in (torch.randn(4, 8).half(), torch.randn(2, 4, 8), torch.ones(4, 8, dtype=torch.int8)):
        with pytest.raises(ValueError, match="oneDNN packs 2-D CPU weights"):
            pack_dense(bad)


@pytest.mark.parametrize("arch,quantization,int_rows", [
    ("LlamaForCausalLM", "int4", None), ("Qwen2ForCausalLM", "int4", None), ("Qwen3ForCausalLM", "int4", None),
    # One row through the integer kernels, 2-4 through oneDNN on the dense copies: both paths of a layer.
    ("Qwen2ForCausalLM", "int4", 1), ("Qwen3ForCausalLM", "int4", 1),
    # A float model's packed projections: every step through oneDNN.
    ("Qwen2ForCausalLM", "none", None), ("Qwen3ForCausalLM", "none", None),
])
def test_native_decode_layers_equal_the_eager_layers(tmp_path, monkeypatch, arch, quantization, int_rows):
    """Every step of decodes runs both ways from the same KV cache: the native layers, then the
    eager ones (the same weights through the same linear kernels, op by op)."""
    import engine.model_runner

    if int_rows is not None:  # the mode that is not deterministic, with this crossover measured
        monkeypatch.setattr(engine.model_runner, "integer_rows", lambda dtype: int_rows)
    folder = make_tiny_model(tmp_path / "m", arch, tie=False, seed=5)
    llm = LLM(str(folder), threads=2, kv_cache_gib=0.01, dtype="float32", quantization=quantization,
              deterministic=False)
    model = llm.engine.runner.model
    assert model.native_rows >= 4 and len(model.native_layers) == len(model.layers)
    forward = model.forward
    errors, kv_errors, layer0 = [], [], []

    def both(input_ids, positions, meta, logits_indices, *rest):
        if meta.num_prefills:
            return forward(input_ids, positions, meta, logits_indices, *rest)
        before = model.kv_cache.clone()
        native = forward(input_ids, positions, meta, logits_indices, *rest)
        written = model.kv_cache.clone()
        model.kv_cache.copy_(before)
        rows, model.native_rows = model.native_rows, 0
        try:
            eager = forward(input_ids, positions, meta, logits_indices, *rest)
        finally:
            model.native_rows = rows
        # Layer 0's K and V come from the same float inputs both ways, up to the order the RMSNorm
        # sums in (C++ against torch), which can move an activation to the neighbouring code of its
        # finer level: ~1e-5 here. Deeper layers compound such differences.
        layer0.append((model.kv_cache[0] - written[0]).abs().max().item())
        kv_errors.append(((model.kv_cache - written).abs().max() / written.abs().max()).item())
        errors.append(((native - eager).abs().max() / eager.abs().max()).item())
        return native

    model.forward = both
    prompts = [[(5 * i + j) % 250 + 3 for i in range(n)] for j, n in enumerate((3, 17, 40, 9))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)
    print(f"native vs eager, relative: logits {max(errors):.2e}, KV {max(kv_errors):.2e}; layer 0 KV {max(layer0):.2e}")
    assert len(errors) >= 5 and max(layer0) < 1e-4, layer0
    assert max(errors) < 2e-3 and max(kv_errors) < 2e-3, (errors, kv_errors)


@pytest.mark.skipif(rss_anon_bytes() is None, reason="reads RssAnon from /proc")
def test_the_layers_of_a_step_share_one_scratch_not_one_each():
    """Issue 40: each native layer kept scratch for the largest step it had seen, so a model kept
    its layer count times that (the default model: 30 x ~23 KB a row, 244 MiB after 256 rows, for
    good). One scratch per calling thread now: 24 layers after a 2,048-row step keep one layer's
    (38 MiB measured here), not 24 (843 MiB before)."""
    from mooncake_kernels import native_decode_layer

    torch.manual_seed(0)
    hidden, heads, kv_heads, d, inter, layers, m, bs = 64, 4, 2, 16, 2048, 24, 2048, 16
    dense = {"qkv": (None, pack_dense(torch.randn((heads + 2 * kv_heads) * d, hidden) * 0.05)),
             "o": (None, pack_dense(torch.randn(hidden, heads * d) * 0.05)),
             "gate_up": (None, pack_dense(torch.randn(2 * inter, hidden) * 0.05)),
             "down": (None, pack_dense(torch.randn(hidden, inter) * 0.05))}
    stack = [native_decode_layer(torch.ones(hidden), torch.ones(hidden), dense, None, None, None, heads, kv_heads, d,
                                 inter, 1e-6, 0) for _ in range(layers)]
    k_cache = torch.zeros(m, kv_heads, bs, d)
    v_cache = torch.zeros_like(k_cache)

    def step(rows: int) -> None:
        x = torch.randn(rows, hidden)
        cos_sin = torch.cat([torch.ones(rows, d // 2), torch.zeros(rows, d // 2)], 1)
        slots = torch.arange(rows, dtype=torch.long) * bs  # each row a sequence of one token, a block each
        tables = torch.arange(rows, dtype=torch.int32).unsqueeze(1)
        lens = torch.ones(rows, dtype=torch.int32)
        residual = None
        for layer in stack:
            x, residual = layer.forward(x, residual, cos_sin, k_cache, v_cache, slots, tables, lens, d ** -0.5)
        assert torch.isfinite(x).all()

    step(1)
    return_freed_memory()
    before = rss_anon_bytes() >> 20
    step(m)
    return_freed_memory()  # what the step freed goes back; what the layers keep stays
    kept = (rss_anon_bytes() >> 20) - before
    print(f"kept after a {m}-row step through {layers} layers: {kept} MiB")
    assert kept < 300, f"{kept} MiB kept: scratch per layer again?"


def test_native_decode_layer_refuses_a_slot_outside_the_cache(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=True, seed=1)
    llm = LLM(str(folder), threads=1, kv_cache_gib=0.01, dtype="float32", quantization="int4")
    model = llm.engine.runner.model
    layer, (k_cache, v_cache) = model.native_layers[0], model.kv_cache[0]
    x = torch.randn(1, model.cfg.hidden_size)
    cos_sin = model.cos_sin[:1].contiguous()
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    bad = torch.tensor([k_cache.shape[0] * k_cache.shape[2]])
    with pytest.raises(RuntimeError, match="outside the cache"):
        layer.forward(x, None, cos_sin, k_cache, v_cache, bad, tables, lens, 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        layer.forward(x.double(), None, cos_sin, k_cache, v_cache, torch.zeros(1, dtype=torch.long), tables, lens, 0.25)


def test_the_build_is_keyed_by_what_it_depends_on(monkeypatch):
    key = cpu_ext.build_key()
    assert key == cpu_ext.build_key()
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: "sse2")
    assert cpu_ext.build_key() != key
    monkeypatch.setattr(cpu_ext.torch, "__version__", "0.0")
    assert cpu_ext.build_key() != key


def test_a_failed_build_says_how_to_run_without_it(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: g++: not found")

    monkeypatch.setattr(cpu_ext, "_ext", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setenv("MOONCAKE_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="MOONCAKE_KERNELS=torch"):
        cpu_ext.load()


def test_without_a_compiler_the_engine_serves_with_the_twins_and_says_so(tmp_path):
    """No C++ compiler and no cached build: the engine starts on the torch twins, answers, warns
    once with what is missing and how to get the fast path, and reports which kernels run."""
    import subprocess
    import sys

    folder = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=True, seed=2)
    code = ("import logging; logging.basicConfig(level=logging.WARNING); from engine import LLM, SamplingParams; "
            f"llm = LLM({str(folder)!r}, threads=1, kv_cache_gib=0.01); "
            "out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)); "
            "print('kernels:', llm.engine.runner.kernels, llm.engine.config.kv_cache_dtype, len(out[0].token_ids))")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "MOONCAKE_CACHE_DIR": str(tmp_path / "cache"),
           "MOONCAKE_KERNELS": "auto"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "kernels: torch twins float32 3" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "native CPU kernels unavailable" in line]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "apt-get install g++" in warnings[0]


def test_a_build_killed_midway_does_not_hang_the_next_start():
    """torch's builder waits forever on the lock file of a build that died; ours clears it."""
    import subprocess
    import sys

    cpu_ext.load()
    build_dir = cpu_ext.build_dir()
    (build_dir / "lock").write_text("")  # as a build killed with SIGKILL leaves it
    code = "import mooncake_kernels.cpu_ext as c; c.load(); print('loaded')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr
    assert not (build_dir / "lock").exists()
