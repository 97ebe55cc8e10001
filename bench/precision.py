"""One spelling of a precision for every benchmark: ``default``, ``DTYPE`` or ``DTYPE:QUANT``."""

from __future__ import annotations


def precision_kwargs(spec: str) -> dict[str, str]:
    """Engine keyword arguments for ``spec``: ``default`` (the engine's own choice; on CPU
    int4 weights with bfloat16 or float32 activations, by the CPU), ``DTYPE`` (weights in that dtype) or ``DTYPE:QUANT`` (``int8`` or
    ``int4`` weight-only)."""
    if spec == "default":
        return {}
    dtype, _, quantization = spec.partition(":")
    return {"dtype": dtype, "quantization": quantization or "none"}
