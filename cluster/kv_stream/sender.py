"""Layer-wise KV streaming from a prefill instance to a decode instance (FAST'25 §4.1, Fig. 4).

The decode instance reserves blocks and a range of its receive staging (``KVDestination``); the
prefill instance's engine calls ``KVSender.layer_done`` after each layer of every step that
computes a chunk of the prompt: that layer of the blocks the chunk completed is packed by
``kernels.gather_kv`` into the send staging and handed to the Messenger
(``Messenger.write``), which copies it into the decode instance's range while the next
layer computes. A long prompt's KV thus leaves chunk by chunk as it is computed; only the last
chunk's is still in flight when the prompt is done. The decode instance then unpacks the whole
buffer into its pages with ``kernels.scatter_kv`` (``engine.disaggregation.KVHandoff.admit``).
The wire layout of a request's KV in staging is ``engine.kv_layout.KVLayout``.

A late write cannot corrupt. The reservation's range is opened under a
**generation** (``KVDestination.generation``) that every write names; the decode instance's
Messenger refuses a write whose generation is not the range's current one (``StaleWrite``), so
the bytes of a prefill that kept writing after the reservation was released never land in the
range's next use. And each layer carries a **checksum** (``checksums.py``), which the decode
instance verifies before the blocks are admitted, so anything that did slip in (a write the
owner admitted just before the use ended) refuses the request instead of entering its prefix cache.

``layer_done`` runs on the engine thread and packs and writes outside ``KVSender._lock`` (a write
may have to reconnect to a dead peer, for up to the Messenger's timeout); ``expect`` and
``finish``, on the event loop, only ever hold the lock for a dictionary operation.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import torch

from cluster.failpoints import FAILPOINTS
from cluster.kv_stream.checksums import LAYER_SUM, layer_checksum, layer_seed, sums_bytes
from cluster.kv_stream.destination import KVDestination
from cluster.kv_stream.sink import PrefillSink
from cluster.messenger.staging import StagingArea, StagingRange, when_free
from cluster.messenger import Batch, Messenger, TransferError
from engine.kv_layout import KVLayout, pack
from engine.hooks import PromptChunk


@dataclass(frozen=True)
class SendReport:
    """A request's KV stream: the bytes sent, and how many of them were still on their way when
    the prompt's last layer had been computed and handed over (what the stream adds to TTFT)."""

    bytes_sent: int
    in_flight_at_end: int


class _Outgoing:
    __slots__ = ("batches", "busy", "bytes_sent", "closed", "dest", "error", "idle", "in_flight_at_end", "sending",
                 "sent", "staging", "write_by")

    def __init__(self, dest: KVDestination, staging: StagingRange | None):
        self.dest = dest
        self.staging = staging
        self.write_by: float | None = None  # the next layer's write is refused after this
        self.batches: list[tuple[Batch, int]] = []  # each write and its bytes
        self.error: str | None = None
        self.sent = dest.skip_blocks  # blocks before this went out through every layer
        self.sending = (self.sent, self.sent)  # the blocks this step's chunk sends, layer by layer
        self.bytes_sent = 0
        self.in_flight_at_end: int | None = None  # bytes not yet landed when the last layer was handed over
        # Packs and writes in progress outside the lock; once ``finish`` has popped the request
        # (``closed``), it waits for ``idle`` before it looks at the batches or frees the staging.
        self.busy = 0
        self.closed = False
        self.idle = threading.Event()

    def refused(self) -> bool:
        """Whether the first write was refused already (the reservation is gone: stop early)."""
        if not self.batches:
            return False
        first = self.batches[0][0]
        return first.done() and first.exception() is not None


