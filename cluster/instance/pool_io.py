"""An instance's traffic with the KVCache pool: load a prompt's prefix, store what it computed.

* ``load_prefix`` (before a prompt runs): the pool objects past what the local prefix cache
  holds are read into this instance's pool staging (``PoolClient.get``: leases, one-sided reads,
  checksums), then made cached prefix blocks on the engine thread (``KVHandoff.import_prefix``),
  so the scheduler finds them like any local hit and computes only the rest. A miss, a vanished
  node or a failed checksum only shortens the prefix: the engine computes what did not arrive.
* ``store`` (after a prompt, or a whole conversation turn, is done): the full pool blocks the
  pool lacks are packed from the engine's cached blocks in one engine-thread call and put.
  Stores run in the background, a few at a time; one that finds its blocks evicted already
  stores the ones before.
"""

from __future__ import annotations

import asyncio
import logging

from cluster.pool.client import PoolClient
from cluster.pool.objects import PoolGeometry, part_checksums
from cluster.staging import StagingArea, StagingRange, when_free
from engine.async_engine import AsyncLLMEngine
from engine.disaggregation import KVHandoff

log = logging.getLogger(__name__)


class PoolIO:
    def __init__(self, client: AsyncLLMEngine, handoff: KVHandoff, pool: PoolClient, geometry: PoolGeometry,
                 area: StagingArea, timeout_s: float, max_background_stores: int = 4) -> None:
        self._client = client
        self._handoff = handoff
        self.pool = pool
        self.geometry = geometry
        self._area = area
        self._timeout_s = timeout_s
        self._memory = memoryview(area.buffer.numpy())
        self._stores: set[asyncio.Task] = set()
        self._max_stores = max_background_stores
        self.stores_skipped = 0  # the background store queue was full: those blocks stay local

    async def load_prefix(self, token_ids: list[int]) -> int:
        """Bring the pool's part of ``token_ids``'s prefix into the local prefix cache; returns
        the leading blocks cached locally afterwards (0 when the pool had nothing new)."""
        g = self.geometry
        bpo = g.blocks_per_object
        keys = g.object_keys(token_ids, len(token_ids) - 1)  # the last token is always computed
        if not keys:
            return 0
        local = await self._client.call(lambda _: self._handoff.cached_prefix_blocks(token_ids))
        first = local // bpo
        wanted = keys[first : first + self._area.nbytes // g.nbytes]
        if not wanted:
            return 0
        r = await when_free(lambda: self._area.allocate(len(wanted) * g.nbytes), self._timeout_s)
        offsets = [r.offset + i * g.nbytes for i in range(len(wanted))]
        loop = asyncio.get_running_loop()
        read = loop.run_in_executor(None, self.pool.get, wanted, self._area.handle, offsets, self._memory)
        try:
            loaded = await asyncio.shield(read)
            if not loaded:
                return 0
            layout = g.layout
            kvs = [self._area.view(StagingRange(off, g.nbytes), layout.torch_dtype, layout.shape(bpo))
                   for off in offsets[:loaded]]
            return await self._client.call(lambda _: self._handoff.import_prefix(token_ids, first * bpo, kvs))
        finally:
            # A read we stopped waiting for still writes into the range: free it once it is done.
            read.add_done_callback(lambda _: self._area.release(r))

    def store_later(self, token_ids: list[int], computed_tokens: int) -> None:
        """Store the full pool blocks of ``token_ids[:computed_tokens]`` in the background."""
        if not self.geometry.object_keys(token_ids, computed_tokens):
            return
        if len(self._stores) >= self._max_stores:
            self.stores_skipped += 1
            return
        task = asyncio.create_task(self._store_quietly(token_ids, computed_tokens))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)

    async def _store_quietly(self, token_ids: list[int], computed_tokens: int) -> None:
        try:
            await self.store(token_ids, computed_tokens)
        except Exception:  # a failed store only costs a later request its hit
            log.exception("pool: store failed")

    async def store(self, token_ids: list[int], computed_tokens: int) -> int:
        """Put the pool blocks of ``token_ids[:computed_tokens]`` the pool lacks; returns how many."""
        g = self.geometry
        bpo = g.blocks_per_object
        keys = g.object_keys(token_ids, computed_tokens)
        loop = asyncio.get_running_loop()
        held = await loop.run_in_executor(None, lambda: [bool(self.pool.replicas(k)) for k in keys])
        missing = [i for i, h in enumerate(held) if not h][: self._area.nbytes // g.nbytes]
        if not missing:
            return 0
        r = await when_free(lambda: self._area.allocate(len(missing) * g.nbytes), self._timeout_s)
        try:
            layout = g.layout
            outs = [self._area.view(StagingRange(r.offset + j * g.nbytes, g.nbytes), layout.torch_dtype,
                                    layout.shape(bpo)) for j in range(len(missing))]

            def export(_engine: object) -> int:
                for j, i in enumerate(missing):
                    try:
                        self._handoff.export_prefix(token_ids, i * bpo, bpo, outs[j])
                    except ValueError:
                        return j  # evicted since: store what was packed
                return len(missing)

            packed = await self._client.call(export)

            def put_all() -> int:
                stored = 0
                for j in range(packed):
                    off = r.offset + j * g.nbytes
                    data = self._memory[off : off + g.nbytes]
                    sums = part_checksums(data, g.part_bytes)
                    if self.pool.put(keys[missing[j]], self._area.handle, off, g.nbytes, g.part_bytes, sums):
                        stored += 1
                return stored

            return await loop.run_in_executor(None, put_all)
        finally:
            self._area.release(r)

