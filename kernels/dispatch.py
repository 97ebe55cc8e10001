"""Which implementation an op runs: the Triton kernel or its torch twin.

``MOONCAKE_KERNELS`` (read at import, changeable with :func:`set_mode`):

* ``auto`` (default): Triton for CUDA tensors; for CPU tensors the native CPU kernels where an op
  has one (:mod:`kernels.cpu_ext`: decode attention, the quantized linears, a whole decode
  layer), the torch twin for the rest; on a machine that cannot build the native kernels (no
  C++ compiler), the twins, with one warning that says so.
* ``triton``: Triton everywhere; on a machine without CUDA the kernels run in Triton's
  interpreter, so ``TRITON_INTERPRET=1`` is set here, before any kernel module imports
  ``triton`` (the interpreter is chosen when a kernel is decorated). Slow: for tests.
* ``torch``: the twins everywhere (e.g. to compare against on a GPU); on CPU this is also the
  switch that turns the native kernels off (the quantized linears then run torch's own kernels).
"""

from __future__ import annotations

import os

import torch

MODES = ("auto", "triton", "torch")

_mode = os.environ.get("MOONCAKE_KERNELS", "auto")
if _mode not in MODES:
    raise ValueError(f"MOONCAKE_KERNELS={_mode!r}; expected one of {MODES}")
if _mode == "triton" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def set_mode(mode: str) -> None:
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r}; expected one of {MODES}")
    _mode = mode


def mode() -> str:
    return _mode


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on tensor ``t`` must run its Triton kernel."""
    if _mode == "torch":
        return False
    if _mode == "auto":
        return t.is_cuda
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton kernels on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
            "(or MOONCAKE_KERNELS=triton) before the kernels are imported"
        )
    return True


def native_cpu() -> bool:
    """True when CPU tensors run the native CPU kernels: mode ``auto`` on a machine that has them
    or can build them (:func:`kernels.cpu_ext.available`, which warns once where it cannot)."""
    from . import cpu_ext

    return _mode == "auto" and cpu_ext.available()
