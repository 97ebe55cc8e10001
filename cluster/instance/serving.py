"""The requests an instance serves for the Conductor.

* ``prefill`` (prefill role): announce the KV stream to the sender (a send-staging range), run
  the prompt in the engine like any other request; the engine's ``KVSink``s stream each layer
  into the decode instance's reservation (and, with a pool, into the pool objects planned for
  it) as it is computed, and the prefill-role engine ends the request at its first token
  (``handoff``). Answered once every layer's write to the decode instance has completed.
* ``continue_decode`` (decode role): take over a reservation whose KV has landed and stream the
  rest of the request.
* ``whole`` (both role): a whole request, prompt to last token, in this one engine.

With a KVCache pool (``PoolIO``), a prompt first loads whatever prefix the pool has beyond the
local cache, and what was computed goes back to the pool: the prompt's blocks layer by layer as
it is prefilled, the prompt's and the output's once a request finishes decoding (the next turn
of a conversation starts with both).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from cluster.instance.pool_io import PoolIO, PoolLoad
from cluster.instance.receiver import Receiver
from cluster.pool.metadata import MetadataUnavailable
from cluster.instance.kv_stream import KVDestination, KVSender
from cluster.cpp.stage import StageLink
from cluster.messenger.staging import when_free
from cluster.messenger import TransferError
from engine.async_engine import AsyncLLMEngine
from engine.engine_client import EngineError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Serving:
    def __init__(self, client: AsyncLLMEngine, sender: KVSender | None, receiver: Receiver,
                 transfer_timeout_s: float, pool: PoolIO | None = None, stages: StageLink | None = None) -> None:
        """``stages``: a first pipeline stage's link to the later ones, which stream their own
        layers of each prompt's KV beside ``sender``."""
        self._client = client
        self._sender = sender
        self._stages = stages
        self._receiver = receiver
        self._timeout_s = transfer_timeout_s
        self._pool = pool

    async def prefill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      dest: KVDestination) -> RequestOutput:
        """Compute the prompt, stream its KV to ``dest``, return the first token's output.
        Raises ValueError (bad request), ``TimeoutError`` (send staging stayed full),
        ``EngineOverloaded``, ``EngineError`` and ``TransferError`` (a KV write failed)."""
        sender = self._sender
        if sender is None:
            raise ValueError("this instance does not send KV")
        block_size = sender.layout.block_size
        if dest.skip_blocks + dest.num_blocks != -(-len(token_ids) // block_size):
            raise ValueError("destination block count does not match the prompt")
        load = await self._prepare_load(request_id, token_ids, params)
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
        try:
            async for out in self._client.stream(request_id, self._start(request_id, token_ids, params, load)):
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

    def _start(self, request_id: str, token_ids: list[int], params: SamplingParams,
               load: PoolLoad | None) -> Callable[[LLMEngine], Any]:
        if load is None:
            return lambda e: e.add_request(token_ids, params, request_id=request_id)
        return self._pool.start(request_id, token_ids, params, load)

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

    async def _prepare_load(self, request_id: str, token_ids: list[int], params: SamplingParams) -> PoolLoad | None:
        if self._pool is None or params.prompt_logprobs is not None:
            return None  # a prompt scored token by token computes every position
        try:
            return await self._pool.prepare_load(request_id, token_ids)
        except (TimeoutError, TransferError, MetadataUnavailable) as exc:
            # The pool is a cache: without it the engine computes the whole prompt.
            log.warning("pool: prefix load failed, computing the prompt: %s", exc)
            return None

    async def _stored_after(self, token_ids: list[int], stream: AsyncGenerator[RequestOutput, None]
                            ) -> AsyncIterator[RequestOutput]:
        """``stream``, then the finished request's prompt and output blocks go to the pool."""
        outputs: list[int] = []
        try:
            async for out in stream:
                outputs.extend(out.new_token_ids)
                if out.finished and out.finish_reason not in ("abort", "kv_load_failed") and self._pool is not None:
                    # The last sampled token never ran through the model: it has no KV.
                    tokens = token_ids + outputs
                    self._pool.store_later(tokens, len(tokens) - 1)
                yield out
        finally:
            await stream.aclose()  # a client that left aborts the request now, not at collection

    def continue_decode(self, request_id: str, prefilled: Any) -> AsyncIterator[RequestOutput]:
        """Stream a reserved request from the first token its prefill sampled. ``prefilled``:
        ``first_token``, ``num_cached_tokens`` (ints) and ``sampler_state`` (bytes or None)."""
        first = prefilled.get("first_token") if isinstance(prefilled, dict) else None
        cached = prefilled.get("num_cached_tokens", 0) if isinstance(prefilled, dict) else None
        state = prefilled.get("sampler_state") if isinstance(prefilled, dict) else None
        if type(first) is not int or type(cached) is not int or not (state is None or isinstance(state, bytes)):
            raise ValueError("prefilled needs first_token and num_cached_tokens integers")
        prompt = self._receiver.prompt(request_id)
        admit = self._receiver.take_over(lambda h, kv: h.admit(request_id, kv, first, state, cached), request_id)
        stream = self._client.stream(request_id, admit)
        # The prefill instance sampled the first token; this stream starts after it.
        return stream if prompt is None else self._stored_after(prompt + [first], stream)

    async def whole(self, request_id: str, token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        load = await self._prepare_load(request_id, token_ids, params)
        failed = False
        try:
            stream = self._client.stream(request_id, self._start(request_id, token_ids, params, load))
            async with aclosing(self._stored_after(token_ids, stream)) as outs:
                async for out in outs:
                    if out.finish_reason == "kv_load_failed":
                        failed = True  # nothing was streamed yet: compute it without the pool
                        break
                    yield out
        finally:
            if load is not None:
                load.close(used=False)  # a no-op unless the engine never took the request
        if failed:
            async with aclosing(self._stored_after(token_ids, self._client.generate(request_id, token_ids, params))) as outs:
                async for out in outs:
                    yield out
