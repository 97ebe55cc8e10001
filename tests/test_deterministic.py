"""The deterministic mode (``EngineConfig.deterministic``, on by default where it runs;
``--no-deterministic`` turns it off): one answer per request whatever the path.

* the integer kernels and the native layer compute a row to the same bits whether it is alone or
  one of many, on 1 or 2 threads (the property the mode is built on);
* a greedy request gives the same tokens *and the same logprob bits* cold, warm (its prefix from
  the cache, down to one token left to compute), chunked, batched with others, on 1 or 2 threads;
* the README's chat question, cold and warm, on the default model: the same text (without the
  mode, on a CPU with bfloat16 units, the cold answer was another);
* a configuration the mode cannot keep its promise in is refused at start, not served otherwise;
* it is the default on CPU with int4 projections and the native kernels, and only there.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
import mooncake_kernels as kernels
from engine.config import EngineConfig
from mooncake_kernels.quant_linear import pack_q4, quant_linear_native
from server.cli import instance_args, parse_args
from tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def _q4(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    q = torch.randint(0, 16, (n, k), generator=g)
    return pack_q4(q, torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3, -torch.rand(n, k // 32, generator=g) * 0.1)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_of_the_integer_kernel_is_the_same_bits_in_any_batch(threads):
    g = torch.Generator().manual_seed(3)
    packed = _q4(g, 200, 96)
    x = torch.randn(37, 96, generator=g) * 3
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = quant_linear_native(x, packed, 200)
        for rows in (slice(0, 1), slice(5, 6), slice(0, 5), slice(3, 10), slice(36, 37)):
            assert torch.equal(quant_linear_native(x[rows], packed, 200), whole[rows]), rows
    finally:
        torch.set_num_threads(before)


def _answers(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("det") / "m", "LlamaForCausalLM", tie=True, seed=11)


def test_greedy_output_is_the_same_bits_on_every_path(tiny):
    """The reference: each prompt alone in a fresh engine. Then every other way the same prompt
    can be computed; tokens and logprobs must equal the reference exactly."""
    kw = dict(kv_cache_gib=0.02, dtype="float32", quantization="int4", deterministic=True)
    prompts = [[(7 * i + j) % 250 + 3 for i in range(n)] for j, n in enumerate((33, 50, 17, 90))]
    ref = [_answers(LLM(str(tiny), threads=2, **kw), [p])[0] for p in prompts]

    llm = LLM(str(tiny), threads=2, **kw)
    # Batched: four prompts of different lengths prefill together, then decode together.
    assert _answers(llm, prompts) == ref
    # Warm: every prompt's full blocks from the prefix cache (33 tokens: one row left to compute).
    warm = llm.generate(prompts, GREEDY)
    assert [r.num_cached_tokens for r in warm][0] == 32
    assert [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in warm] == ref
    # Warm one at a time, while another prompt is mid-decode beside it.
    for p, want in zip(prompts, ref):
        assert _answers(llm, [p, prompts[3][::-1]])[0] == want

    # A cache holding another prompt's first 32 tokens: one row computed from a foreign prefix.
    other = LLM(str(tiny), threads=2, **kw)
    other.generate([prompts[0][:32] + [9, 9, 9]], GREEDY)
    assert _answers(other, [prompts[0]])[0] == ref[0]

    # Chunked prefill: 16 tokens a step; and one thread instead of two.
    assert _answers(LLM(str(tiny), threads=2, max_num_batched_tokens=16, **kw), prompts) == ref
    assert _answers(LLM(str(tiny), threads=1, enable_prefix_caching=False, **kw), prompts) == ref


def test_the_readme_question_cold_and_warm_gets_one_answer():
    llm = LLM(threads=2, kv_cache_gib=0.1)  # the shipped defaults
    assert llm.engine.config.deterministic
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = llm.engine.tokenize(prompt)
    params = SamplingParams(temperature=0, max_tokens=12)
    cold = llm.generate([prompt], params)[0]
    warm = llm.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens > 0
    # One row left to compute: the prompt with one more token after its cached blocks.
    bs = llm.engine.config.block_size
    one_row = ids[: len(ids) // bs * bs] + ids[len(ids) // bs * bs:][:1]
    assert len(one_row) % bs == 1
    assert llm.generate([one_row], params)[0].num_cached_tokens == len(one_row) - 1
    assert warm.text == cold.text and warm.token_ids == cold.token_ids
    assert "Paris" in cold.text, cold.text


def test_what_the_mode_cannot_keep_is_refused(tiny):
    with pytest.raises(ValueError, match="int4"):
        EngineConfig(model=str(tiny), dtype="float32", quantization="none", deterministic=True)
    with pytest.raises(ValueError, match="int8"):
        EngineConfig(model=str(tiny), dtype="float32", quantization="int8", deterministic=True)
    # Without the native kernels (the torch twins) there are no native decode layers.
    before = kernels.mode()
    kernels.set_mode("torch")
    try:
        with pytest.raises(ValueError, match="native"):
            LLM(str(tiny), threads=1, kv_cache_gib=0.01, dtype="float32", quantization="int4", deterministic=True)
    finally:
        kernels.set_mode(before)


def test_it_is_the_default_where_it_runs(tiny, monkeypatch):
    assert EngineConfig(model=str(tiny), device="cpu").deterministic is True
    # A float model, int8 projections or no native kernels: the mode cannot run, so it is off.
    assert EngineConfig(model=str(tiny), device="cpu", dtype="float32").deterministic is False
    assert EngineConfig(model=str(tiny), device="cpu", quantization="int8").deterministic is False
    monkeypatch.setattr(kernels, "native_cpu", lambda: False)
    assert EngineConfig(model=str(tiny), device="cpu").deterministic is False


def test_the_flag_reaches_every_instance():
    args = parse_args(["--deterministic"])
    assert args.deterministic and "--deterministic" in instance_args(args)
    args = parse_args(["--no-deterministic"])
    assert args.deterministic is False and "--no-deterministic" in instance_args(args)
    # Unset: each instance takes its own default.
    assert not {"--deterministic", "--no-deterministic"} & set(instance_args(parse_args([])))
