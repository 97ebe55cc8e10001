"""The Llama-family decoder (Llama, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV cache.

The forward pass takes a flat batch of tokens from many sequences (no padding): ``input_ids
[T]``, ``positions [T]`` and an :class:`AttentionMetadata` that says which tokens belong to which
sequence and where their KV lives. Every op that touches KV or is a candidate for a custom
kernel goes through :mod:`kernels`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import mooncake_kernels as kernels
from engine.model_config import ModelConfig
from engine.quantization import Int4Weight, PackedWeight, linear


@dataclass
class AttentionMetadata:
    """Where each token of the step reads and writes KV. Built once per step, shared by all layers.

    The first ``num_decodes`` sequences are decodes (one token each, tokens ``0..num_decodes-1``);
    the rest are prefill/extend chunks whose tokens follow. ``*_seq_lens`` are context lengths
    including this step's tokens; ``prefill_query_start_loc`` is relative to the first prefill
    token.
    """

    slot_mapping: torch.Tensor  # [T] int64
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32
    decode_workspace: kernels.DecodeWorkspace | None = None  # split-K buffers (Triton path)
    # Built once per step for the torch twins (None on the Triton path): where the step's tokens
    # are written, and how decode attention reads the contexts.
    cache_slots: kernels.CacheSlots | None = None
    decode_context: kernels.DecodeContext | None = None

    @property
    def num_prefills(self) -> int:
        return self.prefill_seq_lens.shape[0]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with the ``rope_scaling`` the config asks for."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1's scheme: long wavelengths are slowed by `factor`, short ones kept, and the
        # band in between interpolated smoothly (Meta's reference implementation).
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(medium, interpolated, out)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def rope_cos_sin_cache(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """``[max_positions, head_dim]`` fp32: cos in the first half of each row, sin in the second."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), rope_inv_freq(cfg))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        # q, k and v projections fused into one matmul: rows [q | k | v].
        self.qkv_weight = _weight(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.qkv_bias = _weight(self.q_size + 2 * self.kv_size) if cfg.attention_bias else None
        self.o_weight = _weight(cfg.hidden_size, self.q_size)
        self.q_norm = _weight(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _weight(cfg.head_dim) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k rotate together: the query heads and the KV heads as one set of heads.
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = kernels.rotary_embedding(qk, cos_sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q = kernels.rms_norm(q.view(t, self.num_heads, self.head_dim), self.q_norm, self.eps)
            k = kernels.rms_norm(k.view(t, self.num_kv_heads, self.head_dim), self.k_norm, self.eps)
            q = kernels.rotary_embedding(q, cos_sin)
            k = kernels.rotary_embedding(k, cos_sin)
        k_cache, v_cache = kv_cache[self.layer]
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.cache_slots)

        nd = meta.num_decodes
        if meta.num_prefills == 0:
            out = kernels.decode_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                meta.decode_workspace, meta.decode_context,
            )
        elif nd == 0:
            out = kernels.extend_attention(
                q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
                meta.prefill_query_start_loc, self.scale,
            )
        else:
            out = torch.empty_like(q)
            out[:nd] = kernels.decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                meta.decode_workspace, meta.decode_context,
            )
            out[nd:] = kernels.extend_attention(
                q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
                meta.prefill_query_start_loc, self.scale,
            )
        return linear(out.view(t, self.q_size), self.o_weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = _weight(cfg.hidden_size)
        self.attn = Attention(cfg, layer)
        self.post_attn_norm = _weight(cfg.hidden_size)
        self.gate_up_weight = _weight(2 * cfg.intermediate_size, cfg.hidden_size)  # [gate | up]
        self.down_weight = _weight(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = kernels.rms_norm(x, self.input_norm, self.eps)
        else:
            h, residual = kernels.rms_norm(x, self.input_norm, self.eps, residual)
        h = self.attn(h, cos_sin, kv_cache, meta)
        h, residual = kernels.rms_norm(h, self.post_attn_norm, self.eps, residual)
        h = kernels.silu_and_mul(linear(h, self.gate_up_weight))
        return linear(h, self.down_weight), residual


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """The layers pipeline stage ``stage`` of ``stages`` holds: contiguous, as even as can be."""
    if not 0 <= stage < stages <= num_layers:
        raise ValueError(f"stage {stage} of {stages} for a model of {num_layers} layers")
    return range(stage * num_layers // stages, (stage + 1) * num_layers // stages)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; ``kv_cache`` is set by the runner.

    ``kv_cache`` has shape ``[len(layers), 2, num_blocks, num_kv_heads, block_size, head_dim]``
    (see :mod:`kernels.store_kv` for why heads come before slots). A pipeline stage holds only
    ``layers`` of them (and its KV only for those): the first stage also the embedding, the last
    the final norm and the LM head. Layer ``i`` of the model is the stage's local layer
    ``i - layers.start``, in the KV cache and in the layer hooks alike.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, layers: range | None = None):
        super().__init__()
        self.cfg = cfg
        self.layer_range = range(cfg.num_layers) if layers is None else layers
        if self.layer_range.step != 1 or not 0 <= self.layer_range.start < self.layer_range.stop <= cfg.num_layers:
            raise ValueError(f"layers {self.layer_range} of a model of {cfg.num_layers}")
        self.first = self.layer_range.start == 0
        self.last = self.layer_range.stop == cfg.num_layers
        self.embed = _weight(cfg.vocab_size, cfg.hidden_size) if self.first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, j) for j in range(len(self.layer_range)))
        self.norm = _weight(cfg.hidden_size) if self.last else None
        # A last stage without the embedding holds its own copy of a tied head.
        own_head = self.last and (not cfg.tie_word_embeddings or not self.first)
        self.lm_head = _weight(cfg.vocab_size, cfg.hidden_size) if own_head else None
        self.register_buffer("cos_sin", rope_cos_sin_cache(cfg, max_positions), persistent=False)
        self.kv_cache: torch.Tensor | None = None
        # Native decode layers (``enable_native_decode``): one call per layer for a step of up to
        # ``native_rows`` decodes; 0 while they are off.
        self.native_layers: list[object] = []
        self.native_rows = 0
        # The deterministic mode (``make_batch_invariant``): every step runs the native layers,
        # every token one row of its own, and a step that cannot is an error, never another path.
        self.batch_invariant = False

    def enable_native_decode(self, span_tokens: int = 0) -> bool:
        """Run steps of decodes through the native CPU decoder layers (:mod:`kernels.decode_layer`),
        when every projection is an int4 weight in the native kernel's layout (the integer kernels
        at few rows, its dense copy packed for oneDNN past them) or a float weight packed for
        oneDNN. Returns whether they are on. ``span_tokens``: how the layers cut a context's
        attention over the threads (:func:`kernels.native_decode_layer`)."""
        weights, crossovers = [], set()
        for layer in self.layers:
            pairs = {}
            for name, w in (("qkv", layer.attn.qkv_weight), ("o", layer.attn.o_weight),
                            ("gate_up", layer.gate_up_weight), ("down", layer.down_weight)):
                if isinstance(w, Int4Weight) and w.native:
                    pairs[name] = (w.packed, w.packed_dense)
                    crossovers.add(w.max_rows)
                elif isinstance(w, PackedWeight):
                    pairs[name] = (None, w.packed)
                    crossovers.add(0)
                else:
                    return False
            weights.append(pairs)
        # One crossover for the whole layer: each step runs one path.
        if len(crossovers) != 1:
            return False
        int_rows = crossovers.pop()
        self.native_layers = [
            kernels.native_decode_layer(
                layer.input_norm, layer.post_attn_norm, pairs, layer.attn.qkv_bias, layer.attn.q_norm,
                layer.attn.k_norm, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim,
                self.cfg.intermediate_size, self.cfg.rms_norm_eps, int_rows, span_tokens)
            for layer, pairs in zip(self.layers, weights)
        ]
        # Every step of decodes, at any batch, when the dense weights are there.
        self.native_rows = min(layer.max_rows() for layer in self.native_layers)
        return True

    def _native_step(self, meta: AttentionMetadata) -> bool:
        # A step of decodes only, few enough for the int kernels, every token with a cache slot.
        return (0 < meta.num_decodes <= self.native_rows and meta.num_prefills == 0
                and meta.cache_slots is not None and meta.cache_slots.keep is None)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
        before_layer: Callable[[int], None] | None = None,
        hidden: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[len(logits_indices), vocab]`` (fp32) for the selected token positions; a
        stage before the last returns the hidden states and residual ``hidden`` of the next.

        ``on_layer(i)`` is called once layer ``i`` has written this step's K/V into the cache:
        a prefill instance starts sending that layer's KV while the next layers compute.
        ``before_layer(i)`` is called just before layer ``i``: KV loaded from elsewhere for this
        step's prefixes is put in place layer by layer, while the layers before it compute.
        """
        if self.kv_cache is None:
            raise RuntimeError("the model has no KV cache attached")
        if self.first:
            x, residual = F.embedding(input_ids, self.embed), None
        elif hidden is None:
            raise ValueError("a stage after the first takes the hidden states of the one before")
        else:
            x, residual = hidden
        cos_sin = self.cos_sin[positions]  # the step's rows of the rotary table, for every layer
        native = self._native_step(meta)
        if self.batch_invariant and not native:
            raise RuntimeError("the deterministic mode runs every step through the native decode layers, every "
                               "token a row of its own (ModelRunner.prepare); this step's metadata is not that")
        if native:
            # The native layers keep the hidden states and the residual stream in float32.
            x = x.float().contiguous()
            residual = None if residual is None else residual.float().contiguous()
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            if native:
                k_cache, v_cache = self.kv_cache[i]
                x, residual = self.native_layers[i].forward(
                    x, residual, cos_sin, k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables,
                    meta.decode_seq_lens, layer.attn.scale)
            else:
                x, residual = layer(x, residual, cos_sin, self.kv_cache, meta)
            if on_layer is not None:
                on_layer(i)
        if not self.last:
            return x, residual
        # Only the tokens that sample need the final norm and the (large) LM head.
        x, _ = kernels.rms_norm(x[logits_indices], self.norm, self.cfg.rms_norm_eps, residual[logits_indices])
        head = self.embed if self.lm_head is None else self.lm_head
        return linear(x, head).float()
