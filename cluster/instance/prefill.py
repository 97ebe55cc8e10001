"""Serve a prefill and stream its KV (the prefill role).

``Prefiller.prefill`` reads "expect all sinks, stream, finish all". The prompt's KV sinks
(``cluster.kv_stream.PrefillSink``) are the decode instance's reservation (``DecodeStream``), on
a pipeline group the later stages' streams of their layers (``StageStreams``), and with a
KVCache pool the pool objects planned for it (``PoolStore``). Each is expected before the prompt
runs; the engine computes the prompt like any other request, its ``KVSink``s taking each layer
as it is computed, and the prefill-role engine ends the request at its first token
(``handoff``); then every sink is finished (the answer comes once every layer's write to the
decode instance has landed) or, if the prompt failed, aborted.

With a KVCache pool, a prompt first loads whatever prefix the pool has beyond the local cache
(``async with pool_prefix``, as the colocated path in ``decode.py``); a load that breaks mid-way
ends the attempt, and the prompt is computed again without it.

A prefill that comes too late is refused as ``UnknownReservation`` (a request error): one whose id
was aborted here before it arrived or while its sinks were expected (``aborted``, the instance's
memory of recent aborts), and one whose writes the decode instance refused because the
reservation is gone (``StaleWrite``: it was released, perhaps reused, while this prefill waited
or computed).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from cluster.instance.pool_io import PoolIO, PoolStore, pool_prefix
from cluster.kv_stream import DecodeStream, KVDestination, KVSender, PrefillSink, PrefillSinks
from cluster.cpp.stage import StageLink, StageStreams
from cluster.messenger import StaleWrite
from cluster.protocol import BadRequest, UnknownReservation
from engine.async_engine import AsyncLLMEngine
from engine.engine_client import EngineError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.session import SessionHint


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
                      dest: KVDestination, session: SessionHint | None = None) -> RequestOutput:
        """Compute the prompt, stream its KV to ``dest``, return the first token's output.
        Raises ``BadRequest``, ``TimeoutError`` (send staging stayed full),
        ``EngineOverloaded``, ``EngineError`` and ``TransferError`` (a KV write failed)."""
        block_size = self._sender.layout.block_size
        if dest.skip_blocks + dest.num_blocks != -(-len(token_ids) // block_size):
            raise BadRequest("destination block count does not match the prompt")
        self._check_aborted(request_id)
        try:
            async with pool_prefix(self._pool, request_id, token_ids, params, session) as start:
                output = await self._stream(request_id, token_ids, params.cache_salt, dest,
                                            lambda: self._client.stream(request_id, start))
            if output.finish_reason == "kv_load_failed":
                # What the pool sent broke mid-way: compute the whole prompt here, streaming it again.
                output = await self._stream(request_id, token_ids, params.cache_salt, dest,
                                            lambda: self._client.generate(request_id, token_ids, params, session))
            return output
        except StaleWrite as e:
            raise UnknownReservation(f"the decode instance no longer holds the reservation for {request_id!r}: {e}") from None

    def _check_aborted(self, request_id: str) -> None:
        if self._aborted is not None and self._aborted(request_id):
            raise UnknownReservation(f"request {request_id!r} was aborted before its prefill arrived")

    def _sinks(self, request_id: str, token_ids: list[int], dest: KVDestination, salt: str | None) -> PrefillSinks:
        """The prompt's KV sinks, in the order they finish: the decode instance's before the pool's,
        which stores nothing of a prompt whose stream failed."""
        sinks: list[PrefillSink] = [DecodeStream(self._sender, request_id, dest, self._timeout_s)]
        if self._stages is not None:
            sinks.append(StageStreams(self._stages, request_id, dest))
        if self._pool is not None:
            sinks.append(PoolStore(self._pool, request_id, token_ids, salt))
        return PrefillSinks(sinks)

    async def _stream(self, request_id: str, token_ids: list[int], salt: str | None, dest: KVDestination,
                      outputs: Callable[[], AsyncIterator[RequestOutput]]) -> RequestOutput:
        """Expect every sink, run the prompt (``outputs()``: its engine stream), then finish
        every sink, or abort them all if it did not compute whole."""
        sinks = self._sinks(request_id, token_ids, dest, salt)
        await sinks.expect()
        output = None
        try:
            self._check_aborted(request_id)  # it may have come while the pool or the staging was waited for
            async for out in outputs():
                output = out
        except BaseException:
            # Frees the sinks' staging once no write can still read it, even if we are cancelled.
            await asyncio.shield(sinks.abort())
            raise
        if output is not None and output.finish_reason not in ("abort", "kv_load_failed"):
            await sinks.finish()
        else:
            # An aborted request stopped streaming on purpose; a failed load is computed again.
            await sinks.abort()
        if output is None:
            raise EngineError("the engine ended the request without output")
        return output
