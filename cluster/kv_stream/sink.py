"""A prompt's KV sinks as a prefill drives them: expect all, stream, finish all.

While a prefill instance's engine computes a prompt, its KV goes to up to three places, each
fed layer by layer on the engine thread as an ``engine.hooks.KVSink``: the decode instance's
reservation (``DecodeStream``, over ``KVSender``), each later pipeline stage's stream of its own
layers (``cluster.cpp.stage.StageStreams``), and the KVCache pool objects planned for it
(``cluster.instance.pool_io.PoolStore``). Around that stream they share one life, per prompt:
``PrefillSink``. ``PrefillSinks`` drives several as one, so that the prefill route reads
``expect`` (all of them), stream (the engine), ``finish`` (all of them) or ``abort``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod


class PrefillSink(ABC):
    """One prompt's KV into one sink.

    * ``expect`` runs once, before the prompt's first chunk computes. Once it returns, the sink
      holds what the prompt's KV needs (staging, reserved objects) and its engine ``KVSink``
      wants the prompt; if it raises, the sink holds nothing for the prompt.
    * Then the engine streams the prompt into it: each layer of each chunk, on the engine thread
      (``KVSink.layer_done``), never waiting for the transfer.
    * After an ``expect`` that returned, exactly one of ``finish`` and ``abort`` runs, once the
      engine is done with the prompt. ``finish`` when the prompt was computed whole: it returns
      once the KV has landed (or is being sealed), and raises ``TransferError`` when it did not.
      ``abort`` on any failure, cancellation or early end: it never raises, and frees what
      ``expect`` took once no write can still read it.
    """

    @abstractmethod
    async def expect(self) -> None: ...

    @abstractmethod
    async def finish(self) -> None: ...

    @abstractmethod
    async def abort(self) -> None: ...


class PrefillSinks(PrefillSink):
    """Several sinks of one prompt as one, in order. ``expect`` expects each, aborting those
    before it when one raises; ``finish`` finishes each and raises the first failure, aborting
    the sinks after it (a prompt whose KV did not reach the decode instance stores nothing in
    the pool either); ``abort`` aborts each."""

    def __init__(self, sinks: list[PrefillSink]) -> None:
        self._sinks = sinks
        self._expected: list[PrefillSink] = []

    async def expect(self) -> None:
        for sink in self._sinks:
            try:
                await sink.expect()
            except BaseException:
                # What the sinks before it took goes back, even if we are cancelled.
                await asyncio.shield(self.abort())
                raise
            self._expected.append(sink)

    async def finish(self) -> None:
        failed: BaseException | None = None
        for sink in self._expected:
            if failed is not None:
                await asyncio.shield(sink.abort())
                continue
            try:
                await sink.finish()
            except BaseException as exc:  # noqa: BLE001 -- raised below, once every sink has ended
                failed = exc
        if failed is not None:
            raise failed

    async def abort(self) -> None:
        for sink in self._expected:
            await sink.abort()
