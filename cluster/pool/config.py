"""How a process joins the KVCache pool: where the metadata lives and what it contributes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

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


def model_identity(model_path: str | Path) -> str:
    """A name for the model's weights that is the same on every host that loaded the same
    files: the folder's name, its config and the sizes of its weight files."""
    path = Path(model_path)
    h = hashlib.sha256(path.name.encode())
    if path.is_dir():
        config = path / "config.json"
        if config.exists():
            h.update(config.read_bytes())
        for weights in sorted(path.glob("*.safetensors")):
            h.update(f"{weights.name}:{weights.stat().st_size}".encode())
    elif path.exists():
        h.update(str(path.stat().st_size).encode())
    return f"{path.name}-{h.hexdigest()[:12]}"
