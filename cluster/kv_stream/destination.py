"""Where a decode instance takes a request's prompt KV (``KVDestination``): what its reservation
answers, what a prefill streams into, and what a pipeline group's later stages are told."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.messenger import RegionHandle


@dataclass(frozen=True)
class KVDestination:
    """Where a decode instance takes a request's prompt KV: its Messenger address, its receive
    staging region, the offset of the range reserved there, and how many leading prompt blocks it
    already holds (only the blocks after those are sent). ``generation``: the use of that range
    every write names (None: an unguarded range); ``sums``: the range has room for a checksum per
    layer after the KV (``layer_checksums``), which the sender writes with each layer's last part."""

    address: str
    region: RegionHandle
    offset: int
    skip_blocks: int
    num_blocks: int  # blocks sent
    generation: int | None = None
    sums: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = {"address": self.address, "region": self.region.to_dict(), "offset": self.offset,
                "skip_blocks": self.skip_blocks, "num_blocks": self.num_blocks, "sums": self.sums}
        if self.generation is not None:
            data["generation"] = self.generation
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVDestination:
        try:
            generation = data.get("generation")
            return cls(str(data["address"]), RegionHandle.from_dict(data["region"]), int(data["offset"]),
                       int(data["skip_blocks"]), int(data["num_blocks"]),
                       None if generation is None else int(generation), bool(data.get("sums", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed KV destination: {e}") from None
