"""The one interface through which the engine calls its attention, KV and elementwise ops.

Each op has a torch implementation (``*_torch``, in the op's own file) that is the
specification. The engine calls only the names exported here, so the Triton kernels plug in
behind these functions without touching the model code.
"""

from kernels.activation import silu_and_mul_torch as silu_and_mul
from kernels.attention import decode_attention_torch as decode_attention
from kernels.attention import extend_attention_torch as extend_attention
from kernels.norms import rms_norm_torch as rms_norm
from kernels.rope import rotary_embedding_torch as rotary_embedding
from kernels.store_kv import store_kv_torch as store_kv

__all__ = [
    "decode_attention",
    "extend_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv",
]
