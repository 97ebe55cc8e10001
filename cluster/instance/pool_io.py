"""An instance's traffic with the KVCache pool: load a prompt's prefix, store what it computed.

* ``async with pool_prefix(...) as start`` (a prompt arriving): the pool objects past what the
  local prefix cache holds are leased and their reads started, layer by layer, into this
  instance's pool staging (``PoolIO.prepare_load``, ``PoolClient.open_read``); the request
  enters the engine through ``start`` with those blocks to be filled (``KVHandoff.add_loading``),
  and before each layer of its first step the engine takes that layer (``PoolLoad.layer``:
  wait, verify the checksums, hand over), so loading overlaps computing: prefill time ~
  max(load, compute). A miss or a lease refused only shortens the prefix; a read or checksum
  failure mid-way ends the attempt (``kv_load_failed``) and the caller computes the prompt
  without the pool. Leaving the block lets go of a load the engine never took.
* ``PoolStore``, a prefill's sink (``cluster.kv_stream.PrefillSink``; ``plan_store``, the engine's
  ``KVSink`` calls, ``finish_store_later``): before the prompt runs, the pool objects it will
  complete and the pool lacks are allocated on the segments (``PoolClient.reserve``); after
  each layer of the step that computes its last tokens, that layer of every such object is
  packed into this instance's pool staging and its write started (``PoolWrite.write(part)``),
  beside the layer's KV stream to the decode instance; once the prompt is done the writes are
  awaited and sealed in the background (checksums computed then), or aborted if the prompt failed.
* ``store`` (after a whole conversation turn, or a prompt the layer-wise store could not take):
  the full pool blocks the pool lacks are packed from the engine's cached blocks in one
  engine-thread call and put. Stores run in the background, a few at a time; one that finds
  its blocks evicted already stores the ones before.

The first stage of a pipeline group holds only its layers: it leases and reserves for the
group, reads and writes its own layers' parts, and has every later stage do the same with
theirs. What a group changes (when a load is read, how a store is sealed, whether a prompt is
stored from the prefix cache) is asked of ``stages`` (``cluster.cpp.pool_stages``: ``OneStage``
for an instance that holds every layer, ``LaterStages`` for a group's first stage).

The pool is a cache: whatever goes wrong with it costs a prompt its hit or its store, never its
answer. Every look at the pool's index (``_index``) runs on this instance's own pool threads
(not the event loop's default executor, which is small on few cores and which other work
shares) and is waited for at most ``metadata_timeout_s``; a metadata store that is down or slow
(``MetadataUnavailable``, or no answer in time) makes the load or store give up, counted in the
client's ``metadata_unavailable``, and for ``metadata_backoff_s`` after that the pool is not
asked at all. A segment that does not answer costs its objects (the transfer timeout bounds
every call to one). On the engine thread the pool only starts writes (``layer_done``) and waits
for a layer being read (``PoolLoad.layer``, bounded by the transfer timeout).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.cpp.pool_stages import OneStage, PoolStages
from cluster.kv_stream import PrefillSink
from cluster.messenger import TransferError
from cluster.messenger.staging import StagingArea, StagingFull, StagingRange, when_free
from cluster.pool.client import NewObject, PoolClient, PoolRead, PoolWrite
from cluster.pool.layerwise import LayerwiseStore, LayerwiseStores
from cluster.metadata import MetadataUnavailable
from cluster.pool.objects import PoolGeometry, part_checksums
from engine.async_engine import AsyncLLMEngine
from engine.disaggregation import KVHandoff
from engine.hooks import PromptChunk
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.session import SessionHint

log = logging.getLogger(__name__)


class PoolIO:
    def __init__(self, client: AsyncLLMEngine, handoff: KVHandoff, pool: PoolClient, geometry: PoolGeometry,
                 area: StagingArea, timeout_s: float, max_background_stores: int = 4, layers: range | None = None,
                 stages: PoolStages | None = None, *, metadata_timeout_s: float = 1.0,
                 metadata_backoff_s: float = 1.0, io_threads: int = 4) -> None:
        """``layers``: the model layers this instance's KV cache holds (a first pipeline stage's;
        None: all); ``stages``: the stages that hold them all (None: ``OneStage``, this instance
        alone). ``metadata_timeout_s``: the
        longest a prompt waits for the pool's index; ``metadata_backoff_s``: how long the pool
        is left alone after its metadata failed; ``io_threads``: the pool's own threads."""
        self._client = client
        self._handoff = handoff
        self.pool = pool
        self.geometry = geometry
        self._area = area
        self._timeout_s = timeout_s
        self._memory = memoryview(area.buffer.numpy())
        self._stores: set[asyncio.Task] = set()
        self._max_stores = max_background_stores
        self._layers = range(geometry.num_parts) if layers is None else layers
        self._stages = OneStage() if stages is None else stages
        self.stores_skipped = 0  # the background store queue was full (or a group's): those blocks stay local
        self.stored_layerwise = 0  # objects sealed from a layer-wise store
        self._counter_lock = threading.Lock()
        # Layer-wise stores by request: planned on the event loop, filled on the engine thread.
        self._writing = LayerwiseStores(area, geometry, self._layers)
        self._object_bytes = self._writing.object_bytes  # the staging an object takes: this stage's parts
        # Closing a read waits for its transfers to let go of the staging: never on the engine thread.
        self._closer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pool-close")
        # The pool's blocking calls (metadata, segments, later stages): threads of its own, so a
        # slow pool never takes the default executor's few threads from unrelated requests.
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="pool-io")
        self._metadata_timeout_s = metadata_timeout_s
        self._metadata_backoff_s = metadata_backoff_s
        self._metadata_down_until = float("-inf")

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the pool's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _index(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a read of the pool's index, on the pool's threads and waited for at most
        ``metadata_timeout_s``. ``MetadataUnavailable`` (counted) when the metadata fails or is
        late, or failed less than ``metadata_backoff_s`` ago; a late call finishes unwatched."""
        if time.monotonic() < self._metadata_down_until:
            self.pool.count("metadata_unavailable")
            raise MetadataUnavailable("the pool's metadata failed moments ago; not asking it yet")
        call = asyncio.get_running_loop().run_in_executor(self._io, fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(call), self._metadata_timeout_s)
        except (TimeoutError, MetadataUnavailable) as exc:
            call.add_done_callback(lambda f: f.cancelled() or f.exception())  # its late error is no news
            self._metadata_down_until = time.monotonic() + self._metadata_backoff_s
            self.pool.count("metadata_unavailable")
            if isinstance(exc, MetadataUnavailable):
                raise
            raise MetadataUnavailable(f"the pool's metadata did not answer within {self._metadata_timeout_s:g} s") from None

    @property
    def staging_ranges(self) -> int:
        """Loads and stores holding this instance's pool staging now."""
        return self._area.num_allocated

    @property
    def staging_holders(self) -> list[tuple[str, float]]:
        """What holds each of them, and for how long (``StagingArea.holders``)."""
        return self._area.holders()

    async def prepare_load(self, request_id: str, token_ids: list[int], salt: str | None = None) -> PoolLoad | None:
        """Lease the pool's part of ``token_ids``'s prefix (cached under ``salt``) past the local cache and start reading
        it, every layer at once in layer order, into this instance's pool staging. None when
        the pool has nothing to add. The engine consumes it layer by layer (``start``). A
        pipeline group's stages have read and verified their layers of it when this returns."""
        g = self.geometry
        bpo = g.blocks_per_object
        keys = g.object_keys(token_ids, len(token_ids) - 1, salt)  # the last token is always computed
        if not keys:
            return None
        local = await self._client.call(lambda _: self._handoff.cached_prefix_blocks(token_ids, salt))
        first = local // bpo
        size = self._object_bytes
        wanted = keys[first : first + self._area.nbytes // size]
        if not wanted:
            return None
        run = await self._index(self.pool.lookup, wanted)  # MetadataUnavailable: nothing to load
        if not run:
            self.pool.count("misses", len(wanted))
            return None
        r = await when_free(lambda: self._area.allocate(len(run) * size, owner=f"load {request_id}"), self._timeout_s)
        offsets = [r.offset + i * size for i in range(len(run))]
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(self._io, lambda: self.pool.open_read(
            wanted, self._area.handle, offsets, self._memory, self._stages.reads_layerwise, self._layers, run=run,
            object_size=(g.nbytes, g.part_bytes)))
        try:
            read = await asyncio.shield(opening)
        except BaseException:
            opening.add_done_callback(lambda f: self._abandon(f, r))  # cancelled while leasing
            raise
        loading = loop.run_in_executor(self._io, self._stages.load, request_id, read, self._layers)
        try:
            count = await asyncio.shield(loading)
        except BaseException:
            loading.add_done_callback(lambda _: self._unload(request_id, read, r, False))
            raise
        if not count:
            self._unload(request_id, read, r, False)
            return None
        views = [self._writing.object_view(off) for off in offsets[:count]]
        return PoolLoad(read, views, first * bpo, lambda used: self._unload(request_id, read, r, used))

    def _unload(self, request_id: str, read: PoolRead, r: StagingRange, used: bool) -> None:
        self._stages.unload(request_id)
        self._closer.submit(self._close, read, r, used)

    def start(self, request_id: str, token_ids: list[int], params: SamplingParams,
              load: PoolLoad, session: SessionHint | None = None) -> Callable[[LLMEngine], None]:
        """The engine-thread call that queues the request with its prefix arriving from ``load``."""
        return lambda _: self._handoff.add_loading(request_id, token_ids, params, load.start_block,
                                                   load.num_blocks, load, session)

    def _abandon(self, opening: asyncio.Future, r: StagingRange) -> None:
        # Nothing was asked of the later stages yet.
        if opening.cancelled() or opening.exception() is not None:
            self._area.release(r)
        else:
            self._closer.submit(self._close, opening.result(), r, False)

    def _close(self, read: PoolRead, r: StagingRange, used: bool) -> None:
        read.close(used)  # waits until no transfer writes into the range any more
        self._area.release(r)

    # -- storing layer by layer (a KVSink of the engine) ---------------------------------------------
    async def plan_store(self, request_id: str, token_ids: list[int], salt: str | None = None) -> bool:
        """Allocate the pool objects ``token_ids`` (under ``salt``) will complete and the pool lacks, to be
        written layer by layer as the prompt's last step computes them. False (nothing planned)
        when the pool holds them all, has no room for every one of them now, or this instance's
        pool staging is busy: then ``store_later`` is the way."""
        g = self.geometry
        keys = g.object_keys(token_ids, len(token_ids), salt)
        if not keys:
            return False
        try:
            # The segments too: ``reserve`` below then finds them cached, not behind the metadata.
            holders, _ = await self._index(lambda: (self.pool.holders(keys), self.pool.segments()))
        except MetadataUnavailable as exc:
            log.warning("pool: not storing %s: %s", request_id, exc)  # the prompt runs all the same
            self._skipped()
            return False
        size = self._object_bytes
        missing = [i for i, h in enumerate(holders) if not h][: self._area.nbytes // size]
        if not missing:
            return False
        try:
            r = self._area.allocate(len(missing) * size, owner=f"store {request_id}")
        except StagingFull:
            self._skipped()
            return False
        try:
            # Tail first, as ``store`` puts them.
            objects = [NewObject(keys[i], r.offset + j * size, g.nbytes, g.part_bytes)
                       for j, i in reversed(list(enumerate(missing)))]
            write = await self._run(self.pool.reserve, self._area.handle, objects, (), self._layers)
        except BaseException:
            self._area.release(r)
            raise
        first_blocks = [i * g.blocks_per_object for i in reversed(missing)]
        taken = write.num_placed == len(objects) and await self._run(
            self._stages.store, request_id, write, first_blocks)
        if not taken:
            # Some went nowhere (the pool is busy or full): rather than leave them out, store
            # them all from the prefix cache after the prompt, as the pool's LRU allows then.
            self._closer.submit(self._abort_plan, write, r)
            self._skipped()
            return False
        store = _PlannedStore(write, r, first_blocks, keys=keys, holders=holders)
        try:
            self._writing.add(request_id, store)
        except ValueError:
            self._closer.submit(self._finish_store, request_id, store, False)
            raise
        return True

    def _skipped(self) -> None:
        """A prompt's layer-wise store not planned: counted when no store from the prefix cache
        follows (``PoolStages.stores_from_cache``)."""
        if not self._stages.stores_from_cache:
            with self._counter_lock:
                self.stores_skipped += 1

    def _abort_plan(self, write: PoolWrite, r: StagingRange) -> None:
        try:
            write.abort()
        finally:
            self._area.release(r)

    def wants(self, request_id: str) -> bool:
        return self._writing.wants(request_id)

    def layer_done(self, layer: int, kv_cache: torch.Tensor, chunks: list[PromptChunk]) -> None:
        self._writing.layer_done(layer, kv_cache, chunks)

    def finish_store_later(self, request_id: str, commit: bool) -> None:
        """End a planned layer-wise store in the background: seal what was written when
        ``commit`` (the prompt computed every layer of its last step), else abort it."""
        store = self._writing.pop(request_id)
        if store is not None:
            self._closer.submit(self._finish_store, request_id, store, commit)

    def _finish_store(self, request_id: str, store: _PlannedStore, commit: bool) -> None:
        write = store.write
        try:
            sums = None
            if commit and self._writing.complete(store):
                sums = self._writing.checksums(store)
            sums = self._stages.store_end(request_id, commit, sums)
            if sums is not None:
                stored = sum(s is not None for s in write.seal(sums))
                with self._counter_lock:
                    self.stored_layerwise += stored
                # As ``store`` does: what the pool held was used again, and after the seals.
                self.pool.touch(store.keys, store.holders)
            else:
                write.abort()
        except Exception:  # a failed store only costs a later request its hit
            log.exception("pool: layer-wise store failed")
            write.abort()  # a no-op after a seal
        finally:
            self._area.release(store.staging)  # seal and abort return once no write reads it

    # -- storing from the prefix cache --------------------------------------------------------------
    def store_later(self, token_ids: list[int], computed_tokens: int, session: SessionHint | None = None,
                    salt: str | None = None) -> None:
        """Store the full pool blocks of ``token_ids[:computed_tokens]`` (under ``salt``) in the background (not
        on a pipeline group: ``PoolStages.stores_from_cache``); a ``session``'s are retained
        there for its next turn."""
        if not self.geometry.object_keys(token_ids, computed_tokens, salt) or not self._stages.stores_from_cache:
            return
        if len(self._stores) >= self._max_stores:
            self.stores_skipped += 1
            return
        task = asyncio.create_task(self._store_quietly(token_ids, computed_tokens, session, salt))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)

    async def _store_quietly(self, token_ids: list[int], computed_tokens: int, session: SessionHint | None,
                             salt: str | None) -> None:
        try:
            await self.store(token_ids, computed_tokens, session, salt)
        except (MetadataUnavailable, TransferError, TimeoutError) as exc:
            log.warning("pool: store failed: %s", exc)  # a failed store only costs a later request its hit
        except Exception:
            log.exception("pool: store failed")

    async def store(self, token_ids: list[int], computed_tokens: int, session: SessionHint | None = None,
                    salt: str | None = None) -> int:
        """Put the pool blocks of ``token_ids[:computed_tokens]`` (under ``salt``) the pool lacks and
        touch those it holds (all of them, retained, for a ``session``); returns how many were put."""
        keys = self.geometry.object_keys(token_ids, computed_tokens, salt)
        holders, _ = await self._index(lambda: (self.pool.holders(keys), self.pool.segments()))
        stored = await self._put_missing(token_ids, salt, keys, holders)
        # What the pool held was used again (from this instance's own cache, or just loaded): as
        # recent as a put, or its LRU would evict a prefix in use before a stale one. After the
        # puts, so that a chain's head is its most recent object. A session's objects are all
        # retained, those just put too.
        if session is None:
            await self._run(self.pool.touch, keys, holders)
        else:
            where = [[stored[i]] if i in stored else h for i, h in enumerate(holders)]
            await self._run(self.pool.touch, keys, where, session.priority)
        return len(stored)

    async def prestage(self, token_ids: list[int], session: SessionHint, salt: str | None = None) -> int:
        """Bring the pool objects of ``token_ids`` (a session's last turn, prompt and output, under ``salt``) up
        from the SSD tiers to DRAM ahead of its next turn, and retain them again; returns how
        many came up."""
        keys = self.geometry.object_keys(token_ids, len(token_ids), salt)
        if not keys:
            return 0
        holders, _ = await self._index(lambda: (self.pool.holders(keys), self.pool.segments()))
        return await self._run(self.pool.touch, keys, holders, session.priority, True)

    async def _put_missing(self, token_ids: list[int], salt: str | None, keys: list[str],
                           holders: list[list[str]]) -> dict[int, str]:
        """Put the objects no segment holds; returns where each one put went (by its index)."""
        g = self.geometry
        bpo = g.blocks_per_object
        missing = [i for i, h in enumerate(holders) if not h][: self._area.nbytes // g.nbytes]
        if not missing:
            return {}
        r = await when_free(lambda: self._area.allocate(len(missing) * g.nbytes, owner="pool put"), self._timeout_s)
        try:
            layout = g.layout
            outs = [self._area.view(StagingRange(r.offset + j * g.nbytes, g.nbytes), layout.torch_dtype,
                                    layout.shape(bpo)) for j in range(len(missing))]

            def export(_engine: object) -> int:
                for j, i in enumerate(missing):
                    try:
                        self._handoff.export_prefix(token_ids, i * bpo, bpo, outs[j], salt)
                    except ValueError:
                        return j  # evicted since: store what was packed
                return len(missing)

            packed = await self._client.call(export)

            def put_all() -> dict[int, str]:
                # Tail first: a node seals the head last, so its LRU evicts the chain from the end,
                # and readers (who need the head) see the prefix only once it is all there.
                order = range(packed - 1, -1, -1)
                objects = [NewObject(keys[missing[j]], r.offset + j * g.nbytes, g.nbytes, g.part_bytes) for j in order]
                sums = [part_checksums(self._memory[o.offset : o.offset + g.nbytes], g.part_bytes) for o in objects]
                placed = self.pool.put_many(self._area.handle, objects, sums)
                return {missing[j]: s for j, s in zip(order, placed) if s is not None}

            return await self._run(put_all)
        finally:
            self._area.release(r)


@dataclass
class _PlannedStore(LayerwiseStore):
    """The objects in the order sealed (tail first), with all the prompt's objects and where the
    pool held them at planning (touched after the seal)."""

    keys: list[str] = field(default_factory=list)
    holders: list[list[str]] = field(default_factory=list)


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
        self._read.wait_part(self._read.parts.start + i)
        if self._read.good < len(self._views):  # the read may hold more objects than the load uses
            return None
        return [v[i : i + 1] for v in self._views]

    def close(self, used: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._on_close(used)


@asynccontextmanager
async def pool_prefix(pool: PoolIO | None, request_id: str, token_ids: list[int], params: SamplingParams,
                      session: SessionHint | None = None) -> AsyncIterator[Callable[[LLMEngine], Any]]:
    """How the prompt enters the engine (``AsyncLLMEngine.stream``'s ``start``): with the pool's
    part of its prefix loading, when the pool holds some past the local cache, or plainly. On
    leaving the block, a load the engine never took goes back (the engine closes one it took)."""
    load = None
    # A prompt scored token by token (prompt logprobs) computes every position.
    if pool is not None and params.prompt_logprobs is None:
        try:
            load = await pool.prepare_load(request_id, token_ids, params.cache_salt)
        except (TimeoutError, TransferError, MetadataUnavailable) as exc:
            # The pool is a cache: without it the engine computes the whole prompt.
            log.warning("pool: prefix load failed, computing the prompt: %s", exc)
    if load is None:
        yield lambda e: e.add_request(token_ids, params, request_id=request_id, session=session)
        return
    try:
        yield pool.start(request_id, token_ids, params, load, session)
    finally:
        load.close(used=False)  # a no-op once the engine has taken it


class PoolStore(PrefillSink):
    """A prefill's new pool objects, as one of its sinks (``PrefillSink``): planned at ``expect``
    and written layer by layer as the prompt's last step computes them (``PoolIO.plan_store``);
    sealed in the background at ``finish``, or, when none could be planned, stored from the
    prefix cache after the prompt (``PoolIO.store_later``); dropped at ``abort``. Never raises
    past ``expect``: the pool is a cache."""

    def __init__(self, pool: PoolIO, request_id: str, token_ids: list[int], salt: str | None = None) -> None:
        self._pool = pool
        self._request_id = request_id
        self._token_ids = token_ids
        self._salt = salt
        self._planned = False

    async def expect(self) -> None:
        self._planned = await self._pool.plan_store(self._request_id, self._token_ids, self._salt)

    async def finish(self) -> None:
        if self._planned:
            self._pool.finish_store_later(self._request_id, commit=True)
        else:
            self._pool.store_later(self._token_ids, len(self._token_ids), salt=self._salt)

    async def abort(self) -> None:
        if self._planned:
            self._pool.finish_store_later(self._request_id, commit=False)
