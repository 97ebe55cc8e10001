"""Dense float linear layers on CPU through oneDNN, the weight reordered once at load.

``F.linear`` on a CPU float32 weight calls BLAS, which reads the plain ``[N, K]`` weight on
every call and, on the AMD EPYCs measured here, runs well below the machine's vector width.
oneDNN's inner product, given a weight it has reordered once into its blocked layout for this
CPU, ran 1.2-2.5x faster at 32 rows (2 threads, avx512 EPYC: ``[32, 576] x [576, 1536]`` 203
against 136 GFLOP/s, the 49152x576 LM head 180 against 73). These are the matmuls of prefill
chunks and of decode batches past the quantized kernels' crossover, and every matmul of a
float32 model.

The packed weight is a tensor in oneDNN's opaque layout (``layout == torch._mkldnn``): only
:func:`dense_linear_native` reads it. The twin is ``F.linear`` on the plain weight; the two
differ by summation order only.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Rows the reorder is tuned for; any number of rows runs on the same packed weight.
ROWS_HINT = 32
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def dense_native_available(dtype: torch.dtype) -> bool:
    """Whether this torch build can pack and multiply a CPU weight of ``dtype`` through oneDNN on
    this CPU: tried once on a small weight, since oneDNN refuses bfloat16 on a CPU (or under an
    ``ONEDNN_MAX_CPU_ISA`` limit) without AVX-512 or AVX-NE-CONVERT only when asked."""
    if not (dtype in DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 32, dtype=dtype), ROWS_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 32, dtype=dtype), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def pack_dense(weight: torch.Tensor, rows_hint: int = ROWS_HINT) -> torch.Tensor:
    """A plain ``[N, K]`` CPU weight reordered for :func:`dense_linear_native`."""
    if weight.dim() != 2 or weight.device.type != "cpu" or not dense_native_available(weight.dtype):
        raise ValueError(f"oneDNN packs 2-D CPU weights in {[str(d) for d in DTYPES]}; got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)


def dense_linear_native(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``packed`` = ``pack_dense(W)``; ``x [..., K]`` in W's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def dense_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: the plain weight through ``F.linear``."""
    return F.linear(x, weight, bias)
