"""Tiny random checkpoints and an independent dense reference forward, for tests.

``make_tiny_model`` writes a Hugging Face style checkpoint folder (config, safetensors, single
file or sharded with an index, tokenizer, generation config) with random weights scaled so that
logits are far from degenerate. ``dense_reference_logits`` runs the full causal forward of such
a checkpoint in float64 with plain torch: no paging, no KV cache, no code shared with
``engine/``. Tests import both with ``from tiny_models import ...`` (pytest puts ``tests/`` on
``sys.path``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 256
HIDDEN = 64
INTERMEDIATE = 128
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 512
EOS_ID = 1
BOS_ID = 2

# arch -> (num layers, head_dim or None for hidden // heads)
_SHAPES: dict[str, tuple[int, int | None]] = {
    "LlamaForCausalLM": (2, None),
    "Qwen2ForCausalLM": (2, None),
    "Qwen3ForCausalLM": (3, 32),  # 4 heads x 32 = 128 != hidden 64: explicit head_dim
}

# A llama3 rope_scaling that, with head_dim 16 and theta 10000, puts rotary frequencies in all
# three bands (kept, interpolated, slowed down by `factor`).
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _config(arch: str, tie: bool, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    layers, head_dim = _SHAPES[arch]
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                       "Qwen3ForCausalLM": "qwen3"}[arch],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    if rope_scaling is not None:
        cfg["rope_scaling"] = dict(rope_scaling)
    return cfg


def _random_tensors(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    arch = cfg["architectures"][0]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    def norm_weight(n: int) -> torch.Tensor:
        return (1.0 + torch.randn(n, generator=g) * 0.1).contiguous()

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden, std=0.1)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm_weight(hidden)
        t[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden, std=0.1)
        t[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, std=0.1)
        t[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, std=0.1)
        if arch == "Qwen2ForCausalLM":
            t[p + "self_attn.q_proj.bias"] = normal(heads * head_dim, std=0.1)
            t[p + "self_attn.k_proj.bias"] = normal(kv_heads * head_dim, std=0.1)
            t[p + "self_attn.v_proj.bias"] = normal(kv_heads * head_dim, std=0.1)
        if arch == "Qwen3ForCausalLM":
            t[p + "self_attn.q_norm.weight"] = norm_weight(head_dim)
            t[p + "self_attn.k_norm.weight"] = norm_weight(head_dim)
        t[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim, std=0.1)
        t[p + "post_attention_layernorm.weight"] = norm_weight(hidden)
        t[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=0.1)
        t[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=0.1)
        t[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=0.1)
    t["model.norm.weight"] = norm_weight(hidden)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = normal(cfg["vocab_size"], hidden, std=0.1)
    return t


def _write_tokenizer(folder: Path) -> None:
    # Word-level: token i is the word "w{i}", with a few special tokens at the low ids.
    specials = {0: "<unk>", EOS_ID: "</s>", BOS_ID: "<s>"}
    vocab = {specials.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                    "model_max_length": MAX_POSITIONS})
    )
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    )


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], sharded: bool) -> None:
    """Write ``tensors`` as ``model.safetensors``, or as two shards plus an index."""
    for old in list(folder.glob("*.safetensors")) + [folder / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    if not sharded:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    # Alternate tensors between the shards so fused parameters (q/k/v, gate/up) are filled
    # from both files.
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {name: files[i % 2] for i, name in enumerate(names)}
    for f in files:
        save_file({n: tensors[n] for n in names if weight_map[n] == f}, str(folder / f),
                  metadata={"format": "pt"})
    total = sum(x.numel() * x.element_size() for x in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )


def make_tiny_model(
    folder: str | Path,
    arch: str,
    *,
    tie: bool,
    seed: int,
    rope_scaling: dict[str, Any] | None = None,
    sharded: bool = False,
) -> Path:
    """Write a random tiny ``arch`` checkpoint into ``folder`` (created if needed)."""
    if arch not in _SHAPES:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = _config(arch, tie, rope_scaling)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    write_safetensors(folder, _random_tensors(cfg, seed), sharded)
    _write_tokenizer(folder)
    return folder


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``folder`` (single file or sharded)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / f for f in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


# -- the dense reference --------------------------------------------------------------------------

def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    base = [theta ** (-(2 * i) / head_dim) for i in range(head_dim // 2)]
    if not scaling:
        return torch.tensor(base, dtype=torch.float64)
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return torch.tensor(base, dtype=torch.float64)
    if kind == "linear":
        return torch.tensor([f / scaling["factor"] for f in base], dtype=torch.float64)
    if kind != "llama3":
        raise ValueError(f"reference forward does not know rope_scaling {kind!r}")
    factor = scaling["factor"]
    lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    out = []
    for f in base:
        wavelength = 2 * math.pi / f
        if wavelength < orig / hi:  # high frequency: unchanged
            out.append(f)
        elif wavelength > orig / lo:  # low frequency: slowed down by `factor`
            out.append(f / factor)
        else:  # in between: blend the two by how far the wavelength sits in the band
            s = (orig / wavelength - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [H, L, D]; rotate-half: dim i pairs with dim i + D/2.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def dense_reference_logits(folder: str | Path, token_ids: list[int]) -> torch.Tensor:
    """Float64 logits ``[len(token_ids), vocab]`` of a full causal forward over ``token_ids``."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["architectures"][0]
    if arch not in _SHAPES:
        raise ValueError(f"reference forward does not know {arch!r}")
    w = {k: v.to(torch.float64) for k, v in read_tensors(folder).items()}
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    eps = cfg.get("rms_norm_eps", 1e-6)
    bias = arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False)
    qk_norm = arch == "Qwen3ForCausalLM"
    n = len(token_ids)

    inv_freq = _inv_freq(head_dim, cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling"))
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [L, D/2]
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()

    x = w["model.embed_tokens.weight"][torch.tensor(token_ids, dtype=torch.long)]  # [L, H]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        proj = {}
        for name in ("q", "k", "v"):
            y = h @ w[p + f"self_attn.{name}_proj.weight"].T
            if bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y
        q = proj["q"].view(n, heads, head_dim).transpose(0, 1)  # [Hq, L, D]
        k = proj["k"].view(n, kv_heads, head_dim).transpose(0, 1)  # [Hkv, L, D]
        v = proj["v"].view(n, kv_heads, head_dim).transpose(0, 1)
        if qk_norm:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = heads // kv_heads
        k = k.repeat_interleave(group, dim=0)  # query head j uses KV head j // group
        v = v.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(head_dim)  # [Hq, L, L]
        scores = scores.masked_fill(~causal, float("-inf"))
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = scores.exp()
        probs = probs / probs.sum(dim=-1, keepdim=True)
        attn = (probs @ v).transpose(0, 1).reshape(n, heads * head_dim)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        act = gate / (1 + torch.exp(-gate)) * up
        x = x + act @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T
