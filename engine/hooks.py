"""The one seam through which the cluster hooks into an engine step.

Disaggregation, the KVCache pool, chunked pipeline parallel prefill and prompt scoring all need
something of a step while it runs, layer by layer. ``LLMEngine.step`` stays three calls
(schedule, run, postprocess) because what they need is built here, once per step, by
``StepHooks``:

* **KV sinks** (``KVSink``: the stream to a decode instance, the pool's layer-wise stores) get,
  after each layer, that layer of the prompts they want (``on_layer``);
* **KV loads** (``Sequence.kv_load``: a prefix read from the pool) fill each layer's blocks just
  before that layer computes (``before_layer``); a load that fails marks its sequence failed;
* a **first pipeline stage** hands its prompt chunks and loads on to the stages after it
  (``handed_on``: ``PromptChunk``s and ``StageLoad``s), which run their own sinks and loads on
  their layers.

Invariants: the hooks run on the engine thread, inside ``ModelRunner.run``; once ``on_layer(l)``
returns, layer ``l`` of every block up to each chunk's ``end`` is final; a sequence in
``failed`` after the run produced nothing that may be published (its step output is dropped and
its KV past the failed layer is garbage); ``settle_loads`` closes each load exactly once (a
failed one is closed by the scheduler when its sequence ends).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.kv_layout import unpack_layer

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq
    from engine.sequence import Sequence


@dataclass(frozen=True)
class PromptChunk:
    """Prompt tokens ``[start, end)`` of request ``request_id`` computed in this step (``start``
    past its cached prefix on the first chunk), with the blocks the prompt holds now. Plain data:
    a pipeline's first stage hands its steps' chunks on to the stages after it. ``last``: the
    chunk that completes the prompt."""

    request_id: str
    block_ids: list[int]
    start: int
    end: int
    num_prompt_tokens: int

    @property
    def last(self) -> bool:
        return self.end == self.num_prompt_tokens

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> PromptChunk:
        return cls(str(data["request_id"]), [int(b) for b in data["block_ids"]], int(data["start"]),
                   int(data["end"]), int(data["num_prompt_tokens"]))


@dataclass(frozen=True)
class StageLoad:
    """A KV load of a step (``engine.sequence.PendingKVLoad``) as a later pipeline stage fills it:
    request ``request_id``'s ``block_ids``, in order, the first ``skip`` of them cached already.
    Plain data, like ``PromptChunk``: each stage read its own layers of the load beforehand, and
    needs only which blocks to fill."""

    request_id: str
    block_ids: list[int]
    skip: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> StageLoad:
        return cls(str(data["request_id"]), [int(b) for b in data["block_ids"]], int(data["skip"]))


class KVSink(Protocol):
    """Where a prefill instance's engine sends the KV of the prompts it computes: the stream to a
    decode instance (cluster/kv_stream/), the KVCache pool (cluster/instance/pool_io.py).

    ``layer_done`` runs on the engine thread after each layer of every step in which prompts the
    sink ``wants`` compute a chunk (``chunks``: the step's chunks of those prompts, before any
    output token; a prompt preempted meanwhile starts over from its cached prefix); once it
    returns for layer ``l``, layer ``l`` of every block up to ``chunk.end`` is final. It must not block on the
    transfer (the next layer is waiting).
    """

    def wants(self, request_id: str) -> bool: ...

    def layer_done(self, layer: int, kv_cache: torch.Tensor, chunks: list[PromptChunk]) -> None: ...


def sinks_on_layer(sinks: list[KVSink], kv_cache: torch.Tensor,
                   chunks: list[PromptChunk]) -> Callable[[int], None] | None:
    """A step's ``on_layer``: each sink's ``layer_done`` with the chunks it wants; None when no
    sink wants any (an engine's step, and a later pipeline stage's)."""
    wanted = [(sink, [c for c in chunks if sink.wants(c.request_id)]) for sink in sinks]
    wanted = [(sink, mine) for sink, mine in wanted if mine]
    if not wanted:
        return None

    def send_layer(layer: int) -> None:
        for sink, mine in wanted:
            sink.layer_done(layer, kv_cache, mine)

    return send_layer


class StepHooks:
    """The hooks of one step over ``batch`` (see the module docstring)."""

    def __init__(self, batch: list[ScheduledSeq], sinks: list[KVSink], kv_cache: torch.Tensor,
                 hands_on: bool) -> None:
        self.on_layer: Callable[[int], None] | None = None
        self.before_layer: Callable[[int], None] | None = None
        self.handed_on: tuple[list[PromptChunk], list[StageLoad]] | None = None
        self._kv_cache = kv_cache
        self._loading = [s.seq for s in batch if s.seq.kv_load is not None]
        self._failed: set[Sequence] = set()
        chunks: list[PromptChunk] = []
        if sinks or hands_on:
            # Prompts computing a chunk now (no output token yet): their KV is final layer by
            # layer as the step runs.
            chunks = [PromptChunk(s.seq.request_id, list(s.seq.block_table.block_ids), s.seq.num_computed_tokens,
                                  s.seq.num_computed_tokens + s.num_new_tokens, s.seq.num_prompt_tokens)
                      for s in batch if s.seq.num_output_tokens == 0]
            self.on_layer = sinks_on_layer(sinks, kv_cache, chunks)
        if self._loading:
            self.before_layer = self._load_layer
        if hands_on:
            self.handed_on = (chunks, [StageLoad(seq.request_id, seq.kv_load.block_ids, seq.kv_load.skip)
                                       for seq in self._loading])
        # Whether the step reads or writes anything outside this engine (a sink's stream, a load
        # from the pool, later pipeline stages): then it cannot simply run again after a failure.
        self.reaches_out = bool(self._loading) or hands_on or bool(sinks and chunks)

    def _load_layer(self, i: int) -> None:
        """Layer ``i`` of each load into its blocks, just before layer ``i`` computes. A load
        that fails stops there."""
        for seq in self._loading:
            if seq in self._failed:
                continue
            pending = seq.kv_load
            objects = pending.source.layer(i)
            if objects is None:
                self._failed.add(seq)
                continue
            unpack_layer(self._kv_cache, i, objects, pending.block_ids, pending.skip)

    def settle_loads(self) -> set[Sequence]:
        """After the run: close the loads that arrived whole (used) and answer the sequences
        whose load failed, which the engine ends."""
        for seq in self._loading:
            if seq not in self._failed:
                seq.kv_load.source.close(used=True)
                seq.kv_load = None
        return self._failed