class KVSender:
    """The prefill side (an ``engine.hooks.KVSink``): requests announced with ``expect``
    are streamed layer by layer; ``finish`` waits for the last write and frees the staging."""

    def __init__(self, transfer: Messenger, staging: StagingArea, layout: KVLayout,
                 write_window_s: float = float("inf"), per_chunk: bool = True, layers: range | None = None) -> None:
        """``write_window_s``: no layer of a request is written later than this after the layer
        before it. The receiver gives up on a request after its own timeout and reuses the range
        some time later; an instance that was frozen (or stalled) while streaming must not write
        the rest into it when it wakes up. (A prompt may wait and compute for long before its
        last chunk, and that step may be long; but one layer of it is not.) ``per_chunk=False``
        sends everything with the last chunk, as this sender did before it streamed chunk by
        chunk: the baseline ``bench.kv_stream`` measures against. ``layers``: the model layers
        this instance's KV cache holds, a pipeline stage's (its local layer ``i`` is layer
        ``layers.start + i`` of ``layout``, the wire layout the decode instance receives); None:
        all of them."""
        self.transfer = transfer
        self.staging = staging
        self.layout = layout
        self.layers = range(layout.num_layers) if layers is None else layers
        self.write_window_s = write_window_s
        self.per_chunk = per_chunk
        # expect/finish run on the event loop, layer_done on the engine thread. The lock guards
        # the table and each request's bookkeeping only: packing and writing happen outside it
        # (a write may block on a reconnect), under the request's ``busy`` count instead, so once
        # finish has popped a request and seen it idle no copy into its staging can still start.
        self._lock = threading.Lock()
        self._out: dict[str, _Outgoing] = {}
        # Where the last finished request's KV went: the target of the ``kv.stale_write`` failpoint.
        self._last_finished: KVDestination | None = None
        self._closing: set[asyncio.Future] = set()  # ``finish``'s waits, held until they end

    def _nbytes(self, dest: KVDestination) -> int:
        kv = len(self.layers) * self.layout.layer_bytes(dest.num_blocks)
        return kv + (sums_bytes(len(self.layers)) if dest.sums else 0)

    def expect(self, request_id: str, dest: KVDestination) -> None:
        """Stream this request's prompt KV to ``dest`` when it is computed (raises StagingFull)."""
        staging = self.staging.allocate(self._nbytes(dest), owner=request_id) if dest.num_blocks else None
        with self._lock:
            taken = request_id in self._out
            if not taken:
                self._out[request_id] = _Outgoing(dest, staging)
        if taken:
            if staging is not None:
                self.staging.release(staging)
            raise ValueError(f"request {request_id!r} is already being streamed")

    def wants(self, request_id: str) -> bool:
        out = self._out.get(request_id)
        return out is not None and out.staging is not None

    def layer_done(self, layer: int, kv_cache: torch.Tensor, chunks: list[PromptChunk]) -> None:
        """Send layer ``layer`` of the blocks each chunk completed (with the blocks before them
        not sent yet: a cached prefix goes with the first chunk), or with the prompt's last
        chunk every block left, the partial last one included."""
        for chunk in chunks:
            with self._lock:
                planned = self._plan(layer, chunk)
                if planned is None:
                    continue
                out, first, end = planned
                out.busy += 1
            try:
                if end > first or (chunk.last and out.dest.sums):
                    self._send(out, kv_cache, chunk.block_ids[first:end], layer, first - out.dest.skip_blocks,
                               with_sum=chunk.last and out.dest.sums)
            except Exception as exc:  # noqa: BLE001 -- the request fails, the engine goes on
                out.error = f"KV write failed: {exc}"
            finally:
                with self._lock:
                    if layer == len(self.layers) - 1:
                        out.sent = end
                        if chunk.last:
                            out.in_flight_at_end = sum(n for b, n in out.batches if not b.done())
                    out.busy -= 1
                    if out.closed and not out.busy:
                        out.idle.set()

    def _plan(self, layer: int, chunk: PromptChunk) -> tuple[_Outgoing, int, int] | None:
        """Under the lock: what of ``chunk`` goes out with this layer, (request, first block,
        end block), or None when nothing does."""
        layout = self.layout
        out = self._out.get(chunk.request_id)
        if out is None or out.staging is None or out.error is not None or not (self.per_chunk or chunk.last):
            return None
        d = out.dest
        now = time.monotonic()
        if layer == 0:
            # A new step: the chunk before may have ended long ago (the prompt waited
            # for its turn), which the window does not cover.
            end = -(-chunk.end // layout.block_size) if chunk.last else chunk.end // layout.block_size
            out.sending = (out.sent, max(out.sent, end))
            out.write_by = None
            if out.refused():
                out.error = f"KV write to {d.address} refused: {out.batches[0][0].exception()}"
                return None
        if out.write_by is not None and now > out.write_by:
            out.error = f"too late to write: more than {self.write_window_s:g} s after the layer before"
            return None
        out.write_by = now + self.write_window_s
        first, end = out.sending
        ids = chunk.block_ids
        if end > d.skip_blocks + d.num_blocks or (chunk.last and len(ids) != d.skip_blocks + d.num_blocks):
            # Checked before any write: a write past the reserved blocks would land in
            # another request's range.
            out.error = f"prefill holds {len(ids)} blocks, decode expects {d.skip_blocks} + {d.num_blocks}"
            return None
        return out, first, end

    def _send(self, out: _Outgoing, kv_cache: torch.Tensor, block_ids: list[int], layer: int, at: int,
              with_sum: bool) -> None:
        """Pack layer ``layer`` of ``block_ids`` into the request's send staging at block ``at``
        of its wire layout and write it to the same place in the decode instance's range: the
        K pages and the V pages of those blocks, two contiguous ranges. ``with_sum``: the layer
        is complete in the send staging now; its checksum goes with it, into the trailer."""
        d, n, page = out.dest, len(block_ids), self.layout.page_bytes
        layer_bytes = self.layout.layer_bytes(d.num_blocks)
        shape = (len(self.layers), *self.layout.shape(d.num_blocks)[1:])
        kv = StagingRange(out.staging.offset, len(self.layers) * layer_bytes)
        buf = self.staging.view(kv, kv_cache.dtype, shape)
        here = out.staging.offset + layer * layer_bytes
        there = d.offset + (self.layers.start + layer) * layer_bytes
        entries = []
        if n:
            pack(kv_cache, block_ids, range(layer, layer + 1), buf[layer : layer + 1, :, at : at + n])
            entries = [(self.staging.handle, here + off, d.region, there + off, n * page)
                       for off in (at * page, (d.num_blocks + at) * page)]
        if with_sum:
            slot = out.staging.offset + kv.nbytes + LAYER_SUM.size * layer
            seed = layer_seed(d.generation, self.layers.start + layer)
            LAYER_SUM.pack_into(memoryview(self.staging.buffer.numpy()), slot, layer_checksum(buf[layer], seed))
            entries.append((self.staging.handle, slot, d.region,
                            d.offset + self.layout.nbytes(d.num_blocks) + LAYER_SUM.size * (self.layers.start + layer),
                            LAYER_SUM.size))
            if n and self._inject(entries, here + at * page):
                out.bytes_sent += 2 * n * page  # as if it had all gone out: the decode side must notice
                return
        batch = self.transfer.write(d.address, entries, generation=d.generation)
        out.batches.append((batch, 2 * n * page))
        out.bytes_sent += 2 * n * page

    def _inject(self, entries: list[tuple], first_byte: int) -> bool:
        """The failpoints of a layer's last write (``cluster.failpoints``), its checksum taken
        already: change ``entries`` or the staged bytes at ``first_byte`` in place; True when the
        layer is not to be written at all (``kv.drop_layer``)."""
        if FAILPOINTS.fire("kv.drop_layer"):
            return True
        if FAILPOINTS.fire("kv.flip_bit"):
            self.staging.buffer.numpy()[first_byte] ^= 1
        if FAILPOINTS.fire("kv.truncate"):
            handle, src, region, dst, nbytes = entries[0]
            entries[0] = (handle, src, region, dst, nbytes // 2)
        stale = self._last_finished
        if stale is not None and stale.generation is not None and FAILPOINTS.fire("kv.stale_write"):
            # This layer's first K page again, into the start of the range the last finished
            # request was given, naming that use of the range: it ended, so it must be refused.
            handle, src, _, _, nbytes = entries[0]
            late = self.transfer.write(stale.address, [(handle, src, stale.region, stale.offset, nbytes)],
                                       generation=stale.generation)
            late.add_done_callback(
                lambda b: FAILPOINTS.note("kv.stale_write", "landed" if b.exception() is None else "refused"))
        return False

    async def finish(self, request_id: str, timeout_s: float) -> SendReport:
        """Wait for every write of the request, then free its staging. Raises ``TransferError``
        if a write failed or the KV was never fully sent (unless nothing was to be sent); a
        write the decode instance refused because the reservation is gone raises ``StaleWrite``.
        Cancelled, it still frees the staging once no write can read it."""
        with self._lock:
            out = self._out.pop(request_id, None)
            if out is not None:
                out.closed = True
                if not out.busy:
                    out.idle.set()
        if out is None:
            return SendReport(0, 0)
        # Popped, the request is this call's alone to free. Its waits and the freeing run as a
        # task of their own under a shield: a cancelled caller (the Conductor hung up) returns at
        # once, and no cancellation, during the wait for a layer being packed or a second one
        # during the writes' settling, can skip the freeing and leave the range held for good.
        closing = asyncio.ensure_future(self._close(out, timeout_s))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        await asyncio.shield(closing)
        if out.error is not None:
            raise TransferError(out.error)
        expected = out.dest.num_blocks * self.layout.layer_bytes(1) * len(self.layers)
        if out.staging is not None and out.bytes_sent != expected:
            raise TransferError(f"only {out.bytes_sent} of the prompt's {expected} KV bytes were sent")
        return SendReport(out.bytes_sent, out.in_flight_at_end or 0)

    async def _close(self, out: _Outgoing, timeout_s: float) -> None:
        """Wait until no layer of ``out`` is being packed and each of its writes has ended (at
        most ``timeout_s``), then free its staging; raises the first write's failure."""
        loop = asyncio.get_running_loop()
        if not out.idle.is_set():
            # A layer of it is being packed or handed to the Messenger on the engine thread (a
            # reconnect takes at most the Messenger's timeout): wait off the event loop.
            await loop.run_in_executor(None, out.idle.wait)
        batches = [b for b, _ in out.batches]
        try:
            # One wait for all (a long prompt's stream is hundreds of writes), off the event loop.
            _, pending = await loop.run_in_executor(None, futures.wait, batches, timeout_s)
            if pending:
                raise TransferError(f"KV write to {out.dest.address} did not complete in {timeout_s} s")
            failed = next((b.exception() for b in batches if b.exception() is not None), None)
            if failed is not None:
                raise failed
        finally:
            if out.staging is not None:
                # A write that timed out may still read the range: wait for the transport to let go.
                await loop.run_in_executor(None, settle, batches, timeout_s)
                self.staging.release(out.staging)
        if out.staging is not None and out.dest.generation is not None:
            self._last_finished = out.dest


class DecodeStream(PrefillSink):
    """A prompt's KV into a decode instance's reservation ``dest`` through ``sender``, as one sink
    of the prompt's prefill (``PrefillSink``). ``timeout_s`` bounds both the wait for send
    staging (``expect``: other prompts' streams free theirs as their writes land) and the wait
    for the last write (``finish``)."""

    def __init__(self, sender: KVSender, request_id: str, dest: KVDestination, timeout_s: float) -> None:
        self._sender = sender
        self._request_id = request_id
        self._dest = dest
        self._timeout_s = timeout_s

    async def expect(self) -> None:
        """Raises ``TimeoutError`` when the send staging stayed full."""
        await when_free(lambda: self._sender.expect(self._request_id, self._dest), self._timeout_s)

    async def finish(self) -> None:
        await self._sender.finish(self._request_id, self._timeout_s)

    async def abort(self) -> None:
        try:
            await self._sender.finish(self._request_id, self._timeout_s)
        except TransferError:
            pass  # the prompt failed anyway; its own error is what the caller reports


def settle(batches: list[Batch], timeout_s: float) -> None:
    """Block until each batch has completed or failed (at most ``timeout_s`` each): after that
    no transport touches its memory, and the staging under it can be reused."""
    for batch in batches:
        try:
            batch.exception(timeout_s)
        except Exception:  # noqa: BLE001 -- timed out or cancelled: the transport has given up
            pass
