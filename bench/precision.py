"""One spelling of a precision for every benchmark: ``default``, ``DTYPE`` or ``DTYPE:QUANT``, and
``deterministic`` (the default precision in the engine's deterministic mode)."""

from __future__ import annotations


def precision_kwargs(spec: str) -> dict[str, str | bool]:
    """Engine keyword arguments for ``spec``: ``default`` (the engine's own choice; on CPU
    int4 weights with bfloat16 or float32 activations, by the CPU), ``DTYPE`` (weights in that dtype),
    ``DTYPE:QUANT`` (``int8`` or ``int4`` weight-only) or ``deterministic`` (the default's
    precision, every row through the integer kernels: ``EngineConfig.deterministic``)."""
    if spec == "default":
        return {}
    if spec == "deterministic":
        return {"deterministic": True}
    dtype, _, quantization = spec.partition(":")
    return {"dtype": dtype, "quantization": quantization or "none"}
