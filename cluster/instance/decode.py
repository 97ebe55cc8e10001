"""Continue decoding from received KV (the decode role), or serve a whole request (``both``).

* ``Decoder.continue_decode`` (decode role): take over a reservation (``receiver.py``) whose KV
  has landed and stream the rest of the request from the first token its prefill sampled.
* ``Decoder.whole`` (both role, or decode for a local prefill): a whole request, prompt to last
  token, in this one engine.

With a KVCache pool (``PoolIO``), a colocated prompt first loads whatever prefix the pool has
beyond the local cache (``async with pool_prefix``), and once a request finishes decoding its
prompt's and output's blocks go to the pool (the next turn of a conversation starts with both).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from cluster.instance.pool_io import PoolIO, pool_prefix
from cluster.instance.receiver import Receiver
from cluster.protocol import Prefilled
from engine.async_engine import AsyncLLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.session import SessionHint


class Decoder:
    def __init__(self, client: AsyncLLMEngine, receiver: Receiver, pool: PoolIO | None = None) -> None:
        self._client = client
        self._receiver = receiver
        self._pool = pool

    def continue_decode(self, request_id: str, prefilled: Prefilled,
                        session: SessionHint | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a reserved request from the first token its prefill sampled (its session was
        given at ``reserve``; ``session`` retains what it stores in the pool)."""
        held = self._receiver.prompt(request_id)
        admit = self._receiver.take_over(
            lambda h, kv: h.admit(request_id, kv, prefilled.first_token, prefilled.sampler_state,
                                  prefilled.num_cached_tokens), request_id)
        stream = self._client.stream(request_id, admit)
        # The prefill instance sampled the first token; this stream starts after it.
        if held is None:
            return stream
        prompt, salt = held
        return self._stored_after(prompt + [prefilled.first_token], stream, session, salt)

    async def whole(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    session: SessionHint | None = None) -> AsyncIterator[RequestOutput]:
        failed = False
        async with pool_prefix(self._pool, request_id, token_ids, params, session) as start:
            stream = self._client.stream(request_id, start)
            async with aclosing(self._stored_after(token_ids, stream, session, params.cache_salt)) as outs:
                async for out in outs:
                    if out.finish_reason == "kv_load_failed":
                        failed = True  # nothing was streamed yet: compute it without the pool
                        break
                    yield out
        if failed:
            retry = self._client.generate(request_id, token_ids, params, session)
            async with aclosing(self._stored_after(token_ids, retry, session, params.cache_salt)) as outs:
                async for out in outs:
                    yield out

    async def _stored_after(self, token_ids: list[int], stream: AsyncGenerator[RequestOutput, None],
                            session: SessionHint | None, salt: str | None) -> AsyncIterator[RequestOutput]:
        """``stream``, then the finished request's prompt and output blocks go to the pool (keyed
        under its cache ``salt``): what its session's next turn starts with, retained there under
        ``session``."""
        outputs: list[int] = []
        async with aclosing(stream):  # a client that left aborts the request now, not at collection
            async for out in stream:
                outputs.extend(out.new_token_ids)
                if out.finished and out.finish_reason not in ("abort", "kv_load_failed") and self._pool is not None:
                    # The last sampled token never ran through the model: it has no KV.
                    tokens = token_ids + outputs
                    self._pool.store_later(tokens, len(tokens) - 1, session, salt)
                yield out
