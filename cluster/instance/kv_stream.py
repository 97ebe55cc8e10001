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
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import torch

from cluster.messenger.staging import StagingArea, StagingRange
from cluster.messenger import Batch, RegionHandle, Messenger, TransferError
from engine.kv_layout import KVLayout, pack
from engine.hooks import PromptChunk


@dataclass(frozen=True)
class KVDestination:
    """Where a decode instance takes a request's prompt KV: its Messenger address, its receive
    staging region, the offset of the range reserved there, and how many leading prompt blocks it
    already holds (only the blocks after those are sent)."""

    address: str
    region: RegionHandle
    offset: int
    skip_blocks: int
    num_blocks: int  # blocks sent

    def to_dict(self) -> dict[str, Any]:
        return {"address": self.address, "region": self.region.to_dict(), "offset": self.offset,
                "skip_blocks": self.skip_blocks, "num_blocks": self.num_blocks}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVDestination:
        try:
            return cls(str(data["address"]), RegionHandle.from_dict(data["region"]), int(data["offset"]),
                       int(data["skip_blocks"]), int(data["num_blocks"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed KV destination: {e}") from None


@dataclass(frozen=True)
class SendReport:
    """A request's KV stream: the bytes sent, and how many of them were still on their way when
    the prompt's last layer had been computed and handed over (what the stream adds to TTFT)."""

    bytes_sent: int
    in_flight_at_end: int


class _Outgoing:
    __slots__ = ("dest", "staging", "batches", "error", "write_by", "sent", "sending", "bytes_sent",
                 "in_flight_at_end")

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
        # expect/finish run on the event loop, layer_done on the engine thread. layer_done holds
        # the lock while it packs and submits, so once finish has popped a request no copy into
        # its staging can still start.
        self._lock = threading.Lock()
        self._out: dict[str, _Outgoing] = {}

    def expect(self, request_id: str, dest: KVDestination) -> None:
        """Stream this request's prompt KV to ``dest`` when it is computed (raises StagingFull)."""
        nbytes = len(self.layers) * self.layout.layer_bytes(dest.num_blocks)
        staging = self.staging.allocate(nbytes) if dest.num_blocks else None
        with self._lock:
            if request_id in self._out:
                if staging is not None:
                    self.staging.release(staging)
                raise ValueError(f"request {request_id!r} is already being streamed")
            self._out[request_id] = _Outgoing(dest, staging)

    def wants(self, request_id: str) -> bool:
        out = self._out.get(request_id)
        return out is not None and out.staging is not None

    def layer_done(self, layer: int, kv_cache: torch.Tensor, chunks: list[PromptChunk]) -> None:
        """Send layer ``layer`` of the blocks each chunk completed (with the blocks before them
        not sent yet: a cached prefix goes with the first chunk), or with the prompt's last
        chunk every block left, the partial last one included."""
        layout = self.layout
        last_layer = layer == len(self.layers) - 1
        with self._lock:
            for chunk in chunks:
                out = self._out.get(chunk.request_id)
                if out is None or out.staging is None or out.error is not None or not (self.per_chunk or chunk.last):
                    continue
                d = out.dest
                now = time.monotonic()
                if layer == 0:
                    # A new step: the chunk before may have ended long ago (the prompt waited
                    # for its turn), which the window does not cover.
                    end = -(-chunk.end // layout.block_size) if chunk.last else chunk.end // layout.block_size
                    out.sending = (out.sent, max(out.sent, end))
                    out.write_by = None
                if out.write_by is not None and now > out.write_by:
                    out.error = f"too late to write: more than {self.write_window_s:g} s after the layer before"
                    continue
                out.write_by = now + self.write_window_s
                first, end = out.sending
                ids = chunk.block_ids
                if end > d.skip_blocks + d.num_blocks or (chunk.last and len(ids) != d.skip_blocks + d.num_blocks):
                    # Checked before any write: a write past the reserved blocks would land in
                    # another request's range.
                    out.error = f"prefill holds {len(ids)} blocks, decode expects {d.skip_blocks} + {d.num_blocks}"
                    continue
                if end > first:
                    self._send(out, kv_cache, ids[first:end], layer, first - d.skip_blocks)
                if last_layer:
                    out.sent = end
                    if chunk.last:
                        out.in_flight_at_end = sum(n for b, n in out.batches if not b.done())

    def _send(self, out: _Outgoing, kv_cache: torch.Tensor, block_ids: list[int], layer: int, at: int) -> None:
        """Pack layer ``layer`` of ``block_ids`` into the request's send staging at block ``at``
        of its wire layout and write it to the same place in the decode instance's range: the
        K pages and the V pages of those blocks, two contiguous ranges."""
        d, n, page = out.dest, len(block_ids), self.layout.page_bytes
        shape = (len(self.layers), *self.layout.shape(d.num_blocks)[1:])
        buf = self.staging.view(out.staging, kv_cache.dtype, shape)
        pack(kv_cache, block_ids, range(layer, layer + 1), buf[layer : layer + 1, :, at : at + n])
        here = out.staging.offset + layer * self.layout.layer_bytes(d.num_blocks)
        there = d.offset + (self.layers.start + layer) * self.layout.layer_bytes(d.num_blocks)
        entries = [(self.staging.handle, here + off, d.region, there + off, n * page)
                   for off in (at * page, (d.num_blocks + at) * page)]
        out.batches.append((self.transfer.write(d.address, entries), 2 * n * page))
        out.bytes_sent += 2 * n * page

    async def finish(self, request_id: str, timeout_s: float) -> SendReport:
        """Wait for every write of the request, then free its staging. Raises ``TransferError``
        if a write failed or the KV was never fully sent (unless nothing was to be sent)."""
        with self._lock:
            out = self._out.pop(request_id, None)
        if out is None:
            return SendReport(0, 0)
        batches = [b for b, _ in out.batches]
        loop = asyncio.get_running_loop()
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
        if out.error is not None:
            raise TransferError(out.error)
        expected = out.dest.num_blocks * self.layout.layer_bytes(1) * len(self.layers)
        if out.staging is not None and out.bytes_sent != expected:
            raise TransferError(f"only {out.bytes_sent} of the prompt's {expected} KV bytes were sent")
        return SendReport(out.bytes_sent, out.in_flight_at_end or 0)


def settle(batches: list[Batch], timeout_s: float) -> None:
    """Block until each batch has completed or failed (at most ``timeout_s`` each): after that
    no transport touches its memory, and the staging under it can be reused."""
    for batch in batches:
        try:
            batch.exception(timeout_s)
        except Exception:  # noqa: BLE001 -- timed out or cancelled: the transport has given up
            pass
