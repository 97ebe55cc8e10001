"""The model's shape (from ``config.json``) and the names the engine's settings take.

Plain data, no torch: what only reads a model's shape or checks a setting (the Conductor, which
tokenizes and routes; ``python -m server``'s command line; ``engine.kv_layout``) does not load
torch for it. ``engine.config`` holds the engine's own knobs and maps these names to torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Architecture name -> (attention projections carry a bias, per-head q/k RMSNorm).
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

# Weight-only formats (engine.quantization).
QUANTIZATIONS = ("int8", "int4")

# The dtypes activations, weights and the KV cache may take, by name (torch's, without
# ``torch.``), and the bytes of one element.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def dtype_bytes(name: str) -> int:
    """Bytes of one element of dtype ``name``; raises ``ValueError`` (the caller's setting) for
    a name not in ``DTYPE_BYTES``."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's shape, read from its ``config.json`` (``from_folder``)."""

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

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V one token occupies across all layers, in a cache of ``dtype`` (a
        name of ``DTYPE_BYTES``)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)
