"""Chunked pipeline parallel prefill across processes: a group's stages linked by the Messenger.

The first stage (the prefill instance the Conductor talks to) runs the scheduler and its own
layers, then hands each step on through its ``StageLink`` (its ``ModelRunner.downstream``): the
hidden states and residual are written into the next stage's registered receive buffer, and a
``StageStepCall`` carries the ``StageStep``. The receiver copies them out before it answers,
so the buffer is free for the step after. A ``StageWorker`` runs its layers on each step in
order on its own thread and hands the result on the same way; the last stage writes the sampled
rows' logits into the first stage's buffer with a ``StageLogits`` call. The first stage waits
only for steps that sample, so chunk k+1 computes on the first stage while chunk k is on the
second. Every call between stages is a message of ``cluster/protocol/``.

Each stage streams its own layers of a prompt's KV to the decode instance (its ``KVSender``);
the first stage's prefill expects and finishes the later stages' streams as one of its sinks
(``StageStreams``). With the KVCache pool, each later stage reads and writes its own layers of
the objects the first stage leases and reserves (``cluster.cpp.pool_share.StagePool``, driven
through the link's ``pool_*`` calls by ``cluster.cpp.pool_stages.LaterStages``). How the stages
are started, found and watched: ``cluster.cpp.group``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from cluster.kv_stream import KVDestination, KVSender, PrefillSink
from cluster.cpp.pool_share import StagePool
from cluster.messenger import RegionHandle, Messenger, TransferError
from cluster.messenger.wire import Status
from cluster.protocol import (
    BadRequest, StageExpect, StageFinish, StageFinishReply, StageLogits, StagePing, StagePoolLoad, StagePoolLoadReply,
    StagePoolStore, StagePoolStoreEnd, StagePoolStoreEndReply, StagePoolStoreReply, StagePoolUnload, StageStepCall,
    TensorSlot)
from engine.config import parse_dtype
from engine.hooks import sinks_on_layer
from engine.model_runner import ModelRunner, StageStep

log = logging.getLogger(__name__)

Call = StageExpect | StageFinish | StagePoolLoad | StagePoolStore | StagePoolStoreEnd  # the first stage's calls
R = TypeVar("R", StageFinishReply, StagePoolLoadReply, StagePoolStoreReply, StagePoolStoreEndReply)


@dataclass(frozen=True)
class StagePeer:
    """Where a stage takes what the stage before it sends: its Messenger and receive buffer."""

    address: str
    region: RegionHandle


@dataclass(frozen=True)
class _Arrived:
    """A step a stage worker runs, with the hidden states and residual it arrived with."""

    step: StageStep
    hidden: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _Unload:
    """A pool load a stage worker lets go of, queued behind the steps sent before it."""

    request_id: str


class _Mailbox:
    """One stage end's registered buffers: what arrives, and what it sends from."""

    def __init__(self, transfer: Messenger, nbytes: int, timeout_s: float) -> None:
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.inbox = transfer.alloc_shared(nbytes)
        self.inbox_handle = transfer.register(self.inbox)
        self.outbox = transfer.alloc_shared(nbytes)
        self.outbox_handle = transfer.register(self.outbox)
        self._lock = threading.Lock()  # one message out at a time: the outbox is reused

    @property
    def peer(self) -> StagePeer:
        return StagePeer(self.transfer.address, self.inbox_handle)

    def post(self, to: StagePeer, message: StageStepCall | StageLogits, tensors: list[torch.Tensor]) -> None:
        """Write ``tensors`` into ``to``'s inbox, then send ``message`` with their slots: the
        peer has copied them out once it answers. Raises ``TransferError``."""
        with self._lock:
            slots, offset = [], 0
            for t in tensors:
                raw = t.detach().contiguous().view(-1).view(torch.uint8)
                if offset + raw.numel() > self.outbox.numel():
                    raise TransferError(f"a step of {offset + raw.numel()} bytes does not fit the stage buffers")
                self.outbox[offset : offset + raw.numel()].copy_(raw.cpu())
                slots.append(TensorSlot(list(t.shape), str(t.dtype).removeprefix("torch."), offset))
                offset += raw.numel()
            if offset:
                self.transfer.write_sync(to.address, [(self.outbox_handle, 0, to.region, 0, offset)],
                                         timeout=self.timeout_s)
            status, answer = self.transfer.call(to.address, dataclasses.replace(message, tensors=slots).to_dict())
            if status != Status.OK:
                raise TransferError(f"stage {to.address} refused {message.OP}: {answer.get('reason', status)}")

    def take(self, slots: list[TensorSlot]) -> list[torch.Tensor]:
        """The tensors a ``post`` wrote into this inbox, copied out."""
        out = []
        for slot in slots:
            dtype = parse_dtype(slot.dtype)
            count = 1
            for n in slot.shape:
                count *= n
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            start = slot.offset
            if start < 0 or start + nbytes > self.inbox.numel():
                raise ValueError("a tensor outside the stage buffer")
            out.append(self.inbox[start : start + nbytes].view(dtype).view(slot.shape).clone())
        return out


