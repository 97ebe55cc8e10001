"""Chunked pipeline parallel prefill across processes: a group's stages linked by the Messenger.

The first stage (the prefill instance the Conductor talks to) runs the scheduler and its own
layers, then hands each step on through its ``StageLink`` (its ``ModelRunner.downstream``): the
hidden states and residual are written into the next stage's registered receive buffer, and a
``stage_step`` call carries the ``StageStep``. The receiver copies them out before it answers,
so the buffer is free for the step after. A ``StageWorker`` runs its layers on each step in
order on its own thread and hands the result on the same way; the last stage writes the sampled
rows' logits into the first stage's buffer with a ``stage_logits`` call. The first stage waits
only for steps that sample, so chunk k+1 computes on the first stage while chunk k is on the
second.

With the KVCache pool, each later stage reads and writes its own layers of the objects the
first stage leases and reserves (``cluster.stage_pool.StagePool``, driven through the link's
``pool_*`` calls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from cluster.control_auth import MESSENGER, derive_key
from cluster.kv_stream import KVDestination, KVSender
from cluster.pool.config import model_identity
from cluster.pool.objects import PoolGeometry
from cluster.stage_pool import StagePool
from cluster.staging import StagingArea
from cluster.transfer import RegionHandle, TransferConfig, TransferEngine, TransferError
from cluster.transfer.protocol import Status
from engine.config import EngineConfig, ModelConfig, parse_dtype
from engine.cpu_runtime import configure_cpu_runtime
from engine.default_model import resolve_model
from engine.kv_layout import KVLayout
from engine.llm_engine import PromptChunk
from engine.model_runner import ModelRunner, StageStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagePeer:
    """Where a stage takes what the stage before it sends: its Messenger and receive buffer."""

    address: str
    region: RegionHandle


class _Mailbox:
    """One stage end's registered buffers: what arrives, and what it sends from."""

    def __init__(self, transfer: TransferEngine, nbytes: int, timeout_s: float) -> None:
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

    def post(self, to: StagePeer, body: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Write ``tensors`` into ``to``'s inbox, then make the call ``body`` (with their
        layout): the peer has copied them out once it answers. Raises ``TransferError``."""
        with self._lock:
            layout, offset = [], 0
            for t in tensors:
                raw = t.detach().contiguous().view(-1).view(torch.uint8)
                if offset + raw.numel() > self.outbox.numel():
                    raise TransferError(f"a step of {offset + raw.numel()} bytes does not fit the stage buffers")
                self.outbox[offset : offset + raw.numel()].copy_(raw.cpu())
                layout.append({"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "offset": offset})
                offset += raw.numel()
            if offset:
                self.transfer.write_sync(to.address, [(self.outbox_handle, 0, to.region, 0, offset)],
                                         timeout=self.timeout_s)
            status, answer = self.transfer.call(to.address, {**body, "tensors": layout})
            if status != Status.OK:
                raise TransferError(f"stage {to.address} refused {body['op']}: {answer.get('reason', status)}")

    def take(self, layout: list[dict[str, Any]]) -> list[torch.Tensor]:
        """The tensors a ``post`` wrote into this inbox, copied out."""
        out = []
        for d in layout:
            dtype = parse_dtype(str(d["dtype"]))
            shape = [int(n) for n in d["shape"]]
            count = 1
            for n in shape:
                count *= n
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            start = int(d["offset"])
            if start < 0 or start + nbytes > self.inbox.numel():
                raise ValueError("a tensor outside the stage buffer")
            out.append(self.inbox[start : start + nbytes].view(dtype).view(shape).clone())
        return out


class StageLink:
    """The first stage's end (an ``engine.model_runner.StageDownstream``): sends each step to
    ``next`` (set before the first step) and takes the last stage's logits."""

    def __init__(self, transfer: TransferEngine, nbytes: int, timeout_s: float = 30.0) -> None:
        self._box = _Mailbox(transfer, nbytes, timeout_s)
        self._transfer = transfer
        self._timeout_s = timeout_s
        self.next: StagePeer | None = None
        self.followers: list[StagePeer] = []  # every stage after this one, for the KV streams
        self._waiting: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._failed: str | None = None
        transfer.serve(self._on_logits, ("stage_logits",))

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
            self._box.post(self.next, {"op": "stage_step", "step": step.to_dict()}, list(hidden))
        except TransferError as exc:
            self.fail(f"the next stage did not take step {step.step_id}: {exc}")
            if not future.done():  # a step that does not sample fails too: its chunk is lost
                future.set_exception(TransferError(self._failed))
            return future
        if not step.rows:
            future.set_result(None)
        return future

    def expect(self, request_id: str, dest: KVDestination) -> None:
        """Have every later stage stream its layers of the request's KV to ``dest`` (before the
        request's first step). Raises ``TransferError``."""
        for peer in self.followers:
            status, answer = self._transfer.call(peer.address, {"op": "stage_expect", "request_id": request_id,
                                                                "dest": dest.to_dict()})
            if status != Status.OK:
                raise TransferError(f"stage {peer.address} cannot stream {request_id}: {answer.get('reason')}")

    def finish(self, request_id: str) -> None:
        """Wait until every later stage's KV writes of the request have landed. Raises
        ``TransferError`` with the first stage's failure."""
        errors = []
        for peer in self.followers:
            status, answer = self._transfer.call(peer.address, {"op": "stage_finish", "request_id": request_id,
                                                                "timeout_s": self._timeout_s})
            if status != Status.OK or answer.get("error"):
                errors.append(f"{peer.address}: {answer.get('error') or answer.get('reason') or status}")
        if errors:
            raise TransferError("; ".join(errors))

    def pool_load(self, request_id: str, leases: dict) -> list[int]:
        """Have every later stage read and verify its layers of the objects ``leases`` (a
        ``PoolRead.leases`` of this stage's read) names; how many objects, from the first, each
        holds intact. Raises ``TransferError``."""
        return [int(answer["good"]) for answer in self._ask_followers(
            {"op": "stage_pool_load", "request_id": request_id, "leases": leases})]

    def pool_unload(self, request_id: str) -> None:
        """The later stages let go of the request's load, each once it has run every step sent
        before this (it travels down the pipeline behind them). Not waited for."""
        try:
            self._transfer.notify(self.next.address, {"op": "stage_pool_unload", "request_id": request_id})
        except TransferError:
            pass  # the stage is gone, and its staging with it

    def pool_store(self, request_id: str, reservation: dict, first_blocks: list[int]) -> None:
        """Have every later stage write its layers of the objects ``reservation`` (a
        ``PoolWrite.reservation``) as the prompt's last step computes them. Raises
        ``TransferError`` (then end it on every stage with ``pool_store_end``)."""
        for answer in self._ask_followers({"op": "stage_pool_store", "request_id": request_id,
                                           "reservation": reservation, "first_blocks": first_blocks}):
            if not answer.get("ok"):
                raise TransferError("a later stage has no pool staging free")

    def pool_store_end(self, request_id: str, commit: bool) -> list[list[list[int]] | None]:
        """Once every later stage's writes of the request have settled: per stage, each
        object's checksums of its parts (None: not all written, or a stage is unreachable)."""
        out = []
        for peer in self.followers:
            try:
                status, answer = self._transfer.call(peer.address, {"op": "stage_pool_store_end",
                                                                    "request_id": request_id, "commit": commit})
            except TransferError:
                status, answer = Status.INTERNAL, {}
            out.append(answer.get("checksums") if status == Status.OK else None)
        return out

    def _ask_followers(self, body: dict) -> list[dict]:
        answers = []
        for peer in self.followers:
            status, answer = self._transfer.call(peer.address, body)
            if status != Status.OK:
                raise TransferError(f"stage {peer.address} refused {body['op']}: {answer.get('reason', status)}")
            answers.append(answer)
        return answers

    def fail(self, reason: str) -> None:
        """Every step waiting fails, and so does every later one: a stage is gone."""
        with self._lock:
            self._failed = self._failed or reason
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            future.set_exception(TransferError(reason))

    def _on_logits(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        step_id = int(request["step_id"])
        if request.get("error"):
            self.fail(f"stage failed at step {step_id}: {request['error']}")
            return Status.OK, {}
        (logits,) = self._box.take(request["tensors"])
        with self._lock:
            future = self._waiting.pop(step_id, None)
        if future is not None:
            future.set_result(logits)
        return Status.OK, {}


class StageWorker:
    """A stage after the first: its layers (``runner``, built with ``EngineConfig.stage``) run on
    each step in the order the steps arrive, on the worker's own thread; the result goes to
    ``next`` or, from the last stage, to ``first`` (both set before the first step)."""

    def __init__(self, runner: ModelRunner, transfer: TransferEngine, nbytes: int, timeout_s: float = 30.0,
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
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        transfer.serve(self._on_step, ("stage_step",))
        transfer.serve(self._on_kv, ("stage_expect", "stage_finish"))
        transfer.serve(self._on_pool, ("stage_pool_load", "stage_pool_unload", "stage_pool_store",
                                       "stage_pool_store_end"))
        self._thread = threading.Thread(target=self._loop, name="stage worker", daemon=True)
        self._thread.start()

    @property
    def peer(self) -> StagePeer:
        return self._box.peer

    def close(self) -> None:
        self._steps.put(None)
        self._thread.join(timeout=10)

    def _on_step(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        step = StageStep.from_dict(request["step"])
        x, residual = self._box.take(request["tensors"])
        self._steps.put((step, (x, residual)))
        return Status.OK, {}

    def _on_pool(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        pool = self.pool
        if pool is None:
            return Status.UNSUPPORTED, {"reason": "this stage is not in a KVCache pool"}
        op, request_id = request["op"], str(request["request_id"])
        if op == "stage_pool_unload":
            self._steps.put(("unload", request_id))  # behind every step sent before it
            return Status.OK, {}
        if op == "stage_pool_load":
            return Status.OK, {"good": pool.load(request_id, request["leases"])}
        if op == "stage_pool_store":
            return Status.OK, {"ok": pool.plan(request_id, request["reservation"], request["first_blocks"])}
        return Status.OK, {"checksums": pool.end(request_id, bool(request["commit"]))}

    def _on_kv(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        if self.sender is None:
            return Status.UNSUPPORTED, {"reason": "this stage streams no KV"}
        request_id = str(request["request_id"])
        if request["op"] == "stage_expect":
            self.sender.expect(request_id, KVDestination.from_dict(request["dest"]))
            return Status.OK, {}
        try:
            # The Messenger's connection thread: the sender's wait needs a loop of its own.
            asyncio.run(self.sender.finish(request_id, float(request["timeout_s"])))
        except TransferError as exc:
            return Status.OK, {"error": str(exc)}
        return Status.OK, {}

    def _on_layer(self, step: StageStep) -> Callable[[int], None] | None:
        chunks = [PromptChunk.from_dict(c) for c in step.chunks] if self._sinks else []
        wanted = [(sink, [c for c in chunks if sink.wants(c.request_id)]) for sink in self._sinks]
        wanted = [(sink, mine) for sink, mine in wanted if mine]
        if not wanted:
            return None
        kv_cache = self.runner.kv_cache

        def send_layer(layer: int) -> None:
            for sink, mine in wanted:
                sink.layer_done(layer, kv_cache, mine)

        return send_layer

    def _unload(self, request_id: str) -> None:
        self.pool.unload(request_id)
        if self.next is not None:
            try:
                self._transfer.notify(self.next.address, {"op": "stage_pool_unload", "request_id": request_id})
            except TransferError:
                pass  # the next stage is gone, and its staging with it

    def _loop(self) -> None:
        while True:
            item = self._steps.get()
            if item is None:
                return
            step, hidden = item
            if step == "unload":
                self._unload(hidden)
                continue
            try:
                before_layer = None
                if step.loads:
                    if self.pool is None:
                        raise RuntimeError("a step loads KV, but this stage is not in a KVCache pool")
                    before_layer = self.pool.before_layer(step.loads, self.runner.kv_cache)
                out = self.runner.run_stage(step, hidden, self._on_layer(step), before_layer)
                if self.runner.model.last:
                    if step.rows:
                        self._box.post(self.first, {"op": "stage_logits", "step_id": step.step_id}, [out])
                else:
                    self._box.post(self.next, {"op": "stage_step", "step": step.to_dict()}, list(out))
            except Exception as exc:  # noqa: BLE001 -- told to the first stage, which fails the requests
                log.exception("stage: step %d failed", step.step_id)
                try:
                    self._box.post(self.first, {"op": "stage_logits", "step_id": step.step_id,
                                                "error": f"{type(exc).__name__}: {exc}"}, [])
                except TransferError:
                    pass  # the first stage is gone too


class StageGroup:
    """The later stages of a first-stage prefill instance, as its child processes (``python -m
    cluster.stage``), chained: the instance's ``link`` sends to the second stage, each to the
    next, the last back to the instance. A stage exits when the instance closes its stdin."""

    def __init__(self, engine: EngineConfig, transfer: TransferEngine, secret: bytes, host: str, buffer_bytes: int,
                 staging_bytes: int, timeout_s: float, on_death: Callable[[str], None], startup_s: float = 300.0,
                 pool: tuple[int, int] | None = None) -> None:
        """``on_death(reason)`` runs (on a watcher thread) when a stage process ends by itself:
        the group cannot compute any more. ``pool``: the group is in a KVCache pool, with
        objects of this many engine blocks, and each stage has this much pool staging."""
        assert engine.stage is not None and engine.stage[0] == 0
        stages = engine.stage[1]
        self.processes: list[subprocess.Popen] = []
        self._closing = threading.Event()
        peers: list[StagePeer] = []
        try:
            for i in range(1, stages):
                fields = {**asdict(engine), "stage": [i, stages]}
                proc = subprocess.Popen(
                    [sys.executable, "-m", "cluster.stage", "--engine", json.dumps(fields), "--host", host,
                     "--buffer-bytes", str(buffer_bytes), "--staging-bytes", str(staging_bytes),
                     "--timeout-s", str(timeout_s)]
                    + ([] if pool is None else ["--pool-blocks-per-object", str(pool[0]),
                                                "--pool-staging-bytes", str(pool[1])]),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env={**os.environ, "MOONCAKE_CLUSTER_SECRET": secret.decode()})
                self.processes.append(proc)
                # A stage loading its weights takes a while; one that dies says so by EOF.
                timer = threading.Timer(startup_s, proc.kill)
                timer.start()
                try:
                    line = proc.stdout.readline()
                finally:
                    timer.cancel()
                if not line.startswith("stage ready "):
                    raise RuntimeError(f"pipeline stage {i} of {stages} did not start (exit {proc.poll()})")
                peers.append(_peer(json.loads(line[len("stage ready "):])))
            self.link = StageLink(transfer, buffer_bytes, timeout_s)
            self.link.next, self.link.followers = peers[0], peers
            for i, proc in enumerate(self.processes):
                after = peers[i + 1] if i + 1 < len(peers) else None
                proc.stdin.write(json.dumps({"next": _peer_dict(after), "first": _peer_dict(self.link.peer)}) + "\n")
                proc.stdin.flush()
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, args=(on_death,), name="stage watcher", daemon=True).start()

    def _watch(self, on_death: Callable[[str], None]) -> None:
        while not self._closing.wait(0.5):
            for i, proc in enumerate(self.processes):
                if proc.poll() is not None:
                    reason = f"pipeline stage {i + 1} exited with {proc.returncode}"
                    self.link.fail(reason)
                    on_death(reason)
                    return

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes)

    def close(self) -> None:
        self._closing.set()
        for proc in self.processes:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.processes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def wire_layout(runner: ModelRunner) -> KVLayout:
    """The layout a decode instance receives: every layer of the model, not only this stage's."""
    return replace(KVLayout.of_cache(runner.kv_cache), num_layers=runner.model_config.num_layers)


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.stage``: one later stage of a prefill instance's pipeline, started by
    that instance. Prints ``stage ready {peer}``, takes ``{"next": peer | null, "first": peer}``
    as one line on stdin, then serves until stdin closes (the instance stopped or died)."""
    parser = argparse.ArgumentParser(prog="python -m cluster.stage", description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, help="the stage's EngineConfig as JSON (with its stage)")
    parser.add_argument("--host", default="127.0.0.1", help="where its Messenger listens")
    parser.add_argument("--buffer-bytes", type=int, required=True, help="inbox and outbox size")
    parser.add_argument("--staging-bytes", type=int, required=True, help="KV send staging size")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--pool-blocks-per-object", type=int, default=None,
                        help="the group is in a KVCache pool with objects of this many engine blocks")
    parser.add_argument("--pool-staging-bytes", type=int, default=0, help="pool load and store staging size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s stage: %(message)s")
    secret = os.environ.get("MOONCAKE_CLUSTER_SECRET", "").encode()
    fields = json.loads(args.engine)
    fields["stage"] = tuple(fields["stage"])
    config = EngineConfig(**fields)
    if config.device == "cpu":
        configure_cpu_runtime(config.threads)
    path = resolve_model(config.model)
    max_len = config.max_model_len or ModelConfig.from_folder(path).max_position_embeddings
    runner = ModelRunner(config, path, max_len)
    transfer = TransferEngine(TransferConfig(secret=derive_key(secret, MESSENGER), host=args.host,
                                             timeout_s=args.timeout_s))
    sender = KVSender(transfer, StagingArea(transfer, args.staging_bytes), wire_layout(runner),
                      write_window_s=args.timeout_s, layers=runner.model.layer_range)
    pool = None
    if args.pool_blocks_per_object is not None:
        geometry = PoolGeometry(wire_layout(runner), args.pool_blocks_per_object, model_identity(str(path)))
        pool = StagePool(transfer, StagingArea(transfer, args.pool_staging_bytes), geometry,
                         runner.model.layer_range, args.timeout_s)
    worker = StageWorker(runner, transfer, args.buffer_bytes, args.timeout_s, sender, pool)
    print("stage ready " + json.dumps(_peer_dict(worker.peer)), flush=True)
    try:
        links = json.loads(sys.stdin.readline() or "null")
        if links is None:
            return 0
        worker.next = _peer(links.get("next"))
        worker.first = _peer(links["first"])
        sys.stdin.read()  # until the instance closes the pipe
    finally:
        worker.close()
        transfer.close()
    return 0


def _peer_dict(peer: StagePeer | None) -> dict | None:
    return None if peer is None else {"address": peer.address, "region": peer.region.to_dict()}


def _peer(data: dict | None) -> StagePeer | None:
    return None if data is None else StagePeer(str(data["address"]), RegionHandle.from_dict(data["region"]))


if __name__ == "__main__":
    raise SystemExit(main())
