"""The engine's logits equal an independent dense float64 forward, whatever the batching.

Every row of logits the engine hands its sampler is checked against ``dense_reference_logits``
(tests/tiny_models.py) at the same position, for Llama (tied, untied, llama3 rope scaling),
Qwen2 (q/k/v bias), Qwen3 (q/k norm, explicit head_dim) and sharded checkpoints, under plain
prefill + decode, mixed decode/prefill batches, chunked prefill and prefix-cache hits. Also the
loader's errors for broken checkpoints.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from tiny_models import (
    LLAMA3_ROPE_SCALING,
    dense_reference_logits,
    make_tiny_model,
    read_tensors,
    write_safetensors,
)

torch.set_num_threads(2)

ATOL = 1e-4

MODELS: dict[str, dict] = {
    "llama-untied": dict(arch="LlamaForCausalLM", tie=False, seed=11),
    "llama-tied": dict(arch="LlamaForCausalLM", tie=True, seed=12),
    "llama3-rope": dict(arch="LlamaForCausalLM", tie=False, seed=13, rope_scaling=LLAMA3_ROPE_SCALING),
    "qwen2": dict(arch="Qwen2ForCausalLM", tie=True, seed=14),
    "qwen3": dict(arch="Qwen3ForCausalLM", tie=False, seed=15),
    # Same weights as llama-untied, written as two shards.
    "llama-sharded": dict(arch="LlamaForCausalLM", tie=False, seed=11, sharded=True),
    "qwen3-sharded": dict(arch="Qwen3ForCausalLM", tie=True, seed=16, sharded=True),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(root / name, **spec) for name, spec in MODELS.items()}


@pytest.fixture(params=list(MODELS))
def model_dir(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Path:
    return model_dirs[request.param]


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class Harness:
    """An engine whose sampler inputs and scheduled batches are recorded per request."""

    def __init__(self, folder: Path, **config):
        self.folder = folder
        self.engine = LLMEngine(
            EngineConfig(model=str(folder), threads=2, dtype="float32", kv_cache_gib=0.01, **config)
        )
        # request id -> [(context the logits predict after, logits row)]
        self.records: dict[str, list[tuple[list[int], torch.Tensor]]] = defaultdict(list)
        # one entry per step: [(request id, tokens computed before the step, new tokens)]
        self.batches: list[list[tuple[str, int, int]]] = []
        self.outputs: dict[str, list[RequestOutput]] = defaultdict(list)
        self.max_tokens: dict[str, int] = {}

        engine = self.engine
        sampler, run = engine.sampler, engine.runner.run

        def recording_sampler(logits, states):
            owner = {id(seq.sampling): rid for rid, seq in engine.seqs.items()}
            assert logits.shape == (len(states), engine.model_config.vocab_size)
            for row, state in zip(logits, states):
                context = list(state.prompt_token_ids) + list(state.output_token_ids)
                self.records[owner[id(state)]].append((context, row.detach().double().clone()))
            return sampler(logits, states)

        def recording_run(batch, *hooks):
            self.batches.append(
                [(s.seq.request_id, s.seq.num_computed_tokens, s.num_new_tokens) for s in batch]
            )
            return run(batch, *hooks)

        engine.sampler = recording_sampler
        engine.runner.run = recording_run

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.engine.add_request(prompt, _greedy(max_tokens), request_id=rid)
        self.max_tokens[rid] = max_tokens

    def step(self) -> None:
        for out in self.engine.step():
            self.outputs[out.request_id].append(out)

    def run_to_completion(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                return
            self.step()
        raise AssertionError("engine did not finish")

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] for t in out.new_token_ids]

    def check_logits(self, rid: str) -> None:
        """Every logits row of ``rid`` equals the dense forward at the same position."""
        recs = self.records[rid]
        assert len(recs) == self.max_tokens[rid] == len(self.tokens(rid))
        assert self.outputs[rid][-1].finished
        full = recs[-1][0]
        ref = dense_reference_logits(self.folder, full)
        for context, row in recs:
            assert full[: len(context)] == context
            expected = ref[len(context) - 1]
            err = (row - expected).abs().max().item()
            assert err <= ATOL, f"{rid}: logits after {len(context)} tokens off by {err:.3g}"
        # The sampled tokens are the ones the records continue with.
        assert full[len(recs[0][0]):] + [self.tokens(rid)[-1]] == self.tokens(rid)

    def assert_idle_and_clean(self) -> None:
        engine = self.engine
        assert not engine.has_unfinished()
        engine.block_manager.check_integrity()
        assert engine.block_manager.pool.num_in_use == 0


def test_reference_logits_are_not_degenerate(model_dirs: dict[str, Path]) -> None:
    for name, folder in model_dirs.items():
        ref = dense_reference_logits(folder, _prompt(0, 24))
        assert ref.shape == (24, 256)
        assert torch.isfinite(ref).all()
        assert ref.std(dim=-1).min() > 0.3, name
        assert (ref[1:] - ref[:-1]).abs().max() > 0.1, name


def test_reference_rope_scaling_matters(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    # Guard against the llama3 case passing only because scaling has no effect at these lengths.
    scaled = model_dirs["llama3-rope"]
    plain = tmp_path / "plain"
    shutil.copytree(scaled, plain)
    cfg = json.loads((plain / "config.json").read_text())
    del cfg["rope_scaling"]
    (plain / "config.json").write_text(json.dumps(cfg))
    ids = _prompt(1, 40)
    diff = (dense_reference_logits(scaled, ids) - dense_reference_logits(plain, ids)).abs()
    assert diff[:1].max() < 1e-9  # position 0 is not rotated at all
    assert diff[20:].max() > 1e-2


def test_prefill_then_decode(model_dir: Path) -> None:
    h = Harness(model_dir, block_size=16)
    prompt = _prompt(1, 13)
    h.add("a", prompt, 6)
    h.run_to_completion()
    assert h.batches[0] == [("a", 0, 13)]
    assert [b for b in h.batches[1:]] == [[("a", 13 + i, 1)] for i in range(5)]
    # Each step's logits against a fresh dense forward of prompt + generated tokens.
    for context, row in h.records["a"]:
        expected = dense_reference_logits(model_dir, context)[-1]
        assert (row - expected).abs().max().item() <= ATOL
    h.check_logits("a")
    h.assert_idle_and_clean()


def test_batch_with_requests_added_mid_run(model_dir: Path) -> None:
    h = Harness(model_dir, block_size=8)
    h.add("a", _prompt(2, 5), 8)
    h.add("b", _prompt(3, 17), 6)
    h.add("c", _prompt(4, 9), 10)
    h.step()
    h.step()
    h.add("d", _prompt(5, 23), 5)
    h.step()
    h.add("e", _prompt(6, 3), 4)
    h.run_to_completion()
    mixed = [b for b in h.batches if any(n == 1 for _, _, n in b) and any(n > 1 for _, _, n in b)]
    assert mixed, "no step mixed decodes with a prefill"
    assert max(len(b) for b in h.batches) >= 4
    for rid in "abcde":
        h.check_logits(rid)
    h.assert_idle_and_clean()


def test_chunked_prefill(model_dir: Path) -> None:
    budget = 8
    h = Harness(model_dir, block_size=4, max_num_batched_tokens=budget)
    prompts = {"a": _prompt(7, 30), "b": _prompt(8, 41), "c": _prompt(9, 50)}
    h.add("a", prompts["a"], 4)
    h.add("b", prompts["b"], 3)
    for _ in range(3):
        h.step()
    h.add("c", prompts["c"], 5)
    h.run_to_completion()
    assert all(sum(n for _, _, n in b) <= budget for b in h.batches)
    for rid, prompt in prompts.items():
        chunks = [(start, n) for b in h.batches for r, start, n in b if r == rid and start < len(prompt)]
        assert len(chunks) >= -(-len(prompt) // budget)
        # The chunks tile the prompt in order.
        assert [s for s, _ in chunks] == [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
        assert sum(n for _, n in chunks) == len(prompt)
        h.check_logits(rid)
    h.assert_idle_and_clean()


def test_prefix_cache_hits(model_dir: Path) -> None:
    bs = 4
    h = Harness(model_dir, block_size=bs)
    engine = h.engine
    a = _prompt(10, 33)
    tail = _prompt(11, 10)
    tail[0] = a[20] + 1 if a[20] < 255 else 3
    cases = [
        # request id, prompt, max_tokens, expected cached tokens
        ("a", a, 5, 0),
        ("b", a[:20] + tail, 4, 20),  # shares A's first 5 blocks
        ("c", list(a), 5, 32),  # all of A but its last token: only that one is computed
        ("d", a[:32], 3, 28),  # block-aligned prompt: its last block is recomputed
    ]
    for rid, prompt, max_tokens, cached in cases:
        before = engine.stats().num_prompt_tokens_computed
        h.add(rid, prompt, max_tokens)
        h.run_to_completion()
        assert [o.num_cached_tokens for o in h.outputs[rid]] == [cached] * max_tokens
        assert engine.stats().num_prompt_tokens_computed - before == len(prompt) - cached
        assert h.batches[-max_tokens] == [(rid, cached, len(prompt) - cached)]
        h.check_logits(rid)
        h.assert_idle_and_clean()
    assert engine.block_manager.pool.num_cached_unused > 0


def test_sharded_equals_single_file(model_dirs: dict[str, Path]) -> None:
    rows = []
    for name in ("llama-untied", "llama-sharded"):
        h = Harness(model_dirs[name], block_size=8)
        h.add("a", _prompt(12, 11), 4)
        h.run_to_completion()
        rows.append(torch.stack([row for _, row in h.records["a"]]))
        assert len(list(model_dirs[name].glob("*.safetensors"))) == (2 if "sharded" in name else 1)
    assert torch.equal(rows[0], rows[1])


# -- loader errors ----------------------------------------------------------------------------------

def _load(folder: Path):
    return load_model(folder, torch.float32, "cpu", 512)


def _rewrite(folder: Path, edit) -> None:
    tensors = read_tensors(folder)
    edit(tensors)
    write_safetensors(folder, tensors, sharded=(folder / "model.safetensors.index.json").is_file())


def test_loader_accepts_every_tiny_model(model_dirs: dict[str, Path]) -> None:
    for name, folder in model_dirs.items():
        model = _load(folder)
        assert model.cfg.architecture == MODELS[name]["arch"]


def test_unknown_architecture(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=False, seed=0)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        _load(folder)
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        LLMEngine(EngineConfig(model=str(folder), threads=2, kv_cache_gib=0.01, dtype="float32"))


@pytest.mark.parametrize(
    "arch,tie,name",
    [
        ("LlamaForCausalLM", False, "model.layers.1.mlp.up_proj.weight"),
        ("LlamaForCausalLM", False, "lm_head.weight"),
        ("LlamaForCausalLM", True, "model.embed_tokens.weight"),
        ("Qwen2ForCausalLM", True, "model.layers.0.self_attn.k_proj.bias"),
        ("Qwen3ForCausalLM", False, "model.layers.2.self_attn.q_norm.weight"),
    ],
)
def test_missing_tensor(tmp_path: Path, arch: str, tie: bool, name: str) -> None:
    folder = make_tiny_model(tmp_path / "m", arch, tie=tie, seed=0)
    _rewrite(folder, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=re.escape(name)):
        _load(folder)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"]
)
def test_wrong_shape(tmp_path: Path, name: str, sharded: bool) -> None:
    folder = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=False, seed=0, sharded=sharded)

    def edit(t: dict[str, torch.Tensor]) -> None:
        rows, cols = t[name].shape
        t[name] = torch.zeros(rows + 1, cols)

    _rewrite(folder, edit)
    if sharded:
        file = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    else:
        file = "model.safetensors"
    with pytest.raises(ValueError, match=re.escape(name)) as err:
        _load(folder)
    assert file in str(err.value)


def test_missing_shard(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m", "Qwen2ForCausalLM", tie=False, seed=0, sharded=True)
    missing = "model-00002-of-00002.safetensors"
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        _load(folder)


@pytest.mark.parametrize(
    "arch,name",
    [
        ("LlamaForCausalLM", "model.layers.2.mlp.up_proj.weight"),  # only 2 layers
        ("LlamaForCausalLM", "model.layers.0.self_attn.q_proj.bias"),  # Llama has no bias
        ("Qwen2ForCausalLM", "model.layers.0.self_attn.q_norm.weight"),  # Qwen2 has no q_norm
    ],
)
def test_unexpected_tensor(tmp_path: Path, arch: str, name: str) -> None:
    folder = make_tiny_model(tmp_path / "m", arch, tie=False, seed=0)

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(64)

    _rewrite(folder, edit)
    with pytest.raises(ValueError, match=re.escape(name)):
        _load(folder)


def test_unexpected_tensor_in_a_shard(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=False, seed=0, sharded=True)
    extra = folder / "model-00002-of-00002.safetensors"
    tensors = read_tensors(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    mine = {n: tensors[n] for n, f in index["weight_map"].items() if f == extra.name}
    mine["model.extra_head.weight"] = torch.zeros(4, 4)
    save_file(mine, str(extra))
    with pytest.raises(ValueError, match=re.escape("model.extra_head.weight")):
        _load(folder)
