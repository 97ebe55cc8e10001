"""A whole decoder layer for a step whose tokens are all decodes, as one native CPU call.

Its twin is the eager layer, ``engine.model.DecoderLayer.forward`` (the ops of this package one
by one): input RMSNorm with the residual add, the fused q/k/v projection (+ bias), q/k RMSNorm
where the model has it, rotary, K and V into the paged cache, paged decode attention, the
output projection, post-attention RMSNorm with the residual add, gate/up, SiLU-and-mul, down.
The native layer runs them over float32 activations: up to ``int_rows`` rows (every row count
by default) with the integer GEMM on the projections' int4 weights (:mod:`kernels.quant_linear`),
in one OpenMP region; past them with oneDNN's matmuls on the dense weights packed once
(:mod:`kernels.dense_linear`), called from C++ between four OpenMP regions that do everything else. At one decode row the eager layer is ~200
ATen calls, most of a step's time once the matmuls are fast; at 64 rows its elementwise ops and
their conversions were a third of the step.
"""

from __future__ import annotations

import torch

from . import cpu_ext


def native_decode_layer(
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    projections: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]],
    qkv_bias: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    eps: float,
    int_rows: int,
    span_tokens: int = 0,
) -> object:
    """The native layer over these weights. ``projections`` maps ``qkv``, ``o``, ``gate_up`` and
    ``down`` to ``(q4, dense)``: the q4-packed weight (:func:`kernels.pack_q4`) that the integer
    kernels multiply by at up to ``int_rows`` rows, and the dense weight packed for oneDNN
    (:func:`kernels.pack_dense`, float32 or bfloat16) that takes the steps past them; either may be
    None where no step needs it (``int_rows`` 0: dense only). ``max_rows()`` is the most rows a
    step may have (any, with every dense weight). ``span_tokens``: 0 splits each context's
    attention evenly over the threads, by how many rows the step has; > 0 cuts it every that many
    tokens from its start, so that with ``int_rows`` past any step a row's result is the same
    bits whatever else the step holds (the engine's deterministic mode).

    Its ``forward(x, residual, cos_sin, k_cache, v_cache, slots, block_tables, seq_lens, scale)``
    takes float32 ``x [M, hidden]`` (and the residual stream, None on the first layer), the
    tokens' rotary rows ``[M, head_dim]``, the layer's caches, each token's cache slot (int64,
    all valid) and its sequence's block table and length (int32, the length counting this
    token), and returns the layer's ``(hidden, residual)``, float32.
    """
    (qkv, qkv_dense), (o, o_dense) = projections["qkv"], projections["o"]
    (gate_up, gate_up_dense), (down, down_dense) = projections["gate_up"], projections["down"]
    return cpu_ext.load().DecodeLayer(input_norm, post_norm, qkv, qkv_dense, qkv_bias, q_norm, k_norm, o, o_dense,
                                      gate_up, gate_up_dense, down, down_dense, num_heads, num_kv_heads, head_dim,
                                      intermediate_size, eps, int_rows, span_tokens)
