"""The engine's knobs, typed and validated (the model's shape is ``engine.model_config``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

import mooncake_kernels as kernels
from engine.cpu_runtime import fast_bfloat16
from engine.model_config import QUANTIZATIONS, dtype_bytes


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype a name of ``engine.model_config.DTYPE_BYTES`` stands for (a torch dtype
    passes through); raises ``ValueError`` for any other name."""
    if isinstance(name, torch.dtype):
        return name
    dtype_bytes(name)  # the name is checked where the names are kept
    return getattr(torch, name)


ROLES = ("both", "prefill", "decode")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """Engine knobs. ``model`` is a folder, a ``.gguf`` file, or None for the default model."""

    model: str | None = None
    device: str = field(default_factory=default_device)
    # Activations and KV cache (and weights, unless quantized). None: bfloat16, except on a CPU
    # without bfloat16 units (``engine.cpu_runtime.fast_bfloat16``), where it is float32.
    dtype: str | None = None
    block_size: int = 16
    kv_cache_gib: float | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # Soft retention: the blocks of a request with a session hint stay cached ahead of
    # cold ones this long after it ends (a bias on eviction, never a pin), and retained blocks
    # hold at most this share of the cache. The default spans the think times of chat and agent
    # sessions (minutes); beyond it a session's KV is as cold as any other.
    session_retention_s: float = 600.0
    session_retention_share: float = 0.5
    threads: int | None = None  # torch intra-op threads; None: all cores
    # While busy, how far (MiB) a CPU engine's private memory may grow since the heap was last
    # trimmed before it is trimmed again, checked once a second (``engine.cpu_runtime.HeapBound``);
    # None: trimmed only once idle.
    busy_heap_free_mib: float | None = 64.0
    # A budget of cores shared with the other engines of this host (``engine.core_share``): the
    # file ``create`` wrote and this engine's slot in it. Each step then takes cores / busy
    # engines threads; ``threads`` is what it starts with (and calibrates at). None: ``threads``
    # always.
    core_share: str | None = None
    core_slot: int = 0
    seed: int = 0
    # "both": prefill and decode here (colocated). "prefill": a request ends here after its first
    # token, handed off to a decode instance with its KV (see cluster/instance/prefill.py).
    role: str = "both"
    # Chunked pipeline parallel prefill: (i, X) holds stage i of X, a contiguous range of the
    # layers (``engine.model.stage_layers``). None: the whole model.
    stage: tuple[int, int] | None = None
    # A prompt of at least ``chunk_min_prompt_tokens`` tokens computes at most
    # ``prefill_chunk_tokens`` per step (a CPP group's chunk); a shorter one as much as the step's
    # budget allows, one chunk when it fits. None: the budget is the chunk.
    prefill_chunk_tokens: int | None = None
    chunk_min_prompt_tokens: int = 0
    # Weight-only quantization of the linear layers and the LM head (``engine.quantization``):
    # "int8" or "int4" (CPU), or "none" (the weights stay in ``dtype``). None: int4 on CPU when
    # ``dtype`` is not given either (the fastest setting that passes tests/test_quantization.py's
    # stated tolerance against float32; bench.single measures it), "none" otherwise.
    quantization: str | None = None
    # The KV cache's dtype. None: ``dtype`` when it is given, else bfloat16 on CPU with the native
    # kernels (whatever the default ``dtype``: the cache needs no bfloat16 units); float32 on CPU
    # without them. The native decode attention reads bfloat16 K and V in place
    # (a shift widens them), and a decode step of many rows is bound by reading the contexts:
    # 64 rows of 300 tokens, 30 layers from memory, 1.82 ms a layer from a float32 cache, 1.34
    # from a bfloat16 one (Xeon, 2 threads), and the same bytes hold twice the tokens. The torch
    # twins attend in float32 and would convert every context they gather (1.25x slower at 56
    # sequences of ~450 tokens), so without the native kernels the cache stays float32.
    kv_cache_dtype: str | None = None
    # One answer per request, whatever the path (docs/engine.md#deterministic-mode): every token of
    # every step, prompt or decode, runs the native decode layers as a row of its own, with the
    # integer GEMM at any number of rows, so greedy output does not depend on what else the step
    # holds, on how the prompt was chunked, or on how much of it came from a cache. CPU with int4
    # projections only. None: on wherever that runs (CPU, int4, the native kernels); False lets
    # the rows of large steps go to a dense matmul where one measured faster (engine.kernel_choice).
    deterministic: bool | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if self.quantization is None:
            self.quantization = "int4" if self.device == "cpu" and self.dtype is None else "none"
        dtype_given = self.dtype is not None
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" and not fast_bfloat16() else "bfloat16"
        parse_dtype(self.dtype)
        if self.kv_cache_dtype is None:
            if self.device != "cpu":
                self.kv_cache_dtype = self.dtype
            elif not kernels.native_cpu():
                self.kv_cache_dtype = "float32"
            else:
                self.kv_cache_dtype = self.dtype if dtype_given else "bfloat16"
        parse_dtype(self.kv_cache_dtype)
        if self.core_share is not None and self.device != "cpu":
            raise ValueError("a core share is for CPU engines (a GPU engine's threads only feed its device)")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.session_retention_s >= 0 or not 0 <= self.session_retention_share <= 1:
            raise ValueError("session_retention_s must be >= 0 and session_retention_share in [0, 1], got "
                             f"{self.session_retention_s}, {self.session_retention_share}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.busy_heap_free_mib is not None and not self.busy_heap_free_mib >= 0:
            raise ValueError(f"busy_heap_free_mib must be >= 0 (or None), got {self.busy_heap_free_mib}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if self.threads is None:
            self.threads = os.cpu_count() or 1
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.quantization != "none":
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization must be 'none' or one of {QUANTIZATIONS}, got {self.quantization!r}")
            if self.device != "cpu":
                raise ValueError(f"{self.quantization} weight-only quantization runs on CPU only")
            if self.dtype not in ("float32", "bfloat16"):
                raise ValueError(f"{self.quantization} weight-only quantization runs with dtype float32 or "
                                 f"bfloat16, got {self.dtype!r}")
        if self.deterministic is None:
            self.deterministic = self.device == "cpu" and self.quantization == "int4" and kernels.native_cpu()
        if self.deterministic and (self.device != "cpu" or self.quantization != "int4"):
            raise ValueError(f"the deterministic mode runs on CPU with int4 projections (the native integer "
                             f"kernels); got device {self.device!r}, quantization {self.quantization!r}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens <= 0:
            raise ValueError(f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}")
        if self.chunk_min_prompt_tokens < 0:
            raise ValueError(f"chunk_min_prompt_tokens must be >= 0, got {self.chunk_min_prompt_tokens}")
        if self.stage is not None:
            i, n = self.stage
            if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n):
                raise ValueError(f"stage must be (i, X) with 0 <= i < X, got {self.stage!r}")
            if n > 1 and self.role != "prefill":
                raise ValueError("only prefill instances run as pipeline stages")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.kv_cache_dtype)
