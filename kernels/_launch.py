"""Small helpers shared by the Triton launchers (argument checks, output allocation, tile sizes)."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tile_cap() -> int:
    """Elements a program's tile should hold: ~4K on a GPU (registers), large in the interpreter,
    where each program costs a Python-level launch and bigger tiles mean fewer of them."""
    return 1 << 16 if interpreting() else 4096


def check_device(op: str, ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected {ref.device}")


def check_last_contiguous(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last dim (strides {t.stride()})")


def check_float(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{op}: {name} must be float32/float16/bfloat16, got {t.dtype}")


def check_int32(op: str, ndim: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != ndim or t.dtype != torch.int32:
            raise ValueError(f"{op}: {name} must be {ndim}-D int32, got {t.dim()}-D {t.dtype}")


def check_paged_attention(
    op: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    min_head_dim: int,
    max_head_dim: int,
) -> None:
    """Checks shared by the paged attention launchers: ``q [tokens, Hq, D]``, caches
    ``[num_blocks, Hkv, block_size, D]`` of q's float dtype, ``block_tables [S, max_blocks]`` and
    ``seq_lens [S]`` int32, all on q's device."""
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [tokens, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"{op}: caches must be [num_blocks, Hkv, block_size, D]; got k_cache and v_cache "
            f"of shapes {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{op}: k_cache and v_cache shapes differ: k_cache {tuple(k_cache.shape)} != "
            f"v_cache {tuple(v_cache.shape)}"
        )
    _, hq, d = q.shape
    _, hkv, block_size, dc = k_cache.shape
    if dc != d:
        raise ValueError(f"{op}: head_dim mismatch: q has {d}, the caches have {dc}")
    if not min_head_dim <= d <= max_head_dim:
        raise ValueError(f"{op}: head_dim {d} unsupported ({min_head_dim}..{max_head_dim})")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: Hq ({hq}) must be a multiple of Hkv ({hkv})")
    if block_size < 1:
        raise ValueError(f"{op}: block_size must be >= 1")
    check_float(op, q=q)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"{op}: dtype mismatch: cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must equal "
            f"q's ({q.dtype})"
        )
    check_int32(op, 2, block_tables=block_tables)
    check_int32(op, 1, seq_lens=seq_lens)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"{op}: batch mismatch: block_tables has {block_tables.shape[0]} rows for "
            f"{seq_lens.shape[0]} sequences"
        )
    check_device(
        op, q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens
    )


def output_like(op: str, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked to match q's shape, dtype and device, or a new such tensor when None."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"{op}: out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), got "
            f"({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    return out
