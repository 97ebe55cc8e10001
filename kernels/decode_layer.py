"""A whole decoder layer for a step whose tokens are all decodes, as one native CPU call.

Its twin is the eager layer, ``engine.model.DecoderLayer.forward`` (the ops of this package one
by one): input RMSNorm with the residual add, the fused q/k/v projection (+ bias), q/k RMSNorm
where the model has it, rotary, K and V into the paged cache, paged decode attention, the
output projection, post-attention RMSNorm with the residual add, gate/up, SiLU-and-mul, down.
The native layer runs them over float32 activations with the projections' int4 weights in the
layout of :mod:`kernels.quant_linear`, in one OpenMP region: at one decode row the eager layer
is ~200 ATen calls, most of a step's time once the matmuls are fast.
"""

from __future__ import annotations

import torch

from . import cpu_ext


def native_decode_layer(
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    qkv: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    o: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
) -> object:
    """The native layer over these weights (q4-packed projections, see :func:`kernels.pack_q4`).

    Its ``forward(x, residual, cos_sin, k_cache, v_cache, slots, block_tables, seq_lens, scale)``
    takes float32 ``x [M, hidden]`` (and the residual stream, None on the first layer), the
    tokens' rotary rows ``[M, head_dim]``, the layer's caches, each token's cache slot (int64,
    all valid) and its sequence's block table and length (int32, the length counting this
    token), and returns the layer's ``(hidden, residual)``, float32.
    """
    return cpu_ext.load().DecodeLayer(input_norm, post_norm, qkv, qkv_bias, q_norm, k_norm, o, gate_up, down,
                                      num_heads, num_kv_heads, head_dim, eps)
