"""Weight-only int8 and int4 for the linear layers and the LM head, on CPU kernels.

A decode step at small batch reads every weight once for a handful of rows: it is bound by the
bytes of the weights (and the arithmetic of unpacking them), not by the multiply-adds. Reading
all of the default model's projections once, from memory rather than cache, took here 28 ms in
bfloat16, 11.6 ms as int8 and 4.1-5.0 ms as int4 (2 threads, one row).

* ``int8``: int8 rows with one scale per output row (symmetric: ``W ~= q * scale[:, None]``,
  ``scale = max|W_row| / 127``).
* ``int4``: groups of ``INT4_GROUP`` weights along each row with a scale ``d`` and a minimum
  ``m`` in fp16 (``W ~= q * d + m``, ``q`` in 0..15): GGUF Q4_1's grid, so a model dequantized
  from Q4_0/Q4_1 (the default one) comes back to nearly the same weights.

Two kernels can multiply them, chosen when the weight is built (``native``):

* the native one (:mod:`kernels.quant_linear`, the default on CPU): an integer GEMM, activations
  quantized per block of 32 in two 8-bit levels, float32 activations in and out, that takes every
  row count (each row costs its multiply-adds only) in one order of sums, so a row's result does
  not depend on its step; by default no dense copy is kept. Where a dense matmul measured faster
  past some rows (``engine.kernel_choice``), the mode that is not deterministic hands those rows
  to a dense copy;
* torch's own (``MOONCAKE_KERNELS=torch``): ``torch._weight_int8pack_mm`` and
  ``torch._weight_int4pack_mm_for_cpu``, fast with bfloat16 activations only (int8 with float32
  ones was 9x slower than a float32 matmul here), so activations go in as bfloat16; torch's int4
  layout wants a bfloat16 scale and a zero point, ``zero = m + 8 * d``. These are matrix-vector
  kernels whose time grows with every row, so past ``crossover_rows`` (a prefill chunk, a large
  decode batch) the step multiplies by the same weights dequantized once, at load, to the
  model's dtype, at the cost of 2 (bfloat16) or 4 (float32) more bytes per weight in memory.

On a CPU without bfloat16 units (AVX2 only) a bfloat16 matmul is 7x slower than a float32 one,
so there the CPU default is a float32 model (``engine.cpu_runtime.fast_bfloat16``) and any dense
copy is float32. The embedding lookup keeps its float table (a tied LM head gets its own
quantized copy, int8 under int4 too), as do the norms. ``quantize_model`` replaces the weights
after loading; ``linear`` is what the model calls for every projection, whichever kind of weight
it holds.

With the native kernels on, every dense matmul on CPU is oneDNN's on a weight packed once
(:class:`PackedWeight`, :mod:`kernels.dense_linear`): the quantized weights' dequantized copies
where they are kept, and, through ``pack_model``, every projection of a model that is not
quantized.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

import mooncake_kernels as kernels
from engine.model_config import QUANTIZATIONS

INT4_GROUP = 32


class QuantizedWeight:
    """A ``[out, in]`` linear weight in a weight-only format: ``kernel`` for up to ``max_rows``
    rows of activations, a matmul on ``dense`` (the dequantized weight, in the model's dtype)
    above. ``native``: the native CPU kernel (float32 activations) or torch's (bfloat16 ones).

    The native kernel is a GEMM whose rows cost only their multiply-adds and whose sums run in
    one order whatever the rows (:mod:`kernels.quant_linear`): ``int_rows`` None gives it every
    row count and keeps no dense copy (the deterministic mode's weights); a number hands the
    rows past it to oneDNN on a dense copy (``engine.kernel_choice`` measures where that pays)."""

    # torch's kernels are matrix-vector kernels, whose time grows with every row: where they and
    # the dense matmul cross over, by the dense copy's dtype (measured from memory, 2 threads). A
    # float32 matmul is the slower per row on a CPU with bfloat16 units, a bfloat16 one is far
    # slower still on a CPU without them (AVX2: 7x a float32 matmul).
    crossover_rows: dict[torch.dtype, int]

    def __init__(self, dense: torch.Tensor, dense_dtype: torch.dtype, native: bool,
                 int_rows: int | None = None) -> None:
        if dense_dtype not in self.crossover_rows:
            raise ValueError(f"a dequantized copy in {dense_dtype} is not supported "
                             f"(supported: {sorted(str(d) for d in self.crossover_rows)})")
        self.native = native
        self.out_features = dense.shape[0]
        self.dense_dtype = dense_dtype
        if native:
            self.max_rows = sys.maxsize if int_rows is None else int_rows
        else:
            self.max_rows = self.crossover_rows[dense_dtype]
        self._dense_copy: torch.Tensor | PackedWeight | None = None
        if self.max_rows < sys.maxsize:
            self._dense_copy = dense.to(dense_dtype).contiguous()
            # With the native kernels, the dense copy is kept only packed for oneDNN.
            if native and kernels.dense_native_available(dense_dtype):
                self._dense_copy = PackedWeight(self._dense_copy)
        self.shape = dense.shape
        self.kernel_dtype = torch.float32 if native else torch.bfloat16

    @property
    def dense(self) -> torch.Tensor | None:
        """The dequantized copy, plain (a new tensor when it is kept packed); None when no path
        needs one."""
        c = self._dense_copy
        return c.packed.to_dense() if isinstance(c, PackedWeight) else c

    @property
    def packed_dense(self) -> torch.Tensor | None:
        """The dense copy in oneDNN's packed layout (:func:`kernels.pack_dense`), None when it is
        kept plain or not kept."""
        c = self._dense_copy
        return c.packed if isinstance(c, PackedWeight) else None

    def dense_bytes(self) -> int:
        c = self._dense_copy
        return 0 if c is None else c.numel() * c.element_size()

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weights the kernel multiplies by, float32 ``[out, in]``."""
        raise NotImplementedError

    def stored_bytes(self) -> int:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        # Each conversion is skipped when it would be a no-op: at one decode row the calls
        # themselves, not their work, are what a projection costs beyond its kernel.
        if flat.shape[0] <= self.max_rows:
            want = self.kernel_dtype
            run = self.kernel
        else:
            want = self.dense_dtype
            run = self._dense
        if flat.dtype != want:
            flat = flat.to(want)
        out = run(flat if flat.is_contiguous() else flat.contiguous())
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.shape[0])

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        c = self._dense_copy
        return c(x) if isinstance(c, PackedWeight) else F.linear(x, c)


class PackedWeight:
    """A float ``[out, in]`` weight packed once for oneDNN's matmul (:mod:`kernels.dense_linear`):
    the projections of a CPU model that is not quantized, and the quantized weights' dense
    copies. Activations must come in the weight's dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = kernels.pack_dense(weight)
        self.shape, self.dtype = weight.shape, weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.dense_linear_native(x, self.packed)

    def numel(self) -> int:
        return self.packed.numel()

    def element_size(self) -> int:
        return self.packed.element_size()

    def stored_bytes(self) -> int:
        return self.numel() * self.element_size()


class Int8Weight(QuantizedWeight):
    """int8 rows and one scale per row."""

    # torch's kernel: bfloat16 6 with avx512_bf16; float32 64 on AVX2 (1 row 17.5 ms against 60
    # in float32, 64 rows 263 against 294, all the default model's projections).
    crossover_rows = {torch.bfloat16: 6, torch.float32: 64}

    def __init__(self, weight: torch.Tensor, dense_dtype: torch.dtype = torch.bfloat16,
                 native: bool | None = None, int_rows: int | None = None) -> None:
        w = weight.detach().float()
        self.scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        self.q = torch.round(w / self.scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        native = kernels.native_cpu() if native is None else native
        if native:
            # The GEMM's layout (kernels.pack_q8); the plain codes are kept for dequantize only.
            self.packed, self._panel_scale = kernels.pack_q8(self.q, self.scale)
        else:
            self._scale = self.scale.to(torch.bfloat16)
        dense = self.q.float() * self.scale[:, None]
        if native:
            del self.q
        super().__init__(dense, dense_dtype, native, int_rows)

    def codes(self) -> torch.Tensor:
        """The int8 codes ``[out, in]`` (unpacked from the GEMM's layout with the native kernel)."""
        return kernels.unpack_q8(self.packed, self.out_features) if self.native else self.q

    def dequantize(self) -> torch.Tensor:
        return self.codes().float() * self.scale[:, None]

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return kernels.quant_linear_native(x, self.packed, self.out_features, self._panel_scale)
        return torch._weight_int8pack_mm(x, self.q, self._scale)

    def stored_bytes(self) -> int:
        codes = self.packed if self.native else self.q
        return codes.numel() + self.scale.numel() * self.scale.element_size()


class Int4Weight(QuantizedWeight):
    """4-bit codes in groups of ``INT4_GROUP`` along each row, each group with a scale and a
    minimum, in the chosen kernel's packed layout."""

    # torch's kernel: bfloat16 16 with avx512_bf16; float32 64 on AVX2 (1 row 11.2 ms against 60
    # in float32, 64 rows 257 against 294, 128 rows 594 against 372).
    crossover_rows = {torch.bfloat16: 16, torch.float32: 64}

    def __init__(self, weight: torch.Tensor, dense_dtype: torch.dtype = torch.bfloat16,
                 group: int = INT4_GROUP, native: bool | None = None, int_rows: int | None = None) -> None:
        out_features, in_features = weight.shape
        if in_features % group:
            raise ValueError(f"int4 needs input features divisible by {group}; this weight is {tuple(weight.shape)} "
                             "(quantization \"none\" or \"int8\" runs any model)")
        native = kernels.native_cpu() if native is None else native
        if native and group != kernels.QUANT_BLOCK:
            raise ValueError(f"the native int4 kernel takes groups of {kernels.QUANT_BLOCK}, not {group}")
        w = weight.detach().float().view(out_features, in_features // group, group)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        self.group = group
        if native:
            d, m = scale.half(), lo.half()
            self.packed = kernels.pack_q4(q.view(out_features, in_features), d, m)
            dense = q * d[..., None].float() + m[..., None].float()
        else:
            # torch's kernel reads its scales and zeros (the value of the middle code, 8) as
            # bfloat16, and so does the dense copy, so both compute with the same weights.
            d, zero = scale.to(torch.bfloat16), (lo + 8 * scale).to(torch.bfloat16)
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(out_features, in_features), 1)
            # [groups, out, 2]: each group's (scale, zero) for every output row.
            self._scales_zeros = torch.stack((d, zero), dim=-1).transpose(0, 1).contiguous()
            dense = (q - 8) * d[..., None].float() + zero[..., None].float()
        super().__init__(dense.view(out_features, in_features), dense_dtype, native, int_rows)

    def dequantize(self) -> torch.Tensor:
        if not self.native:
            return self.dense.float()
        q, d, m = kernels.unpack_q4(self.packed, self.out_features)
        return (q.float().view(q.shape[0], -1, self.group) * d.float()[..., None] + m.float()[..., None]).view(q.shape)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return kernels.quant_linear_native(x, self.packed, self.out_features)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self._scales_zeros)

    def stored_bytes(self) -> int:
        if self.native:
            return self.packed.numel()
        return self.packed.numel() + self._scales_zeros.numel() * self._scales_zeros.element_size()


_KINDS: dict[str, type[QuantizedWeight]] = {"int8": Int8Weight, "int4": Int4Weight}


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight | PackedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a float weight, a ``QuantizedWeight`` or a ``PackedWeight``."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight(x)
    return out if bias is None else out + bias


def model_bytes(model: nn.Module) -> int:
    """The bytes of a model's weights as the decode steps read them: the float parameters and
    the quantized weights (not their dequantized copies for prefill, counted apart by
    ``prefill_copy_bytes``)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(w.stored_bytes() for w in _held(model, (QuantizedWeight, PackedWeight)))


def step_weight_bytes(model: nn.Module, rows: int) -> int:
    """The bytes of weights a step of ``rows`` token rows reads: each quantized projection's
    codes up to its crossover, its dense copy past it; packed and float weights whole."""
    total = 0
    for _, _, w in _projections(model):
        if isinstance(w, QuantizedWeight):
            total += w.stored_bytes() if rows <= w.max_rows else w.dense_bytes()
        elif isinstance(w, PackedWeight):
            total += w.stored_bytes()
        else:
            total += w.numel() * w.element_size()
    return total


def prefill_copy_bytes(model: nn.Module) -> int:
    """The bytes of the dequantized copies the quantized weights keep for prefill chunks."""
    return sum(w.dense_bytes() for w in _held(model, QuantizedWeight))


def _held(model: nn.Module, kinds) -> list:
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, kinds)]


def _replace(module: nn.Module, name: str, weight: QuantizedWeight | PackedWeight) -> None:
    # The float parameter goes (its memory with it); its replacement is a plain attribute.
    if name in module._parameters:
        del module._parameters[name]
    setattr(module, name, weight)


def _projections(model: nn.Module):
    """(module, attribute, weight) of every decoder layer's projections, then the LM head (the
    embedding when tied)."""
    for layer in model.layers:
        for module, name in ((layer.attn, "qkv_weight"), (layer.attn, "o_weight"),
                             (layer, "gate_up_weight"), (layer, "down_weight")):
            yield module, name, getattr(module, name)
    if model.last:
        yield model, "lm_head", model.embed if model.lm_head is None else model.lm_head


def quantize_model(model: nn.Module, method: str, int_rows: int | None = None) -> None:
    """Quantize the projections of every decoder layer and the LM head in place. With the native
    kernels, ``int_rows``: the most rows the integer GEMM takes before a dense copy does (None:
    every row count, no dense copy; see :class:`QuantizedWeight`)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; expected one of {QUANTIZATIONS}")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"{method} weight-only runs on CPU (torch's CPU kernels)")
    for module, name, weight in list(_projections(model)):
        # The LM head's errors go straight into the logits: under int4 it stays 8-bit, as GGUF's
        # 4-bit files keep their output tensor at 6 or 8 bits (the default model's is Q8_0).
        kind = "int8" if name == "lm_head" and method == "int4" else method
        # The dequantized copy is in the weight's own dtype, the model's.
        _replace(module, name, _KINDS[kind](weight, weight.dtype, int_rows=int_rows))


def check_batch_invariant(model: nn.Module) -> None:
    """Raises ValueError unless every projection and the LM head multiply by their native integer
    GEMM at any number of rows, never by a dense copy: the GEMM sums each row's products in one
    fixed order (exact integer dot products per block, then the blocks in turn), so a row's
    result is the same bits whether it is alone or one of 500, while oneDNN picks its blocking,
    and with it the order of the sums, by the number of rows."""
    for _, name, weight in _projections(model):
        if not (isinstance(weight, QuantizedWeight) and weight.native and weight.max_rows == sys.maxsize):
            raise ValueError(f"the deterministic mode multiplies every projection with the native integer kernels; "
                             f"{name} is {type(weight).__name__} (needs --quantization int4 and the native CPU kernels)")


def pack_model(model: nn.Module) -> bool:
    """Pack every projection and the LM head of a CPU model that is not quantized for oneDNN
    (:class:`PackedWeight`), when the native CPU kernels are on and this torch can; returns
    whether it did. A tied LM head gets its own packed copy: the embedding stays a table."""
    p = next(model.parameters())
    if p.device.type != "cpu" or not kernels.native_cpu() or not kernels.dense_native_available(p.dtype):
        return False
    for module, name, weight in list(_projections(model)):
        _replace(module, name, PackedWeight(weight))
    return True
