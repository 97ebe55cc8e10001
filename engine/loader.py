"""Build a :class:`CausalLM` from a Hugging Face checkpoint folder (safetensors, sharded or not).

Every tensor in the checkpoint must land somewhere and every parameter must be filled: an
unexpected tensor, a missing one or a shape mismatch is an error that names the file and the
tensor, never a silently half-initialised model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.model import CausalLM

# Tensors some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _targets(model: CausalLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """HF tensor name -> (our parameter, first row, number of rows) it fills."""
    cfg = model.cfg
    t: dict[str, tuple[torch.Tensor, int, int]] = {}

    def whole(name: str, p: torch.Tensor) -> None:
        t[name] = (p, 0, p.shape[0])

    if model.embed is not None:
        whole("model.embed_tokens.weight", model.embed)
    if model.norm is not None:
        whole("model.norm.weight", model.norm)
    if model.lm_head is not None:
        # A tied head is the embedding matrix: a last stage without the embedding loads it as its head.
        whole("model.embed_tokens.weight" if model.cfg.tie_word_embeddings else "lm_head.weight", model.lm_head)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i, layer in zip(model.layer_range, model.layers):
        pre = f"model.layers.{i}."
        attn = layer.attn
        whole(pre + "input_layernorm.weight", layer.input_norm)
        whole(pre + "post_attention_layernorm.weight", layer.post_attn_norm)
        whole(pre + "self_attn.o_proj.weight", attn.o_weight)
        for kind, param in (("weight", attn.qkv_weight), ("bias", attn.qkv_bias)):
            if param is None:
                continue
            t[pre + f"self_attn.q_proj.{kind}"] = (param, 0, q)
            t[pre + f"self_attn.k_proj.{kind}"] = (param, q, kv)
            t[pre + f"self_attn.v_proj.{kind}"] = (param, q + kv, kv)
        if attn.q_norm is not None:
            whole(pre + "self_attn.q_norm.weight", attn.q_norm)
            whole(pre + "self_attn.k_norm.weight", attn.k_norm)
        t[pre + "mlp.gate_proj.weight"] = (layer.gate_up_weight, 0, inter)
        t[pre + "mlp.up_proj.weight"] = (layer.gate_up_weight, inter, inter)
        whole(pre + "mlp.down_proj.weight", layer.down_weight)
    return t


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, via the shard index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model folder {folder} has no *.safetensors file")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint shard {f} is missing")
    return files


def _owned_elsewhere(name: str, model: CausalLM) -> bool:
    """A tensor of the checkpoint that another pipeline stage holds."""
    if name.startswith("model.layers."):
        index = name.split(".")[2]
        # A layer the model has not at all is an unexpected tensor, not another stage's.
        return index.isdigit() and int(index) < model.cfg.num_layers and int(index) not in model.layer_range
    if name == "model.embed_tokens.weight":
        return model.embed is None and not (model.lm_head is not None and model.cfg.tie_word_embeddings)
    if name == "model.norm.weight" or name == "lm_head.weight":
        return model.norm is None
    return False


def load_model(
    folder: str | Path, dtype: torch.dtype, device: str, max_positions: int, layers: range | None = None
) -> CausalLM:
    """The model (``layers``: a pipeline stage's, see ``CausalLM``) with every tensor it holds
    filled from the checkpoint."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    # Parameters are created directly in the target dtype and device: no second full copy.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, max_positions, layers)
    finally:
        torch.set_default_dtype(prev)
    targets = _targets(model)
    loaded: set[str] = set()
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied embeddings: the head is the embedding matrix
                if _owned_elsewhere(name, model):
                    continue
                if name not in targets:
                    raise ValueError(f"{path}: unexpected tensor {name!r} for {cfg.architecture}")
                param, row, rows = targets[name]
                tensor = f.get_tensor(name)
                expected = (rows, *param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {expected}"
                    )
                param.data[row : row + rows].copy_(tensor)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{folder}: checkpoint is missing tensors {missing[:5]}{more}")
    return model.eval()
