"""Time models the Conductor predicts with: prefill execution, decode step, KV transfer.

Prefill (FAST'25 Eq. 1): ``flops(n) = l * (a * n^2 * d + b * n * d^2)``; reusing a ``p``-token prefix
saves ``flops(p)``, so computing the rest costs ``flops(n) - flops(p)``. Writing ``u = n - p`` (the
uncached tokens) that difference is ``l*a*d*(u^2 + 2*u*p) + l*b*d^2*u``: a polynomial in ``u^2``,
``u*p`` and ``u``. The paper fits "a polynomial regression on offline profiling data" in the
request length and the prefix hit; ``PrefillCostModel`` is that polynomial (plus a constant for
fixed per-request overhead), either derived from the FLOP count (``from_flops``) or fitted.

Decode is memory bound: one step reads the weights once and every running sequence's KV once,
plus a small compute share per sequence (``DecodeStepModel``). KV moves at a fixed bandwidth
(``TransferModel``); ``kv_bytes_per_token`` is ``layers * 2 * d / gqa * elem_bytes`` (320 KiB for
LLaMA3-70B in bf16, FAST'25 §2.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np


@dataclass(frozen=True)
class ModelSpec:
    """Transformer shape constants of FAST'25 Table 1."""

    layers: int
    hidden: int
    a: float
    b: float
    gqa: int
    elem_bytes: int
    params: float

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "gqa", "elem_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.a < 0 or self.b < 0 or self.params <= 0:
            raise ValueError("a, b must be >= 0 and params > 0")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * (self.hidden // self.gqa) * self.elem_bytes

    def prefill_flops(self, n: float) -> float:
        return self.layers * (self.a * n * n * self.hidden + self.b * n * self.hidden**2)


LLAMA3_70B = ModelSpec(layers=80, hidden=8192, a=4.0, b=22.0, gqa=8, elem_bytes=2, params=70e9)


@dataclass(frozen=True)
class HardwareSpec:
    """One instance (one 8-GPU node). Efficiencies are what real kernels reach of the peaks."""

    peak_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    nic_bytes_per_s: float
    prefill_mfu: float = 0.5
    decode_mfu: float = 0.5
    hbm_efficiency: float = 0.6  # of weight reads, a dense streaming access
    kv_read_efficiency: float = 0.6  # of paged-attention KV reads, scattered over many contexts
    step_overhead_s: float = 0.0  # per decode step: tensor-parallel all-reduces, launches

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.hbm_bytes_per_s, self.hbm_bytes, self.nic_bytes_per_s) <= 0:
            raise ValueError("hardware peaks must be positive")
        for name in ("prefill_mfu", "decode_mfu", "hbm_efficiency", "kv_read_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")


# 8x A800-SXM4-80GB: 312 TFLOPS bf16 and 2.039 TB/s HBM each; 4x 200 Gbps RDMA NICs (FAST'25 §5.1).
A800_X8 = HardwareSpec(
    peak_flops=8 * 312e12, hbm_bytes_per_s=8 * 2.039e12, hbm_bytes=8 * 80e9, nic_bytes_per_s=100e9
)


