"""Typed, validated configuration: the model's shape (from ``config.json``) and the engine's knobs."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.cpu_runtime import fast_bfloat16

# Architecture name -> (attention projections carry a bias, per-head q/k RMSNorm).
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

# Weight-only formats (engine.quantization); here so that what only reads the settings (the
# Conductor) does not load the kernels.
QUANTIZATIONS = ("int8", "int4")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs!r}; supported: {sorted(ARCHITECTURES)}"
            )
        bias, qk_norm = ARCHITECTURES[arch]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rope_scaling=cfg.get("rope_scaling"),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", bias)),
                qk_norm=qk_norm,
                eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
                bos_token_id=cfg.get("bos_token_id"),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model folder {folder} has no config.json")
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


ROLES = ("both", "prefill", "decode")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """Engine knobs. ``model`` is a folder, a ``.gguf`` file, or None for the default model."""

    model: str | None = None
    device: str = field(default_factory=default_device)
    # Activations and KV cache (and weights, unless quantized). None: bfloat16, except on a CPU
    # without bfloat16 units (``engine.cpu_runtime.fast_bfloat16``), where it is float32.
    dtype: str | None = None
    block_size: int = 16
    kv_cache_gib: float | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    threads: int | None = None  # torch intra-op threads; None: all cores
    seed: int = 0
    # "both": prefill and decode here (colocated). "prefill": a request ends here after its first
    # token, handed off to a decode instance with its KV (see cluster/instance/prefill.py).
    role: str = "both"
    # Chunked pipeline parallel prefill: (i, X) holds stage i of X, a contiguous range of the
    # layers (``engine.model.stage_layers``). None: the whole model.
    stage: tuple[int, int] | None = None
    # A prompt of at least ``chunk_min_prompt_tokens`` tokens computes at most
    # ``prefill_chunk_tokens`` per step (a CPP group's chunk); a shorter one as much as the step's
    # budget allows, one chunk when it fits. None: the budget is the chunk.
    prefill_chunk_tokens: int | None = None
    chunk_min_prompt_tokens: int = 0
    # Weight-only quantization of the linear layers and the LM head (``engine.quantization``):
    # "int8" or "int4" (CPU), or "none" (the weights stay in ``dtype``). None: int4 on CPU when
    # ``dtype`` is not given either (the fastest setting that passes tests/test_quantization.py's
    # stated tolerance against float32; bench.single measures it), "none" otherwise.
    quantization: str | None = None
    # The KV cache's dtype. None: float32 on CPU, ``dtype`` elsewhere. The torch twins attend in
    # float32, so a float32 cache keeps K and V unrounded and spares each layer converting the
    # contexts it gathers (decode attention alone: 1.25x faster at 56 sequences of ~450 tokens;
    # whole offline runs: within the noise), for twice the bytes per token. A bfloat16 cache
    # reads half the bytes: one stream decoded 46 tok/s against 37-43 (bfloat16, int4 weights).
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if self.quantization is None:
            self.quantization = "int4" if self.device == "cpu" and self.dtype is None else "none"
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" and not fast_bfloat16() else "bfloat16"
        parse_dtype(self.dtype)
        if self.kv_cache_dtype is None:
            self.kv_cache_dtype = "float32" if self.device == "cpu" else self.dtype
        parse_dtype(self.kv_cache_dtype)
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if self.threads is None:
            self.threads = os.cpu_count() or 1
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.quantization != "none":
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization must be 'none' or one of {QUANTIZATIONS}, got {self.quantization!r}")
            if self.device != "cpu":
                raise ValueError(f"{self.quantization} weight-only quantization runs on CPU only")
            if self.dtype not in ("float32", "bfloat16"):
                raise ValueError(f"{self.quantization} weight-only quantization runs with dtype float32 or "
                                 f"bfloat16, got {self.dtype!r}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens <= 0:
            raise ValueError(f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}")
        if self.chunk_min_prompt_tokens < 0:
            raise ValueError(f"chunk_min_prompt_tokens must be >= 0, got {self.chunk_min_prompt_tokens}")
        if self.stage is not None:
            i, n = self.stage
            if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n):
                raise ValueError(f"stage must be (i, X) with 0 <= i < X, got {self.stage!r}")
            if n > 1 and self.role != "prefill":
                raise ValueError("only prefill instances run as pipeline stages")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.kv_cache_dtype)
