"""Convert a llama-architecture GGUF file into a Hugging Face style checkpoint folder.

The engine's loader only understands the HF layout (config.json, model.safetensors,
tokenizer.json). Converting once, up front, keeps GGUF knowledge out of the hot path:
weights are dequantized to float32 here and the rest of the engine never sees a
quantized tensor.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

# GGUF token types (llama.cpp's llama_token_type): control and user-defined tokens must
# never be split by the BPE model, so they become added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_PER_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation so RoPE can use HF's rotate-half pairing.

    llama.cpp rotates adjacent rows (2i, 2i+1) of each head; HF rotates row i with row
    i + head_dim/2. Within each head, llama.cpp row 2i+j came from HF row j*head_dim/2 + i,
    so viewing rows as (head_dim/2, 2) and transposing to (2, head_dim/2) restores HF order.
    """
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _require(reader: gguf.GGUFReader, key: str, path: Path) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"{path}: missing required GGUF metadata key {key!r}")
    return value


def _rope_scaling(reader: gguf.GGUFReader, path: Path) -> dict[str, Any] | None:
    # llama.cpp stores Llama-3 style scaling as a `rope_freqs` tensor instead of metadata;
    # that case is rejected when the tensor is encountered.
    kind = _field(reader, "llama.rope.scaling.type")
    factor = _field(reader, "llama.rope.scaling.factor")
    if kind is None and factor is None:
        return None
    if kind in (None, "none") and (factor is None or factor == 1.0):
        return None
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    raise ValueError(
        f"{path}: unsupported RoPE scaling (llama.rope.scaling.type={kind!r}, factor={factor!r}); "
        "only 'linear' scaling is supported"
    )


def _build_config(reader: gguf.GGUFReader, path: Path, vocab_size: int, tied: bool) -> dict[str, Any]:
    hidden = int(_require(reader, "llama.embedding_length", path))
    n_heads = int(_require(reader, "llama.attention.head_count", path))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // n_heads))
    rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        # Partial rotary embeddings would silently produce a wrong model in our loader.
        raise ValueError(f"{path}: partial RoPE (rope dims {rope_dim} != head_dim {head_dim}) is unsupported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, "llama.feed_forward_length", path)),
        "num_hidden_layers": int(_require(reader, "llama.block_count", path)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_require(reader, "llama.context_length", path)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "rope_scaling": _rope_scaling(reader, path),
    }


def _hf_tensor_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.match(name)
    if match and match.group(2) in _PER_LAYER_NAMES:
        return f"model.layers.{int(match.group(1))}.{_PER_LAYER_NAMES[match.group(2)]}"
    if name == "rope_freqs.weight":
        raise ValueError(f"{path}: tensor {name!r} (Llama-3 style RoPE frequency scaling) is unsupported")
    raise ValueError(f"{path}: unknown GGUF tensor {name!r}")


def _convert_tensors(
    reader: gguf.GGUFReader, path: Path, config: dict[str, Any], progress: bool
) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc=f"Converting {path.name}", unit="tensor", disable=not progress):
        hf_name = _hf_tensor_name(tensor.name, path)
        # GGUF lists dims fastest-varying first (ne0 = in_features); numpy/HF want the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            array = unpermute_qk(array, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            array = unpermute_qk(array, config["num_key_value_heads"])
        tensors[hf_name] = np.ascontiguousarray(array)
    return tensors


def _build_tokenizer(reader: gguf.GGUFReader, path: Path) -> Tokenizer:
    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(f"{path}: unsupported tokenizer model {model_kind!r}; only 'gpt2' (byte-level BPE) is supported")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt2"):
        pre_tokenizer = byte_level
    else:
        raise ValueError(f"{path}: unsupported tokenizer pre-tokenizer {pre!r}; supported: smollm, default, gpt2")

    tokens: list[str] = _require(reader, "tokenizer.ggml.tokens", path)
    merges = [tuple(m.split(" ", 1)) for m in _require(reader, "tokenizer.ggml.merges", path)]
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type", [])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    # Added in id order so each special string keeps the id it has in the vocab.
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_special_tokens(special)

    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _token_str(tokens: list[str], token_id: int | None) -> str | None:
    return None if token_id is None else tokens[token_id]


def _write_checkpoint(reader: gguf.GGUFReader, path: Path, dest: Path, progress: bool) -> None:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: unsupported architecture {arch!r}; only 'llama' is supported")
    tokens: list[str] = _require(reader, "tokenizer.ggml.tokens", path)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = _build_config(reader, path, len(tokens), tied)
    tokenizer = _build_tokenizer(reader, path)

    tensors = _convert_tensors(reader, path, config, progress)
    embed_rows = tensors["model.embed_tokens.weight"].shape[0]
    if embed_rows != config["vocab_size"]:
        raise ValueError(f"{path}: token_embd has {embed_rows} rows but the vocab has {config['vocab_size']} tokens")
    # Written from numpy, so converting needs no torch (the Conductor may be the first to convert
    # the default model); "format": "pt" as torch's writer sets it, for loaders that check it.
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates the file owner-only; match the other files' ordinary mode.
    (dest / "model.safetensors").chmod(0o644)
    tokenizer.save(str(dest / "tokenizer.json"))

    bos_id, eos_id = config["bos_token_id"], config["eos_token_id"]
    tokenizer_config = {
        "bos_token": _token_str(tokens, bos_id),
        "eos_token": _token_str(tokens, eos_id),
        "pad_token": _token_str(tokens, _field(reader, "tokenizer.ggml.padding_token_id")),
        "unk_token": _token_str(tokens, _field(reader, "tokenizer.ggml.unknown_token_id")),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": config["max_position_embeddings"],
    }
    _write_json(dest / "tokenizer_config.json", tokenizer_config)
    _write_json(dest / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    # config.json goes last: its presence is what marks a folder as a usable checkpoint.
    _write_json(dest / "config.json", config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Convert a llama GGUF file into an HF checkpoint folder at `out_dir` and return it.

    Everything is written to a temporary sibling folder that is renamed into place at the
    end, so an interrupted conversion never leaves a folder that looks complete.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"refusing to overwrite non-empty directory {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's private 0700 would otherwise carry over to the final folder
        _write_checkpoint(gguf.GGUFReader(gguf_path), gguf_path, tmp, progress)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename cannot replace a directory otherwise
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
