"""``AsyncLLMEngine``: the local ``EngineClient``, one ``LLMEngine`` driven by one thread.

``LLMEngine`` is not thread-safe, so exactly one background thread (the *engine thread*)
creates it (loading the model after the HTTP socket is already listening), and then runs the
step loop. Everything else crosses over through two channels:

* **in**: ``add`` / ``abort`` commands appended to ``_inbox`` under ``_cond``; the engine thread
  drains the inbox between steps, and sleeps on ``_cond`` when it has nothing to do (no spin);
* **out**: after each step the engine thread hands every request's output to the asyncio loop
  that asked for it, with one ``loop.call_soon_threadsafe`` per loop per step, which puts the
  outputs into per-request ``asyncio.Queue``\\ s read by ``generate``.

Failures never leave a stream hanging: a rejected ``add_request`` (``ValueError``) and an
exception in ``step()`` are delivered into the affected requests' queues and raised by their
``generate`` iterators; after a failed step every live request is aborted so its KV is freed.

An abort can overtake its request (the caller gave up while the request was still on its way,
or waiting for something before it entered the engine): an abort of an id the engine does not
hold is remembered for ``ABORT_MEMORY_S``, and a request that arrives with that id is answered
at once as aborted, without computing anything.

Overload control: requests that have not produced their first output yet (in the inbox, the
engine's waiting queue, or mid-prefill) are counted; past ``max_waiting`` new requests are
refused with ``EngineOverloaded`` (HTTP 429) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.core_share import CoreShare
from engine.cpu_runtime import return_freed_memory, set_threads
from engine.default_model import default_model_name
from engine.disaggregation import KVCapacityError
from engine.llm_engine import LLMEngine, StepFailed
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.session import SessionHint
from engine.tokenizer import Tokenizer
from engine.engine_client import EngineClient, EngineError, EngineNotReady, EngineOverloaded, NotStarted, RequestFailed

log = logging.getLogger(__name__)

T = TypeVar("T")

ABORT_MEMORY_S = 60.0  # how long an abort that overtook its request is remembered
MAX_EARLY_ABORTS = 65536  # and how many at most
# Idle this long after a step, the engine thread returns the heap's free pages to the OS
# (``engine.cpu_runtime.return_freed_memory``): a burst's high-water mark does not stay resident,
# and steady traffic, which never idles this long, keeps its warm heap.
IDLE_TRIM_S = 2.0


class _Request:
    """One request as both threads see it: the loop and queue its outputs go to."""

    __slots__ = ("request_id", "loop", "queue", "counted")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.counted = False  # still counted as waiting (no output yet)


def _deliver(items: list[tuple[_Request, RequestOutput | BaseException]]) -> None:
    # Runs on the request's event loop.
    for req, item in items:
        req.queue.put_nowait(item)


def _not_the_engines_fault(e: Exception) -> bool:
    """A request that cannot start for a reason of its own or of the moment: a reservation that
    lapsed (a ``LookupError`` its owner raised; a bare ``KeyError`` / ``IndexError`` is a bug),
    KV that arrived corrupt (``NotStarted``), or no room for its KV now. Its caller tells the
    client so, and may place it elsewhere; wrapped as an ``EngineError`` it would read as a failed
    instance."""
    if isinstance(e, (KVCapacityError, NotStarted)):
        return True
    return isinstance(e, LookupError) and not isinstance(e, (KeyError, IndexError))


class AsyncLLMEngine(EngineClient):
    def __init__(
        self,
        config: EngineConfig | None = None,
        served_model_name: str | None = None,
        max_waiting: int = 256,
    ):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.config = config or EngineConfig()
        self._model_name = served_model_name or default_model_name(self.config.model)
        self.max_waiting = max_waiting
        self._engine: LLMEngine | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._inbox: deque[tuple] = deque()  # guarded by _cond
        self._stopping = False
        self._ready = threading.Event()
        self._done = threading.Event()  # the engine thread has exited
        self._load_error: str | None = None
        self._count_lock = threading.Lock()
        self._num_unstarted = 0
        self._stats: dict[str, Any] = {}
        self._max_running_seen = 0
        self._max_batch_seen = 0
        self._num_steps = 0
        # Steps that computed no prompt token (decodes only): their count, seconds, sequences and
        # KV tokens, summed. What a decode step costs live, beside other processes on the same
        # cores, which the Conductor sets against the model calibrated on an idle one.
        self._decode_steps = [0, 0.0, 0, 0]
        self._num_step_errors = 0
        self._num_requests_failed = 0  # ended alone by a step that failed because of them
        self._early_aborts: OrderedDict[str, float] = OrderedDict()  # engine thread only
        self._observers: list[Callable[[LLMEngine], None]] = []
        self._share: CoreShare | None = None  # engine thread only, as is _threads
        self._threads = self.config.threads
        self._last_step_s = 0.0  # engine thread only: how long the previous step took

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._done.wait, 60.0)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block (a plain thread, not the event loop) until loaded or failed; True if ready."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set() and not self._done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._ready.wait(0.1 if left is None else min(0.1, left))
        return self._ready.is_set()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and not self._done.is_set()

    @property
    def load_error(self) -> str | None:
        return self._load_error

    # -- model facts -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._model_name

    def _loaded(self) -> LLMEngine:
        if not self._ready.is_set() or self._engine is None:
            raise EngineNotReady(self._load_error or "the model is still loading")
        return self._engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self._loaded().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._loaded().max_model_len

    @property
    def vocab_size(self) -> int:
        return self._loaded().model_config.vocab_size

    # -- requests (event-loop side) ----------------------------------------------------------------
    def _submit(self, command: tuple) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    def _uncount(self, req: _Request) -> None:
        if req.counted:
            req.counted = False
            with self._count_lock:
                self._num_unstarted -= 1

    def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, session: SessionHint | None = None
    ) -> AsyncIterator[RequestOutput]:
        return self.stream(request_id, lambda e: e.add_request(prompt, params, request_id=request_id, session=session))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result (or
        raise its exception). The way to touch the engine from outside, e.g. to reserve KV."""
        if not self.is_ready:
            raise EngineNotReady(self._load_error or "the model is still loading")
        if self._stopping:
            raise EngineError("the server is shutting down")
        future: Future = Future()
        self._submit(("call", fn, future))
        return await asyncio.wrap_future(future)

    async def stream(
        self, request_id: str, start: Callable[[LLMEngine], Any]
    ) -> AsyncIterator[RequestOutput]:
        """Like ``generate``, for a request that enters the engine through ``start(engine)``
        (run on the engine thread): ``add_request``, or ``KVHandoff.admit`` on a decode instance."""
        if not self.is_ready:
            if self._done.is_set() and self._ready.is_set():
                raise EngineError("the engine has stopped")
            raise EngineNotReady(self._load_error or "the model is still loading")
        if self._stopping:
            raise EngineError("the server is shutting down")
        req = _Request(request_id, asyncio.get_running_loop())
        with self._count_lock:
            if self._num_unstarted >= self.max_waiting:
                raise EngineOverloaded(
                    f"too many waiting requests ({self._num_unstarted}, limit {self.max_waiting})"
                )
            self._num_unstarted += 1
            req.counted = True
        finished = False
        try:
            self._submit(("add", req, start))
            while True:
                item = await req.queue.get()
                self._uncount(req)
                if isinstance(item, BaseException):
                    finished = True  # the engine thread has already dropped it
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._uncount(req)
            if not finished:
                # Consumer left early (disconnect, cancellation, error): free the KV.
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def add_step_observer(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run ``fn(engine)`` on the engine thread after every step (and after commands are
        handled): the way to publish a snapshot that readers use without waiting for the engine
        thread. ``fn`` must be quick and must not raise (an exception is logged and dropped)."""
        self._observers.append(fn)

    def stats(self) -> dict[str, Any]:
        stats = dict(self._stats)
        stats["ready"] = self.is_ready
        stats["max_waiting"] = self.max_waiting
        with self._count_lock:
            stats["num_unstarted"] = self._num_unstarted
        return stats

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            try:
                engine = LLMEngine(self.config)
            except BaseException as e:  # noqa: BLE001 -- reported through /health, never raised
                self._load_error = f"model failed to load: {type(e).__name__}: {e}"
                log.exception("model failed to load")
                return
            if self.config.core_share is not None:
                try:
                    self._share = CoreShare(self.config.core_share, self.config.core_slot)
                except (OSError, ValueError) as e:
                    self._load_error = f"core share: {e}"
                    log.error("%s", self._load_error)
                    return
            self._engine = engine
            log.info("ready: serving %r", self._model_name)  # the engine logged its KV cache
            self._publish_stats(engine)
            self._ready.set()
            self._loop(engine)
        finally:
            if self._share is not None:
                self._share.close()  # its cores go back to the others at once
            self._done.set()

    def _loop(self, engine: LLMEngine) -> None:
        live: dict[str, _Request] = {}
        stepped = False  # a step ran since the heap was last trimmed
        while True:
            idle = False
            if self._share is not None and not engine.has_unfinished():
                self._share.idle()  # before the wait: the others take these cores from their next step
            with self._cond:
                while not self._inbox and not engine.has_unfinished() and not self._stopping:
                    if not self._cond.wait(IDLE_TRIM_S if stepped else None):
                        idle = True
                        break
                commands = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            if idle:
                return_freed_memory()  # outside the lock: submitting a request never blocks on it
                stepped = False
                continue
            outbox: list[tuple[_Request, RequestOutput | BaseException]] = []
            for command in commands:
                if command[0] == "add":
                    self._add(engine, live, outbox, *command[1:])
                elif command[0] == "call":
                    self._call(engine, *command[1:])
                else:
                    self._abort(engine, live, outbox, command[1])
            if stopping:
                for rid, req in list(live.items()):
                    self._safe_abort(engine, rid)
                    outbox.append((req, EngineError("the server is shutting down")))
                live.clear()
                self._send(outbox)
                self._publish_stats(engine)
                return
            if engine.has_unfinished():
                self._step(engine, live, outbox)
                stepped = True
            self._publish_stats(engine)
            self._send(outbox)

    @staticmethod
    def _call(engine: LLMEngine, fn: Callable[[LLMEngine], Any], future: Future) -> None:
        # The caller may have given up (its await was cancelled): then ``fn`` must not run, and
        # setting a result on the cancelled future would raise here, on the engine thread.
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(engine))
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            future.set_exception(e)

    def _add(self, engine, live, outbox, req: _Request, start) -> None:
        if self._early_aborts.pop(req.request_id, None) is not None:
            outbox.append((req, RequestOutput(req.request_id, [], "", True, "abort", 0, 0, 0)))
            return
        try:
            start(engine)
        except ValueError as e:
            outbox.append((req, ValueError(str(e))))
        except Exception as e:  # noqa: BLE001
            if _not_the_engines_fault(e):
                outbox.append((req, e))
                return
            log.exception("add_request failed for %s", req.request_id)
            outbox.append((req, EngineError(f"engine failed to add the request: {e}")))
        else:
            live[req.request_id] = req

    def _abort(self, engine, live, outbox, request_id: str) -> None:
        req = live.pop(request_id, None)
        if req is None:  # already finished, or not here yet: then it is refused when it comes
            self._remember_abort(request_id)
            return
        seq = engine.seqs.get(request_id)
        counts = (
            (seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens) if seq else (0, 0, 0)
        )
        self._safe_abort(engine, request_id)
        outbox.append(
            (req, RequestOutput(request_id, [], "", True, "abort", *counts))
        )

    def _remember_abort(self, request_id: str) -> None:
        """Engine thread only. Bounded in time and in count (the oldest go first)."""
        now = time.monotonic()
        early = self._early_aborts
        early[request_id] = now
        early.move_to_end(request_id)
        while early and (len(early) > MAX_EARLY_ABORTS or now - next(iter(early.values())) > ABORT_MEMORY_S):
            early.popitem(last=False)

    @staticmethod
    def _safe_abort(engine: LLMEngine, request_id: str) -> None:
        try:
            engine.abort(request_id)
        except Exception:  # noqa: BLE001
            log.exception("abort failed for %s", request_id)

    def _step(self, engine, live, outbox) -> None:
        computed, running = engine.num_prompt_tokens_computed, engine.scheduler.running
        batch, context = len(running), sum(seq.num_tokens for seq in running)
        if self._share is not None:
            threads = self._share.busy(self._last_step_s)
            if threads != self._threads:
                set_threads(threads)
                self._threads = threads
        started = time.perf_counter()
        try:
            outputs = engine.step()
        except StepFailed as e:
            self._num_step_errors += 1
            outputs, batch = self._isolate(engine, live, outbox, e), 0  # not a decode step to time
        except Exception as e:  # noqa: BLE001
            # Outside the forward pass (scheduling, sampling, postprocessing): which sequences
            # advanced is not known, so none of them can go on.
            self._num_step_errors += 1
            log.exception("engine step failed; failing %d request(s)", len(live))
            for rid, req in live.items():
                self._safe_abort(engine, rid)
                outbox.append((req, EngineError(f"engine step failed: {type(e).__name__}: {e}")))
            live.clear()
            return
        self._num_steps += 1
        self._last_step_s = time.perf_counter() - started
        if batch and engine.num_prompt_tokens_computed == computed:
            d = self._decode_steps
            d[0], d[1], d[2], d[3] = d[0] + 1, d[1] + time.perf_counter() - started, d[2] + batch, d[3] + context
        running = len(engine.scheduler.running)
        self._max_running_seen = max(self._max_running_seen, running + sum(o.finished for o in outputs))
        self._max_batch_seen = max(self._max_batch_seen, len(outputs))
        for out in outputs:
            req = live.pop(out.request_id) if out.finished else live.get(out.request_id)
            if req is not None:
                outbox.append((req, out))

    def _isolate(self, engine: LLMEngine, live, outbox, failed: StepFailed) -> list[RequestOutput]:
        """A step's forward pass raised: one bad request must not end its neighbours. Step halves
        of the failed batch (``LLMEngine.step(only=)``) until the requests that fail alone are
        found. Where others stepped meanwhile, those are the requests' own failures: they end
        with ``RequestFailed`` and the rest go on. Where nobody could step, it is the engine's
        (every one of them failing alone): they end with ``EngineError``, as does every request
        of a step that reached outside the engine (KV streamed or loaded, pipeline stages told),
        which cannot run again. Returns the outputs of the halves that stepped (each request at
        most one step ahead, as in any step)."""
        cause = failed.__cause__ or failed
        log.error("an engine step of %d request(s) failed: %s: %s", len(failed.request_ids), type(cause).__name__,
                  cause, exc_info=cause)
        if not failed.retryable:
            self._fail_requests(engine, live, outbox, {rid: cause for rid in failed.request_ids}, False)
            return []
        outputs: list[RequestOutput] = []
        culprits: dict[str, BaseException] = {}
        innocent = False  # a request of the failed batch stepped
        groups = [failed.request_ids]
        while groups:
            group = [rid for rid in groups.pop() if rid in engine.seqs]
            if not group:
                continue
            try:
                outputs += engine.step(only=group)
            except StepFailed as e:
                if not e.retryable:
                    self._fail_requests(engine, live, outbox, {rid: e.__cause__ or e for rid in e.request_ids}, False)
                elif len(e.request_ids) == 1:
                    culprits[e.request_ids[0]] = e.__cause__ or e
                else:
                    half = len(e.request_ids) // 2
                    groups += [e.request_ids[:half], e.request_ids[half:]]
                continue
            stepped = set(engine.last_batch) & set(group)
            if not stepped:
                # None of them could be scheduled now (preempted, waiting behind another): they go
                # on in the ordinary steps, where a failure starts this over.
                break
            innocent = True
            groups.append([rid for rid in group if rid not in stepped])
        self._fail_requests(engine, live, outbox, culprits, innocent)
        return outputs

    def _fail_requests(self, engine: LLMEngine, live, outbox, causes: dict[str, BaseException], own: bool) -> None:
        """End each request with what its step raised: ``own`` its own failure (``RequestFailed``,
        counted in ``num_requests_failed``), else the engine's (``EngineError``)."""
        for request_id, cause in causes.items():
            what = f"{type(cause).__name__}: {cause}"
            if own:
                log.error("request %s failed inside the engine (its step raises %s); the others go on", request_id, what)
                self._num_requests_failed += 1
            self._safe_abort(engine, request_id)
            req = live.pop(request_id, None)
            if req is not None:
                error = (RequestFailed(f"internal error in the engine while computing this request: {what}") if own
                         else EngineError(f"engine step failed: {what}"))
                outbox.append((req, error))

    @staticmethod
    def _send(outbox) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req, item in outbox:
            by_loop.setdefault(req.loop, []).append((req, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _publish_stats(self, engine: LLMEngine) -> None:
        s = engine.stats()
        bm = engine.block_manager
        sched = engine.scheduler
        self._stats = {
            "model": self._model_name,
            "kernels": engine.runner.kernels,
            "projections": engine.runner.linear_path,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_reserved": s.num_reserved,
            "num_blocks": s.num_blocks,
            "block_size": self.config.block_size,
            "num_free_blocks": bm.pool.num_free,
            "num_used_blocks": bm.pool.num_in_use,
            "num_cached_blocks": bm.pool.num_cached_unused,
            "num_retained_blocks": bm.pool.num_retained,  # of those, sessions'
            "retained_evictions": bm.pool.num_retained_evictions,
            "kv_cache_usage": s.kv_cache_usage,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "prefix_cache_queries": sched.num_prompt_tokens_admitted,
            "prefix_cache_hits": sched.num_prompt_tokens_hit,
            "num_preemptions": s.num_preemptions,
            "num_prompt_tokens_computed": s.num_prompt_tokens_computed,
            "num_generated_tokens": s.num_generated_tokens,
            "num_steps": self._num_steps,
            "threads": self._threads,  # of the last step: with a core share, what the budget gave
            "decode_steps": self._decode_steps[0],
            "decode_step_seconds": self._decode_steps[1],
            "decode_step_seqs": self._decode_steps[2],
            "decode_step_context_tokens": self._decode_steps[3],
            "num_step_errors": self._num_step_errors,
            "num_requests_failed": self._num_requests_failed,
            "max_num_running_seen": self._max_running_seen,
            "max_batch_size_seen": self._max_batch_seen,
        }
        for fn in self._observers:
            try:
                fn(engine)
            except Exception:  # noqa: BLE001 -- an observer must not stop the engine
                log.exception("step observer failed")
