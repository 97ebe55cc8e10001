"""The engine with every kernel forced onto its Triton implementation (through Triton's
interpreter on CPU) produces the same greedy tokens and logprobs as with the torch twins."""

from __future__ import annotations

import pytest

import mooncake_kernels as kernels
from engine import LLM, SamplingParams
from tiny_models import make_tiny_model

TRITON_OPS = [
    "store_kv_triton",
    "decode_attention_triton",
    "extend_attention_triton",
    "rms_norm_triton",
    "rotary_embedding_triton",
    "silu_and_mul_triton",
]


@pytest.fixture
def restore_mode():
    before = kernels.mode()
    yield
    kernels.set_mode(before)


def _run(folder, prompts):
    # float32: bfloat16 is wrong in Triton's interpreter.
    llm = LLM(model=str(folder), threads=2, kv_cache_gib=0.002, block_size=16, max_num_batched_tokens=64,
              dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True)
    outs = llm.generate(prompts, params)
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.pool.num_in_use == 0
    return outs


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_triton_path_matches_torch_path(tmp_path, monkeypatch, restore_mode, arch):
    folder = make_tiny_model(tmp_path / "m", arch, tie=False, seed=3)
    # A prefix shared by two prompts exercises extend attention over cached blocks as well.
    shared = list(range(3, 23))
    prompts = [shared + [30, 31, 32], shared + [40], [7, 8, 9, 10, 11]]

    kernels.set_mode("torch")
    reference = _run(folder, prompts)

    calls = {name: 0 for name in TRITON_OPS}
    for name in TRITON_OPS:  # patched where the dispatching ops look them up
        original = getattr(kernels.ops, name)

        def counted(*args, _name=name, _fn=original, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(kernels.ops, name, counted)
    kernels.set_mode("triton")
    triton = _run(folder, prompts)

    missing = [name for name, n in calls.items() if n == 0]
    assert not missing, f"these ops never ran their Triton kernel: {missing}"
    for ref, tri in zip(reference, triton):
        assert tri.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, tri.logprobs):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [t for t, _ in b.top] == [t for t, _ in a.top]
