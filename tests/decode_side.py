"""A decode instance's receiving side in this process, on a tiny model: the engine (decode role),
its ``KVHandoff``, and receive staging registered with a Messenger; optionally a peer Messenger
with send staging, to write into it as a prefill instance would. For the unit tests of
reservations (``Receiver``) and of the KV stream, without processes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from cluster.messenger import Messenger, MessengerConfig
from cluster.messenger.staging import StagingArea
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.disaggregation import KVHandoff
from tests.tiny_models import make_tiny_model


@contextmanager
def tiny_decode_side(workdir: Path, secret: bytes, transport: str, peer: bool = False) -> Iterator[SimpleNamespace]:
    """``client``, ``handoff``, ``staging`` and ``transfer`` (its Messenger); with ``peer``,
    also ``peer`` (a second Messenger), ``send`` (staging on it) and ``layout``."""
    model = make_tiny_model(workdir, "Qwen3ForCausalLM", tie=False, seed=3)
    client = AsyncLLMEngine(EngineConfig(model=str(model), device="cpu", role="decode", kv_cache_gib=0.01,
                                         threads=1, max_num_batched_tokens=64))
    messengers = [Messenger(MessengerConfig(secret=secret, transport=transport)) for _ in range(1 + peer)]

    async def up() -> KVHandoff:
        await client.start()
        assert await asyncio.get_running_loop().run_in_executor(None, client.wait_ready, 120)
        return await client.call(KVHandoff)

    try:
        handoff = asyncio.run(up())
        side = SimpleNamespace(client=client, handoff=handoff, staging=StagingArea(messengers[0], 1 << 22),
                               transfer=messengers[0])
        if peer:
            side.peer, side.send, side.layout = messengers[1], StagingArea(messengers[1], 1 << 22), handoff.layout
        yield side
    finally:
        asyncio.run(client.shutdown())
        for m in messengers:
            m.close()
