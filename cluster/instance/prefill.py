"""Serve a prefill and stream its KV (the prefill role).

``Prefiller.prefill``: announce the KV stream to the sender (a send-staging range), run the
prompt in the engine like any other request; the engine's ``KVSink``s stream each layer into the
decode instance's reservation (and, with a pool, into the pool objects planned for it) as it is
computed, and the prefill-role engine ends the request at its first token (``handoff``).
Answered once every layer's write to the decode instance has completed.

With a KVCache pool (``PoolIO``), a prompt first loads whatever prefix the pool has beyond the
local cache (``pool_io.prepare_load``, ``pool_io.starter``, as the colocated path in ``decode.py``),
and what was computed goes back to the pool layer by layer as it is prefilled.

A prefill that comes too late is refused as ``UnknownReservation`` (a request error): one whose id
was aborted here before it arrived (``aborted``, the instance's memory of recent aborts), and one
whose writes the decode instance refused because the reservation is gone (``StaleWrite``: it was
released, perhaps reused, while this prefill waited or computed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cluster.instance.pool_io import PoolIO, PoolLoad, prepare_load, starter
from cluster.kv_stream import KVDestination, KVSender
from cluster.cpp.stage import StageLink
from cluster.messenger.staging import when_free
from cluster.messenger import StaleWrite, TransferError
from cluster.protocol import BadRequest, UnknownReservation
from engine.async_engine import AsyncLLMEngine
from engine.engine_client import EngineError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Prefiller:
    def __init__(self, client: AsyncLLMEngine, sender: KVSender, transfer_timeout_s: float,
                 pool: PoolIO | None = None, stages: StageLink | None = None,
                 aborted: Callable[[str], bool] | None = None) -> None:
        """``stages``: a first pipeline stage's link to the later ones, which stream their own
        layers of each prompt's KV beside ``sender``. ``aborted``: whether a request id was
        aborted here lately (``Receiver.aborted``: an abort that overtook its prefill)."""
        self._aborted = aborted
        self._client = client
        self._sender = sender
        self._stages = stages
        self._timeout_s = transfer_timeout_s
        self._pool = pool

    async def prefill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      dest: KVDestination) -> RequestOutput:
        """Compute the prompt, stream its KV to ``dest``, return the first token's output.
        Raises ``BadRequest``, ``TimeoutError`` (send staging stayed full),
        ``EngineOverloaded``, ``EngineError`` and ``TransferError`` (a KV write failed)."""
        block_size = self._sender.layout.block_size
        if dest.skip_blocks + dest.num_blocks != -(-len(token_ids) // block_size):
            raise BadRequest("destination block count does not match the prompt")
        self._check_aborted(request_id)
        try:
            return await self._prefill(request_id, token_ids, params, dest)
        except StaleWrite as e:
            raise UnknownReservation(f"the decode instance no longer holds the reservation for {request_id!r}: {e}") from None

    def _check_aborted(self, request_id: str) -> None:
        if self._aborted is not None and self._aborted(request_id):
            raise UnknownReservation(f"request {request_id!r} was aborted before its prefill arrived")

    async def _prefill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       dest: KVDestination) -> RequestOutput:
        load = await prepare_load(self._pool, request_id, token_ids, params)
        storing = await self._plan_store(request_id, token_ids, load)
        try:
            output = await self._prefill_once(request_id, token_ids, params, dest, load)
            if output.finish_reason == "kv_load_failed":
                # Layers past the failed one were computed from garbage: nothing of it is stored.
                self._pool.finish_store_later(request_id, commit=False)
                storing = False
                # What the pool sent broke mid-way: compute the whole prompt here, streaming it again.
                output = await self._prefill_once(request_id, token_ids, params, dest, None)
        except BaseException:
            if storing:
                self._pool.finish_store_later(request_id, commit=False)
            raise
        if storing:
            self._pool.finish_store_later(request_id, commit=output.finish_reason != "abort")
        elif self._pool is not None and output.finish_reason != "abort":
            self._pool.store_later(token_ids, len(token_ids))
        return output

    async def _plan_store(self, request_id: str, token_ids: list[int], load: PoolLoad | None) -> bool:
        """Whether the prompt's new pool objects are stored layer by layer as its last step runs."""
        if self._pool is None:
            return False
        try:
            return await self._pool.plan_store(request_id, token_ids)
        except BaseException:
            if load is not None:
                load.close(used=False)
            raise

    async def _prefill_once(self, request_id: str, token_ids: list[int], params: SamplingParams,
                            dest: KVDestination, load: PoolLoad | None) -> RequestOutput:
        sender = self._sender
        try:
            self._check_aborted(request_id)  # it may have come while the pool was asked
            await when_free(lambda: sender.expect(request_id, dest), self._timeout_s)
        except BaseException:
            if load is not None:
                load.close(used=False)
            raise
        if self._stages is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._stages.expect, request_id, dest)
            except BaseException:
                # What the stages (and this sender) took for the request goes back.
                await asyncio.shield(self._finish_quietly(request_id))
                if load is not None:
                    load.close(used=False)
                raise
        output = None
        start = starter(self._pool, request_id, token_ids, params, load)
        try:
            async for out in self._client.stream(request_id, start):
                output = out
        except BaseException:
            # Frees the send staging once no write can still read it, even if we are cancelled.
            await asyncio.shield(self._finish_quietly(request_id))
            raise
        finally:
            if load is not None:
                load.close(used=False)  # a no-op unless the engine never took the request
        try:
            await sender.finish(request_id, self._timeout_s)
            if self._stages is not None:
                await asyncio.get_running_loop().run_in_executor(None, self._stages.finish, request_id)
        except TransferError:
            if output is not None and output.finish_reason not in ("abort", "kv_load_failed"):
                raise  # an aborted request stopped streaming on purpose, a failed load will resend
        if output is None:
            raise EngineError("the engine ended the request without output")
        return output

    async def _finish_quietly(self, request_id: str) -> None:
        try:
            await self._sender.finish(request_id, self._timeout_s)
        except TransferError:
            pass  # the request failed anyway; its own error is what the caller reports
        if self._stages is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._stages.finish, request_id)
            except TransferError:
                pass
