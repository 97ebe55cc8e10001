"""The requests an instance serves for the Conductor.

* ``prefill`` (prefill role): announce the KV stream to the sender (a send-staging range), run
  the prompt in the engine like any other request; the engine's ``KVSink`` streams each layer
  into the decode instance's reservation as it is computed, and the prefill-role engine ends the
  request at its first token (``handoff``). Answered once every layer's write has completed.
* ``continue_decode`` (decode role): take over a reservation whose KV has landed and stream the
  rest of the request.
* ``whole`` (both role): a whole request, prompt to last token, in this one engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from cluster.instance.receiver import Receiver
from cluster.kv_stream import KVDestination, KVSender
from cluster.staging import when_free
from cluster.transfer import TransferError
from engine.async_engine import AsyncLLMEngine
from engine.engine_client import EngineError
from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams


class Serving:
    def __init__(self, client: AsyncLLMEngine, sender: KVSender | None, receiver: Receiver,
                 transfer_timeout_s: float) -> None:
        self._client = client
        self._sender = sender
        self._receiver = receiver
        self._timeout_s = transfer_timeout_s

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
        await when_free(lambda: sender.expect(request_id, dest), self._timeout_s)
        output = None
        try:
            async for out in self._client.generate(request_id, token_ids, params):
                output = out
        except BaseException:
            # Frees the send staging once no write can still read it, even if we are cancelled.
            await asyncio.shield(self._finish_quietly(request_id))
            raise
        try:
            await sender.finish(request_id, self._timeout_s)
        except TransferError:
            if output is not None and output.finish_reason != "abort":
                raise  # an aborted request stopped streaming on purpose
        if output is None:
            raise EngineError("the engine ended the request without output")
        return output

    async def _finish_quietly(self, request_id: str) -> None:
        try:
            await self._sender.finish(request_id, self._timeout_s)
        except TransferError:
            pass  # the request failed anyway; its own error is what the caller reports

    def continue_decode(self, request_id: str, prefilled: Any) -> AsyncIterator[RequestOutput]:
        """Stream a reserved request from the first token its prefill sampled. ``prefilled``:
        ``first_token``, ``num_cached_tokens`` (ints) and ``sampler_state`` (bytes or None)."""
        first = prefilled.get("first_token") if isinstance(prefilled, dict) else None
        cached = prefilled.get("num_cached_tokens", 0) if isinstance(prefilled, dict) else None
        state = prefilled.get("sampler_state") if isinstance(prefilled, dict) else None
        if type(first) is not int or type(cached) is not int or not (state is None or isinstance(state, bytes)):
            raise ValueError("prefilled needs first_token and num_cached_tokens integers")
        admit = self._receiver.take_over(lambda h, kv: h.admit(request_id, kv, first, state, cached), request_id)
        return self._client.stream(request_id, admit)

    def whole(self, request_id: str, token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        return self._client.generate(request_id, token_ids, params)
