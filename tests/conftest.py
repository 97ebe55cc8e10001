"""Shared test set-up.

Without CUDA, Triton kernels can only run in Triton's interpreter, which is chosen when a kernel
is decorated: set it before any test module imports :mod:`kernels`. It does not change the torch
twins the engine runs on CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
