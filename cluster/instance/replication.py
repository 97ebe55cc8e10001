"""Hot-spot replication between prefill instances (Mooncake's hot-block replication).

The Conductor copies a hot prefix from the instance that caches it (the *holder*) to the one
Algorithm 1 chose: a reservation on the target (``Receiver.reserve``), ``push`` on the holder
(its cached blocks packed into send staging in one engine-thread call, so nothing can evict them
between lookup and copy, then one Messenger write into the reservation), and ``adopt`` on the
target (the received blocks become cached prefix blocks under their keys). The holder keeps its
copy, so a hot prefix ends up cached on several instances.
"""

from __future__ import annotations

import asyncio

import torch

from cluster.instance.receiver import Receiver
from cluster.kv_stream import KVDestination, layer_checksums, settle, sums_bytes
from cluster.messenger.staging import StagingArea, StagingRange, when_free
from cluster.messenger import Messenger
from cluster.protocol import BadRequest, PrefixNotCached, UnknownReservation
from engine.async_engine import AsyncLLMEngine
from engine.disaggregation import KVHandoff


class Replicator:
    def __init__(self, client: AsyncLLMEngine, handoff: KVHandoff, transfer: Messenger,
                 send: StagingArea | None, receiver: Receiver, transfer_timeout_s: float) -> None:
        self._client = client
        self._handoff = handoff
        self._transfer = transfer
        self._send = send
        self._receiver = receiver
        self._timeout_s = transfer_timeout_s

    async def push(self, request_id: str, token_ids: list[int], dest: KVDestination, salt: str | None = None) -> int:
        """Write the cached prefix blocks (under ``salt``) ``dest`` asks for into it; returns the blocks sent.
        Raises ``PrefixNotCached`` (not all cached here now), ``BadRequest``, ``TransferError`` /
        ``TimeoutError``."""
        if self._send is None:
            raise BadRequest("this instance does not send KV")
        if not dest.num_blocks:
            return 0
        if self._receiver.aborted(request_id):
            raise UnknownReservation(f"request {request_id!r} was aborted")
        layout = self._handoff.layout
        send = self._send
        kv_bytes = layout.nbytes(dest.num_blocks)
        nbytes = kv_bytes + (sums_bytes(layout.num_layers) if dest.sums else 0)
        staging = await when_free(lambda: send.allocate(nbytes, owner=f"push {request_id}"), self._timeout_s)
        batch = None
        exported = False
        try:
            out = self._send.view(StagingRange(staging.offset, kv_bytes), layout.torch_dtype, layout.shape(dest.num_blocks))
            # Bounded like any KV write: the target gives up on the reservation, and later reuses
            # its range, when a push takes too long (the engine thread may be busy with a step).
            try:
                await asyncio.wait_for(self._client.call(
                    lambda _: self._handoff.export_prefix(token_ids, dest.skip_blocks, dest.num_blocks, out, salt)),
                    self._timeout_s)
            except ValueError as e:  # evicted since the Conductor last polled this instance
                raise PrefixNotCached(str(e)) from None
            exported = True
            if dest.sums:  # the checksum of each layer, after the KV (the target verifies them)
                trailer = layer_checksums(out, dest.generation)
                self._send.buffer[staging.offset + kv_bytes : staging.offset + nbytes] = torch.frombuffer(
                    bytearray(trailer), dtype=torch.uint8)
            batch = self._transfer.write(dest.address, [(self._send.handle, staging.offset, dest.region, dest.offset,
                                                         staging.nbytes)], generation=dest.generation)
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(batch)), self._timeout_s)
        finally:
            if batch is not None:  # a timed-out write may still read the staging
                await asyncio.get_running_loop().run_in_executor(None, settle, [batch], self._timeout_s)
            if not exported:
                # An export we stopped waiting for may be packing into the staging right now;
                # the engine thread runs calls in order, so this one returns once it is done.
                await self._client.call(lambda _: None)
            self._send.release(staging)
        return dest.num_blocks

    async def adopt(self, request_id: str, ok: bool) -> int:
        """Keep a reservation's received blocks as cached prefix (``ok``), or drop it; returns
        the blocks now cached under the prompt's keys. Raises ``UnknownReservation``."""
        if request_id not in self._receiver:
            raise UnknownReservation(f"no KV reservation for {request_id!r}")
        if not ok:
            # The push failed, perhaps by timing out: a late write could still land in the staging.
            await self._receiver.release(request_id, settled=False)
            return 0
        return await self._client.call(self._receiver.take_over(lambda h, kv: h.adopt(request_id, kv), request_id))

