"""One spelling of a precision for every benchmark: ``default``, ``DTYPE`` or ``DTYPE:QUANT``, and
``deterministic`` / ``nondeterministic`` (the default precision with the engine's deterministic
mode on or off, whatever the default is on this machine)."""

from __future__ import annotations


def precision_kwargs(spec: str) -> dict[str, str | bool]:
    """Engine keyword arguments for ``spec``: ``default`` (the engine's own choice; on CPU
    int4 weights with bfloat16 or float32 activations, by the CPU), ``DTYPE`` (weights in that dtype),
    ``DTYPE:QUANT`` (``int8`` or ``int4`` weight-only), ``deterministic`` (the default's
    precision, every row through the integer GEMM: ``EngineConfig.deterministic``) or
    ``nondeterministic`` (the same, with large steps on a dense matmul where one measured faster)."""
    if spec == "default":
        return {}
    if spec in ("deterministic", "nondeterministic"):
        return {"deterministic": spec == "deterministic"}
    dtype, _, quantization = spec.partition(":")
    return {"dtype": dtype, "quantization": quantization or "none"}
