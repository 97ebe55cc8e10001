"""Prompts whose new pool objects are written layer by layer as their last step computes them.

Before a prompt runs, its writer reserves the pool objects the prompt will complete
(``PoolClient.reserve``, or ``write_reserved`` under another client's reservation) and ``add``s
them with a range of its pool staging. ``LayerwiseStores`` is then one of the engine's KV sinks
(``engine.hooks.KVSink``): after each layer of the step that computes the prompt's last
chunk, that layer of every object is packed into the staging and its write started
(``PoolWrite.write(part)``). Once the prompt is done, ``pop`` hands the store back to be sealed
or aborted. A pipeline stage holds only some layers (``layers``): its staging holds those parts
of each object, and its local layer ``i`` is part ``layers.start + i``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from cluster.pool.client import PoolWrite
from cluster.pool.objects import PoolGeometry, part_checksums
from cluster.messenger.staging import StagingArea, StagingRange
from engine.kv_layout import pack
from engine.hooks import PromptChunk


@dataclass
class LayerwiseStore:
    write: PoolWrite  # the objects with their places; ``write.objects[i].offset``: in the staging
    staging: StagingRange
    first_blocks: list[int]  # each object's first engine block in the prompt
    layers_written: int = 0


class LayerwiseStores:
    """Thread-safe: ``add`` and ``pop`` on any thread, ``layer_done`` on the engine thread (under
    the lock, so once a store is popped no copy into its staging can still start)."""

    def __init__(self, area: StagingArea, geometry: PoolGeometry, layers: range) -> None:
        self.area = area
        self.geometry = geometry
        self.layers = layers
        self._memory = memoryview(area.buffer.numpy())
        self._stores: dict[str, LayerwiseStore] = {}
        self._lock = threading.Lock()

    @property
    def object_bytes(self) -> int:
        """The staging one object takes: this writer's parts of it."""
        return len(self.layers) * self.geometry.part_bytes

    def object_view(self, offset: int) -> torch.Tensor:
        """This holder's parts of one object at ``offset`` of the staging, layer-major (what a
        load of those layers reads into, and what a store packs)."""
        layout = self.geometry.layout
        shape = (len(self.layers), *layout.shape(self.geometry.blocks_per_object)[1:])
        return self.area.view(StagingRange(offset, self.object_bytes), layout.torch_dtype, shape)

    def add(self, request_id: str, store: LayerwiseStore) -> None:
        """Raises ValueError when the request is being stored already."""
        with self._lock:
            if request_id in self._stores:
                raise ValueError(f"request {request_id!r} is already being stored")
            self._stores[request_id] = store

    def pop(self, request_id: str) -> LayerwiseStore | None:
        with self._lock:
            return self._stores.pop(request_id, None)

    def wants(self, request_id: str) -> bool:
        return request_id in self._stores

    def layer_done(self, layer: int, kv_cache: torch.Tensor, chunks: list[PromptChunk]) -> None:
        bpo = self.geometry.blocks_per_object
        with self._lock:
            for chunk in chunks:
                store = self._stores.get(chunk.request_id)
                if store is None or not chunk.last:  # every object is final in the last chunk's layer
                    continue
                ids = chunk.block_ids
                for obj, place, first in zip(store.write.objects, store.write.places, store.first_blocks):
                    if place is None:
                        continue
                    view = self.object_view(obj.offset)
                    pack(kv_cache, ids[first : first + bpo], range(layer, layer + 1), view[layer : layer + 1])
                store.write.write(part=self.layers.start + layer)
                store.layers_written += 1

    def checksums(self, store: LayerwiseStore) -> list[list[int]]:
        """Each object's checksums of the parts this writer holds, from its staging."""
        return [part_checksums(self._memory[o.offset : o.offset + self.object_bytes], self.geometry.part_bytes)
                for o in store.write.objects]

    def complete(self, store: LayerwiseStore) -> bool:
        """Whether every layer this writer holds was written."""
        return store.layers_written == len(self.layers)
