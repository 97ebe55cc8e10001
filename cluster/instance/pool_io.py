"""An instance's traffic with the KVCache pool: load a prompt's prefix, store what it computed.

* ``prepare_load`` + ``start`` (a prompt arriving): the pool objects past what the local prefix
  cache holds are leased and their reads started, layer by layer, into this instance's pool
  staging (``PoolClient.open_read``); the request enters the engine with those blocks to be
  filled (``KVHandoff.add_loading``), and before each layer of its first step the engine takes
  that layer (``PoolLoad.layer``: wait, verify the checksums, hand over), so loading overlaps
  computing: prefill time ~ max(load, compute). A miss or a lease refused only shortens the
  prefix; a read or checksum failure mid-way ends the attempt (``kv_load_failed``) and the
  caller computes the prompt without the pool.
* ``plan_store`` + the engine's ``KVSink`` calls + ``finish_store_later`` (a prompt on a prefill
  instance): before the prompt runs, the pool objects it will complete and the pool lacks are
  allocated on the segments (``PoolClient.reserve``); after each layer of the step that
  computes its last tokens, that layer of every such object is packed into this instance's
  pool staging and its write started (``PoolWrite.write(part)``), beside the layer's KV stream
  to the decode instance; once the prompt is done the writes are awaited and sealed in the
  background (checksums computed then), or aborted if the prompt failed.
* ``store`` (after a whole conversation turn, or a prompt the layer-wise store could not take):
  the full pool blocks the pool lacks are packed from the engine's cached blocks in one
  engine-thread call and put. Stores run in the background, a few at a time; one that finds
  its blocks evicted already stores the ones before.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from cluster.pool.client import NewObject, PoolClient, PoolRead, PoolWrite
from cluster.pool.objects import PoolGeometry, part_checksums
from cluster.staging import StagingArea, StagingFull, StagingRange, when_free
from engine.async_engine import AsyncLLMEngine
from engine.disaggregation import KVHandoff
from engine.kv_layout import pack
from engine.llm_engine import LLMEngine, PromptChunk
from engine.sampling_params import SamplingParams

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
        self.stored_layerwise = 0  # objects sealed from a layer-wise store
        # Layer-wise stores by request: planned on the event loop, filled on the engine thread
        # (under the lock, so once ``finish_store_later`` has popped one no copy into its
        # staging can still start).
        self._writing: dict[str, _LayerwiseStore] = {}
        self._writing_lock = threading.Lock()
        # Closing a read waits for its transfers to let go of the staging: never on the engine thread.
        self._closer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pool-close")

    @property
    def staging_ranges(self) -> int:
        """Loads and stores holding this instance's pool staging now."""
        return self._area.num_allocated

    async def prepare_load(self, token_ids: list[int]) -> PoolLoad | None:
        """Lease the pool's part of ``token_ids``'s prefix past the local cache and start reading
        it, every layer at once in layer order, into this instance's pool staging. None when
        the pool has nothing to add. The engine consumes it layer by layer (``start``)."""
        g = self.geometry
        bpo = g.blocks_per_object
        keys = g.object_keys(token_ids, len(token_ids) - 1)  # the last token is always computed
        if not keys:
            return None
        local = await self._client.call(lambda _: self._handoff.cached_prefix_blocks(token_ids))
        first = local // bpo
        wanted = keys[first : first + self._area.nbytes // g.nbytes]
        if not wanted:
            return None
        r = await when_free(lambda: self._area.allocate(len(wanted) * g.nbytes), self._timeout_s)
        offsets = [r.offset + i * g.nbytes for i in range(len(wanted))]
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(None, self.pool.open_read, wanted, self._area.handle, offsets, self._memory)
        try:
            read = await asyncio.shield(opening)
        except BaseException:
            opening.add_done_callback(lambda f: self._abandon(f, r))  # cancelled while leasing
            raise
        if not read.num_objects:
            self._closer.submit(self._close, read, r, False)
            return None
        layout = g.layout
        views = [self._area.view(StagingRange(off, g.nbytes), layout.torch_dtype, layout.shape(bpo))
                 for off in offsets[: read.num_objects]]
        return PoolLoad(read, views, first * bpo, lambda used: self._closer.submit(self._close, read, r, used))

    def start(self, request_id: str, token_ids: list[int], params: SamplingParams,
              load: PoolLoad) -> Callable[[LLMEngine], None]:
        """The engine-thread call that queues the request with its prefix arriving from ``load``."""
        return lambda _: self._handoff.add_loading(request_id, token_ids, params, load.start_block,
                                                   load.num_blocks, load)

    def _abandon(self, opening: asyncio.Future, r: StagingRange) -> None:
        if opening.cancelled() or opening.exception() is not None:
            self._area.release(r)
        else:
            self._closer.submit(self._close, opening.result(), r, False)

    def _close(self, read: PoolRead, r: StagingRange, used: bool) -> None:
        read.close(used)  # waits until no transfer writes into the range any more
        self._area.release(r)

    # -- storing layer by layer (a KVSink of the engine) ---------------------------------------------
    async def plan_store(self, request_id: str, token_ids: list[int]) -> bool:
        """Allocate the pool objects ``token_ids`` will complete and the pool lacks, to be
        written layer by layer as the prompt's last step computes them. False (nothing planned)
        when the pool holds them all, has no room for every one of them now, or this instance's
        pool staging is busy: then ``store_later`` is the way."""
        g = self.geometry
        keys = g.object_keys(token_ids, len(token_ids))
        if not keys:
            return False
        loop = asyncio.get_running_loop()
        holders = await loop.run_in_executor(None, self.pool.holders, keys)
        missing = [i for i, h in enumerate(holders) if not h][: self._area.nbytes // g.nbytes]
        if not missing:
            return False
        try:
            r = self._area.allocate(len(missing) * g.nbytes)
        except StagingFull:
            return False
        try:
            # Tail first, as ``store`` puts them.
            objects = [NewObject(keys[i], r.offset + j * g.nbytes, g.nbytes, g.part_bytes)
                       for j, i in reversed(list(enumerate(missing)))]
            write = await loop.run_in_executor(None, self.pool.reserve, self._area.handle, objects)
        except BaseException:
            self._area.release(r)
            raise
        if write.num_placed < len(objects):
            # Some went nowhere (the pool is busy or full): rather than leave them out, store
            # them all from the prefix cache after the prompt, as the pool's LRU allows then.
            self._closer.submit(self._abort_plan, write, r)
            return False
        store = _LayerwiseStore(write, r, [i * g.blocks_per_object for i in reversed(missing)], keys, holders)
        with self._writing_lock:
            duplicate = request_id in self._writing
            if not duplicate:
                self._writing[request_id] = store
        if duplicate:
            self._closer.submit(self._finish_store, store, False)
            raise ValueError(f"request {request_id!r} is already being stored")
        return True

    def _abort_plan(self, write: PoolWrite, r: StagingRange) -> None:
        try:
            write.abort()
        finally:
            self._area.release(r)

    def wants(self, request_id: str) -> bool:
        return request_id in self._writing

    def layer_done(self, layer: int, kv_cache: torch.Tensor, chunks: list[PromptChunk]) -> None:
        g = self.geometry
        bpo, layout = g.blocks_per_object, g.layout
        with self._writing_lock:
            for chunk in chunks:
                store = self._writing.get(chunk.request_id)
                if store is None or not chunk.last:  # every object is final in the last chunk's layer
                    continue
                ids = chunk.block_ids
                for obj, place, first in zip(store.write.objects, store.write.places, store.first_blocks):
                    if place is None:
                        continue
                    view = self._area.view(StagingRange(obj.offset, g.nbytes), layout.torch_dtype, layout.shape(bpo))
                    pack(kv_cache, ids[first : first + bpo], range(layer, layer + 1), view[layer : layer + 1])
                store.write.write(part=layer)
                store.layers += 1

    def finish_store_later(self, request_id: str, commit: bool) -> None:
        """End a planned layer-wise store in the background: seal what was written when
        ``commit`` (the prompt computed every layer of its last step), else abort it."""
        with self._writing_lock:
            store = self._writing.pop(request_id, None)
        if store is not None:
            self._closer.submit(self._finish_store, store, commit)

    def _finish_store(self, store: _LayerwiseStore, commit: bool) -> None:
        g = self.geometry
        try:
            if commit and store.layers == g.num_parts:
                sums = [part_checksums(self._memory[o.offset : o.offset + g.nbytes], g.part_bytes)
                        for o in store.write.objects]
                stored = sum(s is not None for s in store.write.seal(sums))
                with self._writing_lock:
                    self.stored_layerwise += stored
                # As ``store`` does: what the pool held was used again, and after the seals.
                self.pool.touch(store.keys, store.holders)
            else:
                store.write.abort()
        except Exception:  # a failed store only costs a later request its hit
            log.exception("pool: layer-wise store failed")
        finally:
            self._area.release(store.staging)  # seal and abort return once no write reads it

    # -- storing from the prefix cache --------------------------------------------------------------
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
        """Put the pool blocks of ``token_ids[:computed_tokens]`` the pool lacks and touch those it
        holds; returns how many were put."""
        keys = self.geometry.object_keys(token_ids, computed_tokens)
        loop = asyncio.get_running_loop()
        holders = await loop.run_in_executor(None, self.pool.holders, keys)
        stored = await self._put_missing(token_ids, keys, holders)
        # What the pool held was used again (from this instance's own cache, or just loaded): as
        # recent as a put, or its LRU would evict a prefix in use before a stale one. After the
        # puts, so that a chain's head is its most recent object.
        await loop.run_in_executor(None, self.pool.touch, keys, holders)
        return stored

    async def _put_missing(self, token_ids: list[int], keys: list[str], holders: list[list[str]]) -> int:
        g = self.geometry
        bpo = g.blocks_per_object
        loop = asyncio.get_running_loop()
        missing = [i for i, h in enumerate(holders) if not h][: self._area.nbytes // g.nbytes]
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
                # Tail first: a node seals the head last, so its LRU evicts the chain from the end,
                # and readers (who need the head) see the prefix only once it is all there.
                order = range(packed - 1, -1, -1)
                objects = [NewObject(keys[missing[j]], r.offset + j * g.nbytes, g.nbytes, g.part_bytes) for j in order]
                sums = [part_checksums(self._memory[o.offset : o.offset + g.nbytes], g.part_bytes) for o in objects]
                return sum(s is not None for s in self.pool.put_many(self._area.handle, objects, sums))

            return await loop.run_in_executor(None, put_all)
        finally:
            self._area.release(r)


@dataclass
class _LayerwiseStore:
    write: PoolWrite  # the objects in the order sealed (tail first), with their places
    staging: StagingRange
    first_blocks: list[int]  # each object's first engine block in the prompt
    keys: list[str]  # all the prompt's objects, and where the pool held them at planning
    holders: list[list[str]]
    layers: int = 0  # layers written so far


class PoolLoad:
    """A prefix read from the pool, as the engine consumes it (``engine.sequence.KVLoad``).
    ``close`` is idempotent and may come from any thread."""

    def __init__(self, read: PoolRead, views: list[torch.Tensor], start_block: int,
                 on_close: Callable[[bool], object]) -> None:
        self._read = read
        self._views = views  # one ``KVLayout.shape(blocks_per_object)`` tensor per object
        self.start_block = start_block
        self.num_blocks = sum(v.shape[2] for v in views)
        self._on_close = on_close
        self._lock = threading.Lock()
        self._closed = False

    def layer(self, i: int) -> list[torch.Tensor] | None:
        if not self._read.wait_part(i):
            return None
        return [v[i : i + 1] for v in self._views]

    def close(self, used: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._on_close(used)
