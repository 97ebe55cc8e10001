"""The KV page geometry instances share, and packing pages into one contiguous buffer.

Wire layout of a request's KV (``KVLayout.shape``): ``[layers, 2, blocks, Hkv, block_size, D]``,
the ``kernels.gather_kv`` layout, so layer ``l`` is the byte range
``[l * layer_bytes, (l + 1) * layer_bytes)`` on both sides of a transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.model_config import dtype_bytes

# torch only where tensors are: the Conductor reads KVLayout (an instance's report) without it.
if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVLayout:
    """Page geometry both sides must share for KV to move between them."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * self.head_dim * dtype_bytes(self.dtype)

    def layer_bytes(self, num_blocks: int) -> int:
        return 2 * num_blocks * self.page_bytes

    def nbytes(self, num_blocks: int) -> int:
        return self.num_layers * self.layer_bytes(num_blocks)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        from engine.config import parse_dtype  # loads torch: see the imports

        return parse_dtype(self.dtype)

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor) -> KVLayout:
        layers, _, _, heads, block_size, head_dim = kv_cache.shape
        return cls(layers, heads, block_size, head_dim, str(kv_cache.dtype).removeprefix("torch."))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        return cls(**{k: data[k] for k in ("num_layers", "num_kv_heads", "block_size", "head_dim", "dtype")})


def pack(kv_cache: torch.Tensor, block_ids: list[int], layers: range | None, out: torch.Tensor) -> None:
    """``kernels.gather_kv`` into ``out`` (host staging), through device memory when the KV is on
    a GPU, and through a packed copy when ``out`` is not contiguous (some of a request's blocks
    in its wire layout: their K pages and V pages lie apart)."""
    import torch  # see the imports
    import mooncake_kernels as kernels  # here, not at the top: the Conductor reads KVLayout without loading triton

    if kv_cache.device == out.device and out.is_contiguous():
        kernels.gather_kv(kv_cache, block_ids, layers, out=out)
    else:
        out.copy_(kernels.gather_kv(kv_cache, torch.tensor(block_ids, device=kv_cache.device), layers))


def unpack_layer(kv_cache: torch.Tensor, layer: int, objects: list[torch.Tensor], block_ids: list[int],
                 skip: int) -> None:
    """Scatter layer ``layer`` of a run of loaded objects (each ``[1, 2, blocks, heads,
    block_size, head_dim]``, in block order) into ``block_ids``, leaving out the run's first
    ``skip`` blocks (cached here already). Objects past the blocks to fill are left out."""
    import mooncake_kernels as kernels  # see pack

    pos = 0
    for obj in objects:
        n = min(obj.shape[2] - skip, len(block_ids) - pos)
        if n > 0:
            part = obj[:, :, skip : skip + n]
            kernels.scatter_kv(part.to(kv_cache.device).contiguous(), kv_cache, block_ids[pos : pos + n],
                               range(layer, layer + 1))
            pos += n
        skip = max(0, skip - obj.shape[2])