@dataclass(frozen=True)
class PrefillCostModel:
    """Prefill seconds = c_uu*u^2 + c_up*u*p + c_u*u + c_0, with u uncached and p cached tokens."""

    c_uu: float
    c_up: float
    c_u: float
    c_0: float = 0.0

    def __post_init__(self) -> None:
        if min(self.c_uu, self.c_up, self.c_u, self.c_0) < 0:
            raise ValueError(f"coefficients must be >= 0: {self}")

    def seconds(self, input_length: int, prefix_length: int = 0) -> float:
        """Time to prefill ``input_length`` tokens when the first ``prefix_length`` are cached."""
        p = min(max(prefix_length, 0), input_length)
        u = input_length - p
        return (self.c_uu * u + self.c_up * p + self.c_u) * u + self.c_0

    @classmethod
    def from_flops(cls, model: ModelSpec, hw: HardwareSpec, overhead_s: float = 0.0) -> PrefillCostModel:
        rate = hw.peak_flops * hw.prefill_mfu
        attn = model.layers * model.a * model.hidden / rate
        return cls(
            c_uu=attn,
            c_up=2 * attn,
            c_u=model.layers * model.b * model.hidden**2 / rate,
            c_0=overhead_s,
        )

    @classmethod
    def fit(
        cls, input_lengths: Sequence[int], prefix_lengths: Sequence[int], seconds: Sequence[float]
    ) -> PrefillCostModel:
        """Fit on profiled (length, prefix hit, seconds) samples, minimising *relative* error.

        Times span four orders of magnitude (1k to 128k tokens); plain least squares would fit
        the longest prompts and leave the short ones, which are most requests, badly predicted.

        ``c_up`` is tied to ``2 * c_uu``: a new token attends to a cached one at the cost of
        attending to an uncached one (a chunked prefill reads its own earlier chunks from the
        same paged cache), so attention is one coefficient times the pairs, ``u^2 + 2up`` (the
        causal ``u^2 / 2`` plus ``u * p``, doubled). Fitted apart, noise in a few samples gave
        ``c_up`` three times ``c_uu``: a model in which a longer cached prefix makes the same
        prompt slower, and Algorithm 1 then sent prompts away from the instance that held
        their prefix.
        """
        n = np.asarray(input_lengths, dtype=np.float64)
        p = np.asarray(prefix_lengths, dtype=np.float64)
        t = np.asarray(seconds, dtype=np.float64)
        if not (n.shape == p.shape == t.shape) or n.size < 4:
            raise ValueError("need at least 4 aligned samples")
        if np.any(t <= 0):
            raise ValueError("profiled times must be positive")
        u = n - p
        features = np.stack([u * u + 2 * u * p, u, np.ones_like(u)], axis=1) / t[:, None]
        # Scale columns so u^2 (~1e10) and 1 are solved with comparable precision.
        scale = np.abs(features).max(axis=0)
        scale[scale == 0] = 1.0
        coef, *_ = np.linalg.lstsq(features / scale, np.ones_like(t), rcond=None)
        attn, c_u, c_0 = (float(c) for c in np.clip(coef / scale, 0.0, None))
        return cls(attn, 2 * attn, c_u, c_0)


class PrefillTime(Protocol):
    """What the Conductor predicts a prefill instance's time with: one node's
    ``PrefillCostModel``, or a CPP group's ``PipelinedPrefillCost`` (either ``ScaledPrefill``)."""

    def seconds(self, input_length: int, prefix_length: int = 0) -> float: ...


@dataclass(frozen=True)
class ScaledPrefill:
    """``base`` with every prefill ``factor`` times as long: a model calibrated on an idle
    instance, as slow as the live cluster shows it is (``cluster/conductor/placement.py``
    ``TTFTCorrection``)."""

    base: PrefillTime
    factor: float

    def seconds(self, input_length: int, prefix_length: int = 0) -> float:
        return self.base.seconds(input_length, prefix_length) * self.factor


@dataclass(frozen=True)
class PipelinedPrefillCost:
    """A chunked-pipeline-parallel (CPP) group's prefill time (arXiv §5.1, FAST'25 §4.1).

    ``stages`` nodes each hold ``1/stages`` of the layers. The uncached tokens are cut into
    chunks of ``chunk_tokens`` (one chunk when fewer than ``min_tokens``); chunk ``j`` runs on
    stage ``i`` while chunk ``j+1`` runs on stage ``i-1``. On one stage a chunk costs its share
    of what ``base`` (one node running every layer) charges for it against the prefix before it,
    plus ``boundary_s_per_token`` for its hidden states crossing into the next stage. The FLOP
    model telescopes over chunks, so the stages' work adds up to ``base``'s; what the pipeline
    adds is filling and draining, ``(stages - 1)`` times the slowest (last) chunk's stage time.
    With one stage this is ``base`` exactly.
    """

    base: PrefillCostModel
    stages: int = 1
    chunk_tokens: int = 4096
    min_tokens: int = 0
    boundary_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.stages < 1 or self.chunk_tokens < 1 or self.min_tokens < 0 or self.boundary_s_per_token < 0:
            raise ValueError(f"invalid pipeline: {self}")

    def chunk_stage_seconds(self, input_length: int, prefix_length: int = 0) -> list[float]:
        """Seconds each chunk of the uncached tokens spends on one stage, in order."""
        p = min(max(prefix_length, 0), input_length)
        u = input_length - p
        if u <= 0:
            return []
        one = self.stages == 1 or u < self.min_tokens
        sizes = [u] if one else [min(self.chunk_tokens, u - start) for start in range(0, u, self.chunk_tokens)]
        b, out, done = self.base, [], p
        for c in sizes:
            full = (b.c_uu * c + b.c_up * done + b.c_u) * c  # every layer, this chunk, its prefix cached
            hand_over = self.boundary_s_per_token * c if self.stages > 1 else 0.0
            out.append(full / self.stages + hand_over)
            done += c
        return out

    def seconds(self, input_length: int, prefix_length: int = 0) -> float:
        """Time to prefill on an idle group: every chunk through every stage, in order."""
        chunks = self.chunk_stage_seconds(input_length, prefix_length)
        return self.base.c_0 + sum(chunks) + (self.stages - 1) * max(chunks, default=0.0)


