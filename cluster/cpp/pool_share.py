"""A later pipeline stage's share of its group's KVCache pool traffic: its layers of each object.

The group's first stage (``cluster.instance.pool_io.PoolIO``) leases a prompt's prefix and
reserves the objects the prompt will complete; every stage reads and writes only its own
layers' parts of them. On a later stage:

* ``load`` (the first stage's ``pool_load``, before the prompt runs): read this stage's parts
  of the leased objects into its pool staging and verify them, then answer how many objects,
  from the first, arrived intact; the first stage takes the shortest answer for the whole group.
  The step that computes the prompt carries the load (``StageStep.loads``: the blocks to fill),
  and ``before_layer`` scatters each layer into this stage's KV cache just before it computes.
  ``unload`` (routed behind the steps, so it never overtakes the step that uses the load) gives
  the staging back.
* ``plan`` / ``stores`` (a KV sink) / ``end``: the layer-wise store, as the first stage's, into
  the objects it reserved; ``end`` waits for this stage's writes and answers its parts'
  checksums, with which the first stage seals.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.pool.client import PoolClient
from cluster.pool.layerwise import LayerwiseStore, LayerwiseStores
from cluster.pool.objects import PoolGeometry
from cluster.messenger.staging import StagingArea, StagingFull, StagingRange
from cluster.messenger import Messenger
from engine.hooks import StageLoad
from engine.kv_layout import unpack_layer


@dataclass(frozen=True)
class _Loaded:
    """This stage's parts of a request's loaded objects, one tensor per object (layer-major),
    and the staging they lie in."""

    views: list[torch.Tensor]
    staging: StagingRange


class StagePool:
    def __init__(self, transfer: Messenger, area: StagingArea, geometry: PoolGeometry, layers: range,
                 timeout_s: float) -> None:
        """``geometry``: the group's objects (every layer of the model); ``layers``: this stage's."""
        self._pool = PoolClient(transfer, None, transfer_timeout_s=timeout_s)
        self._area = area
        self._memory = memoryview(area.buffer.numpy())
        self.geometry = geometry
        self.layers = layers
        self.stores = LayerwiseStores(area, geometry, layers)
        self._loads: dict[str, _Loaded] = {}
        self._lock = threading.Lock()

    def load(self, request_id: str, leases: dict) -> int:
        """Read and verify this stage's parts of the leased objects; how many, from the first,
        are intact (0: none, or no staging free now)."""
        size = self.stores.object_bytes
        count = len(leases["grants"])
        with self._lock:
            if request_id in self._loads:
                return 0
        try:
            r = self._area.allocate(count * size)
        except StagingFull:
            return 0
        offsets = [r.offset + i * size for i in range(count)]
        read = self._pool.read_leased(leases, self._area.handle, offsets, self._memory, self.layers)
        try:
            for part in self.layers:
                read.wait_part(part)
        finally:
            read.close()  # once no transfer writes into the range any more
        good = read.good
        if not good:
            self._area.release(r)
            return 0
        views = [self.stores.object_view(off) for off in offsets[:good]]
        with self._lock:
            self._loads[request_id] = _Loaded(views, r)
        return good

    def before_layer(self, loads: list[StageLoad], kv_cache: torch.Tensor) -> Callable[[int], None] | None:
        """The ``before_layer`` of a step carrying ``loads`` (``StageStep.loads``). Raises
        ``KeyError`` for a load this stage does not hold (the step cannot run right)."""
        if not loads:
            return None
        with self._lock:
            mine = [(self._loads[load.request_id].views, load) for load in loads]

        def load_layer(i: int) -> None:
            for views, load in mine:
                unpack_layer(kv_cache, i, [v[i : i + 1] for v in views], load.block_ids, load.skip)

        return load_layer

    def unload(self, request_id: str) -> None:
        with self._lock:
            held = self._loads.pop(request_id, None)
        if held is not None:
            self._area.release(held.staging)

    def plan(self, request_id: str, reservation: dict, first_blocks: list[int]) -> bool:
        """Take this stage's parts of the reserved objects, to be written layer by layer as the
        prompt's last step computes them. False when this stage's staging has no room now."""
        size = self.stores.object_bytes
        count = len(reservation["objects"])
        try:
            r = self._area.allocate(count * size)
        except StagingFull:
            return False
        write = self._pool.write_reserved(reservation, self._area.handle,
                                          [r.offset + i * size for i in range(count)], self.layers)
        try:
            self.stores.add(request_id, LayerwiseStore(write, r, [int(b) for b in first_blocks]))
        except ValueError:
            self._area.release(r)
            return False
        return True

    def end(self, request_id: str, commit: bool) -> list[list[int]] | None:
        """Wait for this stage's writes of the request's objects and free its staging; with
        ``commit``, each object's checksums of this stage's parts, or None when not every part
        was written (or a write failed): the first stage then aborts the objects."""
        store = self.stores.pop(request_id)
        if store is None:
            return None
        try:
            failed = store.write.settle()
            if commit and not failed and self.stores.complete(store):
                return self.stores.checksums(store)
            return None
        finally:
            self._area.release(store.staging)
