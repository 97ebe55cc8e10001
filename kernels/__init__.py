"""The one interface through which the engine calls its attention, KV and elementwise ops.

Each op has a Triton kernel (``*_triton``) and a torch twin (``*_torch``) that is its
specification, both in the op's own file. :mod:`kernels.dispatch` decides per call: Triton for
CUDA tensors, the twin for CPU tensors, unless ``MOONCAKE_KERNELS`` forces one of them.
"""

# dispatch first: it may set TRITON_INTERPRET, which must precede every `import triton`.
from kernels.dispatch import mode, set_mode, use_triton  # noqa: I001
from kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from kernels.decode_attention import decode_attention_torch, decode_attention_triton
from kernels.extend_attention import extend_attention_torch, extend_attention_triton
from kernels.kv_transfer import gather_kv_torch, gather_kv_triton, scatter_kv_torch, scatter_kv_triton
from kernels.norms import rms_norm_torch, rms_norm_triton
from kernels.rope import rotary_embedding_torch, rotary_embedding_triton
from kernels.store_kv import store_kv_torch, store_kv_triton


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    if use_triton(k_cache):
        return store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return store_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    if use_triton(q):
        return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale)


def extend_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    if use_triton(q):
        return extend_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
        )
    return extend_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def rms_norm(x, weight, eps, residual=None):
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rotary_embedding(positions, x, cos_sin_cache):
    if use_triton(x):
        return rotary_embedding_triton(positions, x, cos_sin_cache)
    return rotary_embedding_torch(positions, x, cos_sin_cache)


def silu_and_mul(x):
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)


def gather_kv(kv_cache, block_ids, layers=None, out=None):
    """Pack ``block_ids`` of ``layers`` (K and V) into ``[n_layers, 2, n_blocks, Hkv, bs, D]``."""
    if use_triton(kv_cache):
        return gather_kv_triton(kv_cache, block_ids, layers, out)
    return gather_kv_torch(kv_cache, block_ids, layers, out)


def scatter_kv(buffer, kv_cache, block_ids, layers=None):
    """Unpack a :func:`gather_kv` buffer into ``block_ids`` of ``layers`` of ``kv_cache``."""
    if use_triton(kv_cache):
        return scatter_kv_triton(buffer, kv_cache, block_ids, layers)
    return scatter_kv_torch(buffer, kv_cache, block_ids, layers)


__all__ = [
    "decode_attention",
    "extend_attention",
    "gather_kv",
    "mode",
    "rms_norm",
    "rotary_embedding",
    "scatter_kv",
    "set_mode",
    "silu_and_mul",
    "store_kv",
    "use_triton",
]
