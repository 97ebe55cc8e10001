"""``--isa avx2|native`` for the CPU benchmarks: measure an AVX2-only machine on any machine.

``avx2`` limits every kernel the process runs to what an AVX2 machine (AMD EPYC Zen 3, say) has:
torch's own kernels (``ATEN_CPU_CAPABILITY=avx2``), oneDNN's (``ONEDNN_MAX_CPU_ISA=AVX2``: no
AVX-512, no AMX, no bfloat16 units) and the native ones (``MOONCAKE_ISA=avx2``: built without
AVX-512 and AMX, in their own cache folder), and with them the engine's defaults
(``engine.cpu_runtime.avx2_limit``: float32 activations, as on such a machine). torch and oneDNN
read their variables once, when they load, so the benchmark runs itself again with them set.
``describe`` says which instruction set each path ran, for the benchmark to print.
"""

from __future__ import annotations

import argparse
import os
import sys

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MOONCAKE_ISA": "avx2"}


def add_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="native: every instruction set this CPU has; avx2: torch, oneDNN and the native "
                             "kernels limited to AVX2 (an AVX2-only machine's kernels and defaults, on any CPU)")


def apply(args: argparse.Namespace) -> None:
    """Under ``--isa avx2``, run this process again with the limits set, unless they already are
    (then return). Call before torch's kernels run."""
    if args.isa != "avx2" or all(os.environ.get(k) == v for k, v in AVX2_ENV.items()):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **AVX2_ENV})


def describe() -> str:
    """Which instruction sets this process's paths run: the native GEMM's build, ATen's vector
    kernels, oneDNN's limit, and whether AMX is granted."""
    import torch

    from engine.cpu_runtime import amx_granted, fast_bfloat16
    from mooncake_kernels import cpu_ext, native_cpu

    gemm = cpu_ext.load().int_gemm_path() if native_cpu() else "off (torch twins)"
    return (f"native GEMM {gemm}; ATen {torch.backends.cpu.get_cpu_capability()}; oneDNN max ISA "
            f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'all')}; bfloat16 units {'yes' if fast_bfloat16() else 'no'}; "
            f"AMX granted {'yes' if amx_granted() else 'no'}")
