"""Weight-only int8 for the linear layers and the LM head, on torch's own CPU kernel.

A decode step at small batch reads every weight once for a handful of rows: it is bound by the
bytes of the weights, not by arithmetic. ``int8`` stores each linear weight as int8 rows with
one scale per output row (symmetric, per channel: ``W ~= q * scale[:, None]`` with
``scale = max|W_row| / 127``) and multiplies with ``torch._weight_int8pack_mm``, which reads
the int8 weights and scales the output rows. That kernel is fast with bfloat16 activations
only (with float32 ones it was 9x slower than a float32 matmul here), so the activations go in
as bfloat16 and the result comes back in the model's dtype. It is a matrix-vector kernel: its
time grows with every row of ``x`` (measured here, 3072x576: 55 us for 1 row, 6.8 ms for 256,
where a bfloat16 matmul takes 2.5 ms), so past ``INT8_MM_MAX_ROWS`` rows (a prefill chunk) the
weight is dequantized to bfloat16 for one ordinary matmul instead. The
embedding lookup keeps its float table (a tied LM head gets its own int8 copy), as do the
norms. ``quantize_model`` replaces the weights after loading; ``linear`` is what the model
calls for every projection, whichever kind of weight it holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8",)
INT8_MM_MAX_ROWS = 16  # where the two ways cross over here


class Int8Weight:
    """A ``[out, in]`` linear weight as int8 rows and per-row scales."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self.scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        self.q = torch.round(w / self.scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self._scale = self.scale.to(torch.bfloat16)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        if flat.shape[0] <= INT8_MM_MAX_ROWS:
            out = torch._weight_int8pack_mm(flat, self.q, self._scale)
        else:
            out = F.linear(flat, self.q.to(torch.bfloat16) * self._scale[:, None])
        return out.to(x.dtype).view(*x.shape[:-1], self.q.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a float weight or an ``Int8Weight``."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight(x)
    return out if bias is None else out + bias


def model_bytes(model: nn.Module) -> int:
    """The bytes of a model's weights, int8 ones included."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Int8Weight):
                total += value.q.numel() + value.scale.numel() * value.scale.element_size()
    return total


def _replace(module: nn.Module, name: str, weight: torch.Tensor) -> None:
    # The float parameter goes (its memory with it); the int8 weight is a plain attribute.
    if name in module._parameters:
        del module._parameters[name]
    setattr(module, name, Int8Weight(weight))


def quantize_model(model: nn.Module, method: str) -> None:
    """Quantize the projections of every decoder layer and the LM head in place."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; expected one of {QUANTIZATIONS}")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 weight-only runs on CPU (torch's _weight_int8pack_mm)")
    for layer in model.layers:
        _replace(layer.attn, "qkv_weight", layer.attn.qkv_weight)
        _replace(layer.attn, "o_weight", layer.attn.o_weight)
        _replace(layer, "gate_up_weight", layer.gate_up_weight)
        _replace(layer, "down_weight", layer.down_weight)
    if model.last:
        _replace(model, "lm_head", model.embed if model.lm_head is None else model.lm_head)