class StageLink:
    """The first stage's end (an ``engine.model_runner.StageDownstream``): sends each step to
    ``next`` (set before the first step) and takes the last stage's logits."""

    def __init__(self, transfer: Messenger, nbytes: int, timeout_s: float = 30.0) -> None:
        self._box = _Mailbox(transfer, nbytes, timeout_s)
        self._transfer = transfer
        self._timeout_s = timeout_s
        self.next: StagePeer | None = None
        self.followers: list[StagePeer] = []  # every stage after this one, for the KV streams
        self._waiting: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._failed: str | None = None
        transfer.serve(self._on_logits, (StageLogits.OP,))
        transfer.serve(_pong, (StagePing.OP,))  # the later stages' liveness checks

    @property
    def peer(self) -> StagePeer:
        """Where the last stage sends the logits."""
        return self._box.peer

    def send(self, step: StageStep, hidden: tuple[torch.Tensor, torch.Tensor]) -> Future:
        future: Future = Future()
        with self._lock:
            failed = self._failed
            if step.rows and failed is None:
                self._waiting[step.step_id] = future
        if failed is not None:
            future.set_exception(TransferError(failed))
            return future
        if self.next is None:
            raise RuntimeError("the stage link has no next stage")
        try:
            self._box.post(self.next, StageStepCall(step.to_dict()), list(hidden))
        except TransferError as exc:
            self.fail(f"{self._name(self.next)} did not take step {step.step_id}: {exc}")
            if not future.done():  # a step that does not sample fails too: its chunk is lost
                future.set_exception(TransferError(self._failed))
            return future
        if not step.rows:
            future.set_result(None)
        return future

    def expect(self, request_id: str, dest: KVDestination) -> None:
        """Have every later stage stream its layers of the request's KV to ``dest`` (before the
        request's first step). Raises ``TransferError``."""
        self._ask_followers(StageExpect(request_id, dest.to_dict()))

    def finish(self, request_id: str) -> None:
        """Wait until every later stage's KV writes of the request have landed. Raises
        ``TransferError`` with the first stage's failure."""
        errors = []
        for peer in self.followers:
            try:
                error = self._call(peer, StageFinish(request_id, self._timeout_s), StageFinishReply).error
            except TransferError as exc:
                error = str(exc)
            if error:
                errors.append(f"{self._name(peer)}: {error}")
        if errors:
            raise TransferError("; ".join(errors))

    def pool_load(self, request_id: str, leases: dict) -> list[int]:
        """Have every later stage read and verify its layers of the objects ``leases`` (a
        ``PoolRead.leases`` of this stage's read) names; how many objects, from the first, each
        holds intact. Raises ``TransferError``."""
        return [r.good for r in self._ask_followers(StagePoolLoad(request_id, leases), StagePoolLoadReply)]

    def pool_unload(self, request_id: str) -> None:
        """The later stages let go of the request's load, each once it has run every step sent
        before this (it travels down the pipeline behind them). Not waited for."""
        _unload_at(self._transfer, self.next, request_id)

    def pool_store(self, request_id: str, reservation: dict, first_blocks: list[int]) -> None:
        """Have every later stage write its layers of the objects ``reservation`` (a
        ``PoolWrite.reservation``) as the prompt's last step computes them. Raises
        ``TransferError`` (then end it on every stage with ``pool_store_end``)."""
        for r in self._ask_followers(StagePoolStore(request_id, reservation, first_blocks), StagePoolStoreReply):
            if not r.ok:
                raise TransferError("a later stage has no pool staging free")

    def pool_store_end(self, request_id: str, commit: bool) -> list[list[list[int]] | None]:
        """Once every later stage's writes of the request have settled: per stage, each
        object's checksums of its parts (None: not all written, or a stage is unreachable)."""
        out = []
        for peer in self.followers:
            try:
                out.append(self._call(peer, StagePoolStoreEnd(request_id, commit), StagePoolStoreEndReply).checksums)
            except TransferError:
                out.append(None)
        return out

    def _name(self, peer: StagePeer) -> str:
        """A later stage as the group's watcher names it (``pipeline stage N``), so a request's
        error names the stage that failed whichever of the two saw it first."""
        n = next((i + 1 for i, f in enumerate(self.followers) if f == peer), None)
        return f"pipeline stage {n if n is not None else '?'} ({peer.address})"

    def _call(self, peer: StagePeer, message: Call, reply: type[R] | None = None) -> R | None:
        """``message`` to ``peer``, its answer as ``reply``. Raises ``TransferError`` when the
        peer cannot be reached, refuses, or answers something else."""
        status, answer = self._transfer.call(peer.address, message.to_dict())
        if status != Status.OK:
            raise TransferError(f"{self._name(peer)} refused {message.OP}: {answer.get('reason', status)}")
        try:
            return None if reply is None else reply.from_dict(answer)
        except BadRequest as exc:
            raise TransferError(f"{self._name(peer)} answered {message.OP} wrongly: {exc}") from None

    def _ask_followers(self, message: Call, reply: type[R] | None = None) -> list[R | None]:
        return [self._call(peer, message, reply) for peer in self.followers]

    def fail(self, reason: str) -> None:
        """Every step waiting fails, and so does every later one: a stage is gone."""
        with self._lock:
            self._failed = self._failed or reason
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            future.set_exception(TransferError(reason))

    def _on_logits(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        m = StageLogits.from_dict(request)
        if m.error:
            self.fail(f"stage failed at step {m.step_id}: {m.error}")
            return Status.OK, {}
        (logits,) = self._box.take(m.tensors)
        with self._lock:
            future = self._waiting.pop(m.step_id, None)
        if future is not None:
            future.set_result(logits)
        return Status.OK, {}


class StageStreams(PrefillSink):
    """The later stages' streams of their layers of a prompt's KV to ``dest`` (``StageLink.expect``
    / ``finish``), as one sink of the first stage's prefill (``PrefillSink``). The link's calls
    block on the Messenger: they run off the event loop."""

    def __init__(self, link: StageLink, request_id: str, dest: KVDestination) -> None:
        self._link = link
        self._request_id = request_id
        self._dest = dest

    async def expect(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._link.expect, self._request_id, self._dest)

    async def finish(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._link.finish, self._request_id)

    async def abort(self) -> None:
        try:
            await self.finish()
        except TransferError:
            pass  # the prompt failed anyway; its own error is what the caller reports


class StageWorker:
    """A stage after the first: its layers (``runner``, built with ``EngineConfig.stage``) run on
    each step in the order the steps arrive, on the worker's own thread; the result goes to
    ``next`` or, from the last stage, to ``first`` (both set before the first step)."""

    def __init__(self, runner: ModelRunner, transfer: Messenger, nbytes: int, timeout_s: float = 30.0,
                 sender: KVSender | None = None, pool: StagePool | None = None) -> None:
        """``sender``: streams this stage's layers of each prompt's KV to its decode instance;
        ``pool``: this stage's share of the group's pool loads and stores."""
        if runner.model.first:
            raise ValueError("the first stage is a prefill instance, not a stage worker")
        self.runner = runner
        self.sender = sender
        self.pool = pool
        self._sinks = [s for s in (sender, pool.stores if pool is not None else None) if s is not None]
        self._transfer = transfer
        self._box = _Mailbox(transfer, nbytes, timeout_s)
        self.next: StagePeer | None = None
        self.first: StagePeer | None = None
        self._steps: queue.SimpleQueue[_Arrived | _Unload | None] = queue.SimpleQueue()
        transfer.serve(self._on_step, (StageStepCall.OP,))
        transfer.serve(self._on_kv, (StageExpect.OP, StageFinish.OP))
        transfer.serve(self._on_pool, (StagePoolLoad.OP, StagePoolUnload.OP, StagePoolStore.OP, StagePoolStoreEnd.OP))
        transfer.serve(_pong, (StagePing.OP,))  # the first stage's liveness checks
        self._thread = threading.Thread(target=self._loop, name="stage worker", daemon=True)
        self._thread.start()

    @property
    def peer(self) -> StagePeer:
        return self._box.peer

    def close(self) -> None:
        self._steps.put(None)
        self._thread.join(timeout=10)

    def _on_step(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        m = StageStepCall.from_dict(request)
        x, residual = self._box.take(m.tensors)
        self._steps.put(_Arrived(StageStep.from_dict(m.step), (x, residual)))
        return Status.OK, {}

    def _on_pool(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        pool = self.pool
        if pool is None:
            return Status.UNSUPPORTED, {"reason": "this stage is not in a KVCache pool"}
        op = request["op"]
        if op == StagePoolUnload.OP:
            # Behind every step sent before it.
            self._steps.put(_Unload(StagePoolUnload.from_dict(request).request_id))
            return Status.OK, {}
        if op == StagePoolLoad.OP:
            load = StagePoolLoad.from_dict(request)
            return Status.OK, StagePoolLoadReply(pool.load(load.request_id, load.leases)).to_dict()
        if op == StagePoolStore.OP:
            store = StagePoolStore.from_dict(request)
            ok = pool.plan(store.request_id, store.reservation, store.first_blocks)
            return Status.OK, StagePoolStoreReply(ok).to_dict()
        end = StagePoolStoreEnd.from_dict(request)
        return Status.OK, StagePoolStoreEndReply(pool.end(end.request_id, end.commit)).to_dict()

    def _on_kv(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        if self.sender is None:
            return Status.UNSUPPORTED, {"reason": "this stage streams no KV"}
        if request["op"] == StageExpect.OP:
            expect = StageExpect.from_dict(request)
            self.sender.expect(expect.request_id, KVDestination.from_dict(expect.dest))
            return Status.OK, {}
        finish = StageFinish.from_dict(request)
        try:
            # The Messenger's connection thread: the sender's wait needs a loop of its own.
            asyncio.run(self.sender.finish(finish.request_id, finish.timeout_s))
        except TransferError as exc:
            return Status.OK, StageFinishReply(str(exc) or type(exc).__name__).to_dict()
        return Status.OK, StageFinishReply().to_dict()

    def _unload(self, request_id: str) -> None:
        self.pool.unload(request_id)
        if self.next is not None:
            _unload_at(self._transfer, self.next, request_id)

    def _loop(self) -> None:
        while True:
            item = self._steps.get()
            if item is None:
                return
            if isinstance(item, _Unload):
                self._unload(item.request_id)
                continue
            step = item.step
            try:
                before_layer = None
                if step.loads:
                    if self.pool is None:
                        raise RuntimeError("a step loads KV, but this stage is not in a KVCache pool")
                    before_layer = self.pool.before_layer(step.loads, self.runner.kv_cache)
                on_layer = sinks_on_layer(self._sinks, self.runner.kv_cache, step.chunks)
                out = self.runner.run_stage(step, item.hidden, on_layer, before_layer)
                if self.runner.model.last:
                    if step.rows:
                        self._box.post(self.first, StageLogits(step.step_id), [out])
                else:
                    self._box.post(self.next, StageStepCall(step.to_dict()), list(out))
            except Exception as exc:  # noqa: BLE001 -- told to the first stage, which fails the requests
                log.exception("stage: step %d failed", step.step_id)
                try:
                    self._box.post(self.first, StageLogits(step.step_id, error=f"{type(exc).__name__}: {exc}"), [])
                except TransferError:
                    pass  # the first stage is gone too


def _unload_at(transfer: Messenger, stage: StagePeer, request_id: str) -> None:
    """Tell ``stage`` to let go of the request's pool load once its earlier steps have run."""
    try:
        transfer.notify(stage.address, StagePoolUnload(request_id).to_dict())
    except TransferError:
        pass  # the stage is gone, and its staging with it


def _pong(request: dict, peer_hello: dict) -> tuple[Status, dict]:
    StagePing.from_dict(request)
    return Status.OK, {}
