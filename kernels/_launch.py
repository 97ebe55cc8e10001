"""Small helpers shared by the Triton launchers (argument checks, tile sizes)."""

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
