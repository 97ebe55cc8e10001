"""How a process joins the KVCache pool: where the metadata lives and what it contributes."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_GIB = 1 << 30


@dataclass(frozen=True)
class PoolConfig:
    """``metadata_url`` None: no pool. ``etcd``: the URL is an etcd endpoint; otherwise it is the
    Conductor's embedded metadata server (``MetadataServer``)."""

    metadata_url: str | None = None
    etcd: bool = False
    dram_gib: float = 1.0  # this process's DRAM segment; 0: it only reads and writes others'
    ssd_dir: str | None = None
    ssd_gib: float = 0.0
    block_tokens: int = 256  # tokens per pool object (the paper's FAST'25 experiments: 256)
    lease_ttl_s: float = 5.0  # a dead node's objects leave the index within this long

    def __post_init__(self) -> None:
        if self.dram_gib < 0 or self.ssd_gib < 0:
            raise ValueError("pool sizes must be >= 0")
        if (self.ssd_dir is None) != (self.ssd_gib == 0):
            raise ValueError("an SSD tier needs both a directory and a size (--pool-ssd-dir, --pool-ssd-gib)")
        if self.block_tokens <= 0:
            raise ValueError(f"pool block tokens must be positive, got {self.block_tokens}")
        if not self.lease_ttl_s >= 2:
            raise ValueError("the pool lease must be at least 2 s (etcd counts whole seconds)")

    @property
    def enabled(self) -> bool:
        return self.metadata_url is not None

    @property
    def dram_bytes(self) -> int:
        return int(self.dram_gib * _GIB)

    @property
    def ssd_bytes(self) -> int:
        return int(self.ssd_gib * _GIB)


# A weights file up to this size is hashed whole; a larger one by samples (``weights_digest``).
_WHOLE_FILE_BYTES = 64 << 20
_SAMPLE_BYTES = 4096
_FILE_SAMPLES = 256  # a weights file that is not safetensors: this many samples, evenly spread
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _sample(f: Any, begin: int, end: int, h: Any, samples: int) -> None:
    """Hash ``samples`` windows of ``_SAMPLE_BYTES``, evenly spread over bytes [begin, end), the
    first at ``begin`` and the last ending at ``end``; the whole range when it is that small."""
    size = end - begin
    if size <= samples * _SAMPLE_BYTES:
        f.seek(begin)
        h.update(f.read(size))
        return
    step = (size - _SAMPLE_BYTES) / max(1, samples - 1)
    for i in range(samples):
        f.seek(begin + int(i * step))
        h.update(f.read(_SAMPLE_BYTES))


def _hash_weights_file(path: Path, h: Any) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        if size <= _WHOLE_FILE_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return
        if path.suffix == ".safetensors":
            # The header names every tensor, its dtype, shape and place; then a start, a middle and
            # an end window of every tensor's data: a fine-tune changes (nearly) every element of
            # each tensor it touches, so two fine-tunes of one size differ in the samples of each.
            n = int.from_bytes(f.read(8), "little")
            header = f.read(n)
            h.update(header)
            data = 8 + n
            for name, entry in sorted(json.loads(header).items()):
                if name == "__metadata__":
                    continue
                begin, end = entry["data_offsets"]
                _sample(f, data + begin, data + end, h, 3)
            return
        _sample(f, 0, size, h, _FILE_SAMPLES)


@functools.lru_cache(maxsize=16)
def _digest(path: str, stamp: tuple) -> str:
    p = Path(path)
    h = hashlib.sha256(b"mooncake-py/weights/v1\0")
    if p.is_dir():
        config = p / "config.json"
        if config.exists():
            h.update(config.read_bytes())
        for weights in sorted(f for f in p.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.is_file()):
            _hash_weights_file(weights, h)
    elif p.exists():
        _hash_weights_file(p, h)
    else:
        raise FileNotFoundError(f"no model at {path}")
    return h.hexdigest()[:32]


def weights_digest(model_path: str | Path) -> str:
    """A digest of the model's weights that is the same on every host that loaded the same
    files, whatever their folder is called, and differs for other weights of the same shapes:
    the config, then each weights file's name and size and its content (whole up to 64 MiB;
    beyond, the safetensors header and a start, middle and end sample of every tensor, or 256
    evenly spread samples of another format). Cheap: a few MiB read for a model of any size."""
    path = Path(model_path).resolve()
    files = [path] if not path.is_dir() else sorted(
        f for f in path.iterdir() if f.suffix in _WEIGHT_SUFFIXES or f.name == "config.json")
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists())
    return _digest(str(path), stamp)


def model_identity(model_path: str | Path, dtype: str, quantization: str, deterministic: bool = False) -> str:
    """The name a pool's objects are kept under for this model as computed: its weights'
    digest, the precision and the weight quantization, so an int4 and a float32 instance, or two
    fine-tunes of one size, never share KV (``PoolGeometry.namespace`` adds the KV layout); and
    the deterministic mode, whose KV is the same bits on every path only among its own."""
    return f"{weights_digest(model_path)}/{dtype}/{quantization}" + ("/deterministic" if deterministic else "")