@dataclass(frozen=True)
class DecodeStepModel:
    """Seconds of one continuous-batching step, and how many KV tokens fit in the instance's HBM."""

    base_s: float
    per_seq_s: float
    per_context_token_s: float
    kv_capacity_tokens: int

    def __post_init__(self) -> None:
        if min(self.base_s, self.per_seq_s, self.per_context_token_s) < 0:
            raise ValueError(f"step-time coefficients must be >= 0: {self}")
        if self.kv_capacity_tokens <= 0:
            raise ValueError("kv_capacity_tokens must be positive")

    def step_s(self, batch_size: float, context_tokens: float) -> float:
        """One step for ``batch_size`` sequences holding ``context_tokens`` KV tokens in total."""
        return self.base_s + self.per_seq_s * batch_size + self.per_context_token_s * context_tokens

    def scaled(self, factor: float) -> DecodeStepModel:
        """Every step ``factor`` times as long (the capacity unchanged)."""
        if not factor > 0:
            raise ValueError(f"factor must be positive, got {factor}")
        return DecodeStepModel(self.base_s * factor, self.per_seq_s * factor, self.per_context_token_s * factor,
                               self.kv_capacity_tokens)

    @classmethod
    def from_specs(cls, model: ModelSpec, hw: HardwareSpec) -> DecodeStepModel:
        weight_bytes = model.params * model.elem_bytes
        # 10% of the HBM left after the weights is kept for activations and workspaces.
        kv_bytes = (hw.hbm_bytes - weight_bytes) * 0.9
        if kv_bytes < model.kv_bytes_per_token:
            raise ValueError("the weights leave no HBM for KV cache")
        return cls(
            base_s=weight_bytes / (hw.hbm_bytes_per_s * hw.hbm_efficiency) + hw.step_overhead_s,
            per_seq_s=2 * model.params / (hw.peak_flops * hw.decode_mfu),
            per_context_token_s=model.kv_bytes_per_token / (hw.hbm_bytes_per_s * hw.kv_read_efficiency),
            kv_capacity_tokens=int(kv_bytes // model.kv_bytes_per_token),
        )


@dataclass(frozen=True)
class TransferModel:
    """KV cache movement between nodes at a fixed bandwidth."""

    bytes_per_s: float
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("bandwidth and kv_bytes_per_token must be positive")

    def seconds(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.bytes_per_s

    @classmethod
    def from_specs(cls, model: ModelSpec, hw: HardwareSpec) -> TransferModel:
        return cls(bytes_per_s=hw.nic_bytes_per_s, kv_bytes_per_token=model.kv_bytes_per_token)


@dataclass(frozen=True)
class InstanceProfile:
    """An instance's measured time models (decode is None on a prefill-only instance)."""

    prefill: PrefillCostModel
    decode: DecodeStepModel | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill.__dict__,
            "decode": None if self.decode is None else self.decode.__dict__,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceProfile:
        decode = data.get("decode")
        return cls(PrefillCostModel(**data["prefill"]), None if decode is None else DecodeStepModel(**decode))
