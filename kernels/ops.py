"""The one interface through which the engine calls its attention, KV and elementwise ops.

Each op has a Triton kernel (``*_triton``) and a torch twin (``*_torch``) that is its
specification, both in the op's own file; some also a native CPU kernel (``*_native``, C++ in
``kernels/csrc``, built at first use by :mod:`.cpu_ext`). :mod:`.dispatch` decides
per call: Triton for CUDA tensors, the native kernel or else the twin for CPU tensors, unless
``MOONCAKE_KERNELS`` forces one of them.
"""

from __future__ import annotations

# dispatch first: it may set TRITON_INTERPRET, which must precede every `import triton`.
from .dispatch import mode, native_cpu, set_mode, use_triton  # noqa: I001
from .cpu_ext import load as load_native
from .activation import silu_and_mul_torch, silu_and_mul_triton
from .decode_attention import (
    DecodeWorkspace, decode_attention_native, decode_attention_torch, decode_attention_triton,
)
from .decode_layer import native_decode_layer
from .dense_linear import dense_linear_native, dense_linear_torch, dense_native_available, pack_dense
from .extend_attention import extend_attention_torch, extend_attention_triton
from .kv_transfer import LayerSel, gather_kv_torch, gather_kv_triton, scatter_kv_torch, scatter_kv_triton
from .norms import rms_norm_torch, rms_norm_triton
from .paged import DecodeContext
from .quant_linear import (
    BLOCK as QUANT_BLOCK, pack_q4, pack_q8, quant_linear_native, quant_linear_torch, unpack_q4, unpack_q8,
)
from .rope import rotary_embedding_torch, rotary_embedding_triton
from .store_kv import CacheSlots, store_kv_torch, store_kv_triton
from torch import Tensor


def store_kv(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, slots: CacheSlots | None = None
) -> None:
    """``slots`` (torch only): the twin's block and offset of each slot, built once per step."""
    if use_triton(k_cache):
        return store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return store_kv_torch(k, v, k_cache, v_cache, slot_mapping, slots)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    workspace: DecodeWorkspace | None = None,
    context: DecodeContext | None = None,
) -> Tensor:
    """``workspace`` (Triton only) holds the split-K partials, so the call allocates nothing;
    ``context`` (torch only) is how the twin reads the contexts, built once per step."""
    if use_triton(q):
        return decode_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, scale, workspace=workspace
        )
    if native_cpu():
        return decode_attention_native(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, context)


def extend_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
) -> Tensor:
    if use_triton(q):
        return extend_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
        )
    return extend_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rotary_embedding(x: Tensor, cos_sin: Tensor) -> Tensor:
    """``cos_sin [T, D]``: each token's row of the rotary table (gathered once per step)."""
    if use_triton(x):
        return rotary_embedding_triton(x, cos_sin)
    return rotary_embedding_torch(x, cos_sin)


def silu_and_mul(x: Tensor) -> Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)


def gather_kv(
    kv_cache: Tensor, block_ids: Tensor | list[int], layers: LayerSel = None, out: Tensor | None = None
) -> Tensor:
    """Pack ``block_ids`` of ``layers`` (K and V) into ``[n_layers, 2, n_blocks, Hkv, bs, D]``."""
    if use_triton(kv_cache):
        return gather_kv_triton(kv_cache, block_ids, layers, out)
    return gather_kv_torch(kv_cache, block_ids, layers, out)


def scatter_kv(
    buffer: Tensor, kv_cache: Tensor, block_ids: Tensor | list[int], layers: LayerSel = None
) -> None:
    """Unpack a :func:`gather_kv` buffer into ``block_ids`` of ``layers`` of ``kv_cache``."""
    if use_triton(kv_cache):
        return scatter_kv_triton(buffer, kv_cache, block_ids, layers)
    return scatter_kv_torch(buffer, kv_cache, block_ids, layers)


__all__ = [
    "QUANT_BLOCK",
    "CacheSlots",
    "DecodeContext",
    "DecodeWorkspace",
    "decode_attention",
    "dense_linear_native",
    "dense_linear_torch",
    "dense_native_available",
    "extend_attention",
    "gather_kv",
    "load_native",
    "mode",
    "native_cpu",
    "native_decode_layer",
    "pack_dense",
    "pack_q4",
    "pack_q8",
    "quant_linear_native",
    "quant_linear_torch",
    "unpack_q4",
    "unpack_q8",
    "rms_norm",
    "rotary_embedding",
    "scatter_kv",
    "set_mode",
    "silu_and_mul",
    "store_kv",
    "use_triton",
]
