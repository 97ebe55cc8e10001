"""Build, cache and load the native CPU decode kernels (``kernels/csrc/cpu_decode.cpp`` and the
integer GEMM it includes, ``int_gemm.h``).

The source is compiled once per machine kind with ``-march=native`` (integer dot products on
AVX2, VNNI where the CPU has it) by torch's C++ extension builder, into
``<cache root>/cpu-kernels/<key>``, where the key hashes what the binary depends on: the sources,
torch's version, the CPU's instruction-set flags and the compiler flags. ``MOONCAKE_ISA=avx2``
builds for this CPU with AVX-512 and AMX left out (its own key, so its own folder): the kernels an
AVX2-only machine runs, measurable on any machine (``ATEN_CPU_CAPABILITY=avx2`` and
``ONEDNN_MAX_CPU_ISA=AVX2`` limit torch's own kernels alike; ``engine.cpu_runtime.avx2_limit``).
A first start pays the compile (~30 s on 2 cores); a later one loads the cached library in well
under a second. Processes that start together (a cluster's instances) share the build: torch's
builder holds a lock in its folder.

``MOONCAKE_KERNELS=torch`` turns the native kernels off (the torch twins everywhere, see
:mod:`kernels.dispatch`). A machine with no C++ compiler and no cached build cannot have them:
:func:`available` says so once, in a warning that names what is missing and how to get the fast
path, and the engine serves with the torch twins (its /stats says which kernels run). A build
that fails with a compiler present is an error, not a reason to run slower code silently.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path
from types import ModuleType

import filelock
import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_decode.cpp"
HEADERS = (SOURCE.with_name("int_gemm.h"),)
ISAS = ("native", "avx2")
# What MOONCAKE_ISA=avx2 takes out of -march=native: every AVX-512 subset (they all need avx512f),
# the VEX-encoded VNNI of newer cores, and AMX.
_AVX2_ONLY = ["-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
# How long a start waits for another process's build of the same key (one build takes ~30 s of
# CPU; on 2 busy cores, minutes).
BUILD_WAIT_S = 900.0
_ext: ModuleType | None = None


def cache_root() -> Path:
    """The project's on-disk cache (converted checkpoints, built kernels): ``$MOONCAKE_CACHE_DIR``
    or ``~/.cache/mooncake-py``."""
    env = os.environ.get("MOONCAKE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mooncake-py"


def cpu_flags() -> str:
    """The CPU's instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def isa() -> str:
    """The instruction sets the native kernels are built for: ``$MOONCAKE_ISA``, ``native`` (all
    this CPU has) unless set."""
    value = os.environ.get("MOONCAKE_ISA", "native")
    if value not in ISAS:
        raise ValueError(f"MOONCAKE_ISA={value!r}; expected one of {ISAS}")
    return value


def cflags() -> list[str]:
    return ["-O3", "-march=native", "-fopenmp", *(_AVX2_ONLY if isa() == "avx2" else [])]


def build_key() -> str:
    digest = hashlib.sha256()
    sources = b"".join(p.read_bytes() for p in (SOURCE, *HEADERS))
    for part in (sources, torch.__version__.encode(), cpu_flags().encode(), " ".join(cflags()).encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Where this machine kind's build lives (and is looked for)."""
    return cache_root() / "cpu-kernels" / f"mooncake_cpu_decode_{build_key()}"


def compiler() -> str | None:
    """The C++ compiler torch's builder would run (``$CXX``, else ``c++``), if it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


_missing: str | None = None  # what `available` found missing, once it looked


def available() -> bool:
    """Whether the native kernels can be had here: built already for this machine kind (in the
    cache), or buildable (a C++ compiler; ninja comes with the package). When not, a warning
    says so once per process."""
    global _missing
    if _ext is not None:
        return True
    if _missing is None:
        built = any(build_dir().glob("*.so"))
        _missing = "" if built or compiler() is not None else (
            f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH) and no cached build")
        if _missing:
            log.warning(
                "native CPU kernels unavailable: %s. Serving with the torch twins, which decode several "
                "times slower. For the fast path install a C++ compiler (Debian/Ubuntu: apt-get install g++; "
                "or set CXX) and restart: the first start builds them in ~30 s. MOONCAKE_KERNELS=torch "
                "chooses the twins without this warning.", _missing)
    return not _missing


def load() -> ModuleType:
    """The native kernels, built first if this machine kind has no cached build."""
    global _ext
    if _ext is not None:
        return _ext
    from torch.utils import cpp_extension

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    started = time.perf_counter()
    # torch's builder serialises builds with a lock file that a build killed midway leaves behind,
    # and then waits on it forever. filelock's lock (an flock) dies with its process: holding it,
    # no build of this key is running, so a lock file found is stale.
    lock = filelock.FileLock(folder / "build.flock", preserve_lock_file=True)
    try:
        lock.acquire(timeout=BUILD_WAIT_S)
    except filelock.Timeout:
        raise RuntimeError(f"another process has been building the native CPU kernels in {folder} for over "
                           f"{BUILD_WAIT_S:.0f} s; set MOONCAKE_KERNELS=torch to start without them") from None
    try:
        (folder / "lock").unlink(missing_ok=True)
        _ext = cpp_extension.load(folder.name, [str(SOURCE)], extra_cflags=cflags(), extra_ldflags=["-fopenmp"],
                                  build_directory=str(folder), verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        raise RuntimeError(
            f"could not build the native CPU kernels in {folder} ({type(e).__name__}: {e}); they need a "
            "C++ compiler (g++) and ninja. Set MOONCAKE_KERNELS=torch to run the torch twins instead (slower)"
        ) from e
    finally:
        lock.release()
    log.info("native CPU kernels ready in %.1f s (%s)", time.perf_counter() - started, folder)
    return _ext


def _put_ninja_on_path() -> None:
    # torch's builder runs `ninja` from PATH; the `ninja` wheel installs it beside the venv's
    # python, which is not on PATH when the venv is used without being activated.
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
