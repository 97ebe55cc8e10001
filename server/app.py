"""The OpenAI-compatible HTTP front end (starlette), over any ``EngineClient``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus) and ``GET /stats`` (engine statistics as JSON, for tests and
operators). With API keys set, ``/v1`` needs one (``Authorization: Bearer KEY``); with an
operator key, ``/metrics``, ``/stats`` and the Conductor's indexer API need it (they name
instance URLs, load and what is cached; ``public_metrics`` opens the first two): see
``ServerSettings``. Under ``cache_scope`` per-key (the default) each key's prompts are cached
apart from the others'. ``/health`` stays open for load balancers but shows why loading failed only to
those who may read ``/stats``.

Errors that are the client's (4xx) explain themselves. Failures that are not (5xx) never echo the
engine's message, which can name instance URLs or quote an instance's reply: the client gets a
short error id, and the server log has the id with the full message.

How one generation request flows:

1. the body is read with a size cap (413), parsed as JSON (400) and validated into engine
   requests by ``server/protocol.py`` (400 / 404): a body over 32 KiB in the tokenizer process
   (``server/parse_worker.py``), so that tokenizing it never stalls the event loop;
2. every engine request (``prompts x n`` of them) gets a *pump* task that iterates
   ``EngineClient.generate`` and forwards outputs into one queue for the whole HTTP request,
   while a watcher task turns a client disconnect into a queue item as well;
3. the handler waits for the first output (or the error) of every engine request, so refusals
   (400 from the engine's own checks, 429 overload, 503 loading) are real status codes even for
   streaming requests; then it either collects everything (non-streaming) or returns an SSE
   stream;
4. whatever happens, the pumps are cancelled at the end; a cancelled pump leaves its
   ``generate`` iterator early, which aborts the engine request and frees its KV blocks. For
   SSE, starlette cancels the body iterator when the client disconnects, with the same effect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.outputs import RequestOutput
from engine.engine_client import EngineClient, EngineNotReady, EngineOverloaded
from engine.tokenizer import Tokenizer
from engine.session import MAX_SESSION_ID_CHARS, SessionHint
from server.front_door import bearer_token, user_of
from server.metrics import RequestTracker, ServerMetrics
from server.protocol import (
    Choice,
    ModelLimits,
    ParsedRequest,
    ProtocolError,
    chat_logprobs,
    completion_logprobs,
    error_body,
    usage,
)
from server.parse_worker import INLINE_BYTES, PARSERS, ParseBusy, ParseUnavailable, ParseWorker
from server.tool_calls import ToolCallReader, read_calls

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
MAX_REQUEST_ID_CHARS = 128  # of a client's X-Request-Id, in the log


@dataclass
class ServerSettings:
    """Who may call what. Two kinds of caller: users, with one of ``api_keys`` (``/v1``; none set:
    ``/v1`` is open), and the operator, with ``operator_key`` (``/stats``, ``/metrics`` and the
    Conductor's indexer API; none set: those take a user key, as ``/v1`` does, and no engine
    may register with the indexer). The operator key serves ``/v1`` too."""

    api_keys: tuple[str, ...] = ()
    operator_key: str | None = None
    # The highest session priority a user's key may ask for (the operator's: any; with no keys set
    # there are no users to tell apart, and none is bounded).
    max_user_priority: int = 0
    # "per-key": each caller's prompts are cached apart (a hit, ``cached_tokens``, tells nobody what
    # another caller sent); "shared": every caller reuses every prefix (faster where users share
    # prompts, and a cached prefix then answers who sent what). ``SamplingParams.cache_salt``.
    cache_scope: str = "per-key"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Serve /metrics and /stats without a key, e.g. to a Prometheus scraper that cannot send one.
    public_metrics: bool = False
    # "auto": the model's generation_config.json sampling fields are the defaults of requests that
    # leave them out (vLLM's default); "vllm": OpenAI's defaults whatever the model ships.
    generation_config: str = "auto"
    # The operator's chat template (--chat-template FILE's text), in place of the model's.
    chat_template: str | None = None
    # Origins a browser may call the API from (CORS; "*": any); none: no CORS headers, as vLLM.
    allowed_origins: tuple[str, ...] = ()


def _error(status: int, message: str, type: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _protocol_error(e: ProtocolError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _ServerFault(Exception):
    """A failure that is not the client's: all the client learns is ``error_id``, which leads to
    the full message in the server log."""

    def __init__(self, error_id: str):
        super().__init__(error_id)
        self.error_id = error_id


def _fault(what: str, detail: BaseException | str, exc_info: BaseException | None = None) -> _ServerFault:
    """Log ``detail`` under a fresh error id, and return the fault that carries only the id."""
    error_id = secrets.token_hex(4)
    log.error("%s (error id %s): %s", what, error_id, detail, exc_info=exc_info)
    return _ServerFault(error_id)


def _engine_error(e: ValueError | EngineOverloaded | EngineNotReady | _ServerFault) -> JSONResponse:
    """Map a failure of ``EngineClient.generate`` (as a pump queued it) to an HTTP error."""
    if isinstance(e, ValueError):
        return _error(400, str(e), "invalid_request_error")
    if isinstance(e, EngineOverloaded):
        retry = str(max(1, round(e.retry_after)))
        return _error(429, str(e), "rate_limit_error", code="too_many_requests",
                      headers={"Retry-After": retry})
    if isinstance(e, EngineNotReady):
        retry = str(max(1, round(e.retry_after if e.retry_after is not None else 5)))
        return _error(503, str(e), "service_unavailable", headers={"Retry-After": retry})
    return _error(500, "internal error: the engine failed while serving the request "
                  f"(see the server log, error id {e.error_id})", "internal_server_error")


class _Disconnected:
    """Queue item: the client went away."""


async def _read_json(request: Request, limit: int) -> tuple[Any, int]:
    """The body as JSON, and its size in bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ProtocolError("invalid Content-Length header") from None
        if size > limit:
            raise ProtocolError(f"request body of {size} bytes exceeds the limit of {limit} bytes",
                                status=413, code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProtocolError(f"request body exceeds the limit of {limit} bytes",
                                    status=413, code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody will read the answer; this only keeps a client that left from looking like a
        # server error in the log.
        raise ProtocolError("the client disconnected before sending the whole body") from None
    raw = b"".join(chunks)
    if not raw:
        raise ProtocolError("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
        # JSON may spell a lone UTF-16 surrogate ("\ud800"), which is no character: the tokenizer
        # cannot take it, so it is refused here rather than fail deep inside as a 500.
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ProtocolError("the body contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ProtocolError(f"malformed JSON body: {e}") from None
    return body, len(raw)


class _Generation:
    """The engine requests behind one HTTP request, and their merged outputs."""

    def __init__(self, client: EngineClient, metrics: ServerMetrics, parsed: ParsedRequest, prefix: str,
                 session: SessionHint | None = None, client_id: str | None = None):
        self.client = client
        self.metrics = metrics
        self.parsed = parsed
        self.session = session
        # Ours, unique whatever the client sends; the client's own id (its X-Request-Id) goes in the logs.
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.name = self.id if client_id is None else f"{self.id} (X-Request-Id {client_id[:MAX_REQUEST_ID_CHARS]!r})"
        self.created = int(time.time())
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.choices = [Choice(i, keep_output=not parsed.score_only) for i in range(parsed.num_choices)]

    def start(self, request: Request) -> None:
        p = self.parsed
        for i, ids in enumerate(p.prompts):
            for j, params in enumerate(p.params[i]):
                index = i * p.n + j
                gen = self.client.generate(f"{self.id}-{index}", ids, params, self.session)
                self.tasks.append(asyncio.create_task(self._pump(index, gen, self.metrics.tracker())))
        self.tasks.append(asyncio.create_task(self._watch(request)))

    async def _pump(self, index: int, gen, tracker: RequestTracker) -> None:
        try:
            async for out in gen:
                tracker.observe(out)
                self.queue.put_nowait((index, out))
        except asyncio.CancelledError:
            tracker.aborted()
            raise
        except (ValueError, EngineOverloaded, EngineNotReady) as e:
            self.queue.put_nowait((index, e))
        except Exception as e:  # noqa: BLE001 -- EngineError or anything unexpected
            tracker.failed()
            self.queue.put_nowait((index, _fault(f"request {self.name} choice {index} failed", e)))
        finally:
            await gen.aclose()  # no-op when finished; aborts the engine request otherwise

    async def _watch(self, request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.queue.put_nowait((-1, _Disconnected()))
                return

    def stop_watching(self) -> None:
        self.tasks[-1].cancel()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def first_outputs(self) -> list[tuple[int, RequestOutput]] | Response | None:
        """Wait until every engine request produced an output; returns those outputs, an error
        response, or None if the client disconnected."""
        pending = set(range(self.parsed.num_choices))
        buffered = []
        while pending:
            index, item = await self.queue.get()
            if isinstance(item, _Disconnected):
                return None
            if isinstance(item, BaseException):
                return _engine_error(item)
            pending.discard(index)
            buffered.append((index, item))
        return buffered

    def usage(self) -> dict[str, Any]:
        return usage(self.choices, self.parsed.n, [len(ids) for ids in self.parsed.prompts])


class OpenAIServer:
    def __init__(self, client: EngineClient, settings: ServerSettings, metrics: ServerMetrics):
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.started = int(time.time())
        self._parser: ParseWorker | None = None  # started with the first large body

    # -- shared checks -----------------------------------------------------------------------------
    def _unauthorized(self, request: Request) -> Response | None:
        """A user's route (``/v1``): None if the caller may call it, else the 401."""
        s = self.settings
        if not s.api_keys:
            return None
        token = _bearer(request)
        if user_of(token, s.api_keys) is not None or (s.operator_key and _same(token, s.operator_key)):
            return None
        return _no_key()

    def _user(self, request: Request) -> str | None:
        """The user a request comes from (``front_door.user_of``), or None (no keys set, or the operator's)."""
        return user_of(_bearer(request), self.settings.api_keys)

    def _scoped(self, session: SessionHint | None, user: str | None) -> SessionHint | None:
        """``session`` as the engine keys it: one user's session id never names another's (issue
        52: anyone could take over or flush another's session), and a user's priority is bounded."""
        if session is None or user is None:
            return session
        if session.priority > self.settings.max_user_priority:
            raise ProtocolError(f"'priority' {session.priority} is above what an API key may ask for "
                                f"({self.settings.max_user_priority}; the server's --max-user-priority)", "priority",
                                status=403, code="priority_not_allowed")
        scoped = f"{user}:{session.session_id}"
        if len(scoped) > MAX_SESSION_ID_CHARS:
            scoped = f"{user}:{hashlib.sha256(session.session_id.encode()).hexdigest()}"
        return SessionHint(scoped, session.priority)

    def _caller(self, request: Request, user: str | None) -> str | None:
        """Whose cache a request of ``user`` (``_user``) reads and fills under ``cache_scope``
        per-key: its user's, the operator's; None where callers share one (shared scope, or no
        keys: one caller)."""
        if self.settings.cache_scope != "per-key":
            return None
        if user is not None:
            return f"key {user}"
        op = self.settings.operator_key
        return "operator" if op and _same(_bearer(request), op) else None

    def _salted(self, parsed: ParsedRequest, caller: str | None) -> None:
        """Every sampling of ``parsed`` keyed in ``caller``'s cache: its name, then the body's
        ``cache_salt``, salt the prompt's KV (``paged_kv.prefix_keys.salt_root``). A body's salt
        cannot name another caller's cache: the caller's own name always comes first."""
        if caller is None:
            return
        for row in parsed.params:
            row[:] = [dataclasses.replace(p, cache_salt=caller if p.cache_salt is None else f"{caller}\n{p.cache_salt}")
                      for p in row]

    def _indexer_denied(self, request: Request) -> Response | None:
        """The indexer's routes: the operator's, and under per-key cache scope never a user's, even
        without an operator key (a cached prefix answers what someone's prompt began with)."""
        if not self.settings.operator_key and self.settings.api_keys and self.settings.cache_scope == "per-key":
            if (denied := self._unauthorized(request)) is not None:
                return denied
            return _error(403, "the indexer's answers tell what others' prompts began with: under --cache-scope "
                          "per-key they are the operator's (set --operator-key)", "permission_error",
                          code="operator_key_required")
        return self._operator_denied(request)

    def _operator_denied(self, request: Request) -> Response | None:
        """An operator's route (``/stats``, ``/metrics``, the indexer API): None if the caller may
        call it, else the 401 (no key, a wrong one) or 403 (a user's key)."""
        op = self.settings.operator_key
        if op is None:
            return self._unauthorized(request)
        token = _bearer(request)
        if _same(token, op):
            return None
        if user_of(token, self.settings.api_keys) is not None:
            return _error(403, "this route is the operator's: it needs the operator key (--operator-key), "
                          "not a user's API key", "permission_error", code="operator_key_required")
        return _no_key()

    def _stats_denied(self, request: Request) -> Response | None:
        return None if self.settings.public_metrics else self._operator_denied(request)

    def _not_ready(self) -> Response:
        load_error = self.client.load_error
        if not load_error:
            return _engine_error(self.client.not_ready())
        # The load error names model paths or instance URLs: it goes to the log, not the client.
        fault = _fault("refused a request: the server failed to load", load_error)
        return _error(503, f"the server failed to load (see the server log, error id {fault.error_id})",
                      "service_unavailable", headers={"Retry-After": "5"})

    def _limits(self) -> ModelLimits:
        c = self.client
        stats = c.stats()
        capacity = stats.get("num_blocks", 0) * stats.get("block_size", 0) or None
        vocab = getattr(c, "vocab_size", None) or c.tokenizer.vocab_size
        defaults = c.tokenizer.sampling_defaults if self.settings.generation_config == "auto" else {}
        return ModelLimits(c.model_name, c.tokenizer, c.max_model_len, vocab, capacity, defaults,
                           self.settings.chat_template)

    # -- routes ------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.client.is_ready:
            return JSONResponse({"status": "ok"})
        if load_error := self.client.load_error:
            # Open to anyone (load balancers), so the detail only for those who may read /stats.
            if self._stats_denied(request) is not None:
                load_error = "the server failed to load (see the server log)"
            return JSONResponse({"status": "error", "error": load_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    async def metrics_endpoint(self, request: Request) -> Response:
        if (denied := self._stats_denied(request)) is not None:
            return denied
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type.split(";")[0],
                        headers={"Content-Type": content_type})

    async def stats(self, request: Request) -> Response:
        if (denied := self._stats_denied(request)) is not None:
            return denied
        return JSONResponse(self.client.stats())

    async def models(self, request: Request) -> Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        card: dict[str, Any] = {"id": self.client.model_name, "object": "model",
                                "created": self.started, "owned_by": "mooncake-py"}
        if self.client.is_ready:
            card["max_model_len"] = self.client.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion", "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat", "chatcmpl")

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize`` (``protocol.parse_tokenize``)."""
        parsed = await self._read_and_parse(request, "tokenize")
        return parsed if isinstance(parsed, Response) else JSONResponse(parsed.to_dict())

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize`` (``protocol.parse_detokenize``)."""
        parsed = await self._read_and_parse(request, "detokenize")
        return parsed if isinstance(parsed, Response) else JSONResponse({"prompt": parsed})

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's special tokens and chat template (what
        lm-eval's remote tokenizer reads before it uses /tokenize)."""
        if (denied := self._unauthorized(request)) is not None:
            return denied
        if not self.client.is_ready:
            return self._not_ready()
        info = self.client.tokenizer.info(self.client.max_model_len)
        if self.settings.chat_template is not None:
            info["chat_template"] = self.settings.chat_template
        return JSONResponse(info)

    async def _read_and_parse(self, request: Request, kind: str) -> Any:
        """A user's body read (size cap), validated and tokenized by ``PARSERS[kind]``; or the
        error response (401, 4xx naming the field, 429 / 503 when the tokenizer process is busy)."""
        if (denied := self._unauthorized(request)) is not None:
            return denied
        try:
            body, size = await _read_json(request, self.settings.max_body_bytes)
            if not self.client.is_ready:
                return self._not_ready()
            return await self._parse(kind, body, size)
        except ProtocolError as e:
            return _protocol_error(e)
        except EngineNotReady as e:
            return _engine_error(e)
        except ParseBusy as e:
            return _error(429, f"too many large requests at once: {e}; retry shortly", "rate_limit_error",
                          code="too_many_requests", headers={"Retry-After": "1"})
        except ParseUnavailable as e:
            fault = _fault("could not parse a request", e)
            return _error(503, f"the server could not tokenize the request in time (error id {fault.error_id}); "
                          "retry shortly", "service_unavailable", headers={"Retry-After": "2"})

    async def _parse(self, kind: str, body: Any, size: int) -> Any:
        """Validate and tokenize: a small body here, a large one in the tokenizer process
        (``server/parse_worker.py``), so that no prompt stalls the event loop."""
        limits = self._limits()
        if size <= INLINE_BYTES:
            return PARSERS[kind](body, limits)
        if self._parser is None:  # the client's tokenizer, loaded once, is the worker's for good
            self._parser = ParseWorker(limits.tokenizer)
        return await self._parser.parse(kind, body, limits)

    def close(self) -> None:
        if self._parser is not None:
            self._parser.close()

    async def _generate(self, request: Request, kind: str, prefix: str) -> Response:
        parsed = await self._read_and_parse(request, kind)
        if isinstance(parsed, Response):
            return parsed
        user = self._user(request)  # found by comparing every key: once, for its session and its cache
        try:
            session = self._scoped(parsed.session_hint(request.headers.get("x-session-id")), user)
        except ProtocolError as e:
            return _protocol_error(e)
        self._salted(parsed, self._caller(request, user))

        gen = _Generation(self.client, self.metrics, parsed, prefix, session, request.headers.get("x-request-id"))
        handed_over = False
        try:
            gen.start(request)
            first = await gen.first_outputs()
            if not isinstance(first, list):
                return first if first is not None else Response(status_code=499)
            if parsed.stream:
                gen.stop_watching()  # StreamingResponse watches for disconnects from now on
                handed_over = True
                return StreamingResponse(
                    self._sse(gen, first), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            return await self._collect(gen, first)
        finally:
            if not handed_over:
                gen.close()

    # -- non-streaming -----------------------------------------------------------------------------
    async def _collect(self, gen: _Generation, first: list[tuple[int, RequestOutput]]) -> Response:
        pending = gen.parsed.num_choices
        for index, out in first:
            gen.choices[index].add(out)
            pending -= out.finished
        while pending:
            index, item = await gen.queue.get()
            if isinstance(item, _Disconnected):
                return Response(status_code=499)
            if isinstance(item, BaseException):
                return _engine_error(item)
            gen.choices[index].add(item)
            pending -= item.finished
        tok = self.client.tokenizer
        p = gen.parsed
        choices = []
        for c in gen.choices:
            if p.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                reason = c.finish_reason
                if p.reads_tool_calls:
                    message["content"], calls = read_calls(c.text)
                    if calls:
                        message["tool_calls"] = calls
                        reason = "tool_calls" if reason == "stop" else reason  # cut short: still "length"
                choices.append({
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(tok, c.logprobs) if p.logprobs is not None else None,
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                })
            else:
                echo = _echo(p, c.index)
                choices.append({
                    "index": c.index,
                    "text": echo + c.text,
                    "logprobs": _completion_logprobs(tok, p, c, c.logprobs, 0) if p.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
        return JSONResponse({
            "id": gen.id,
            "object": "chat.completion" if p.kind == "chat" else "text_completion",
            "created": gen.created,
            "model": p.model,
            "choices": choices,
            "usage": gen.usage(),
            "system_fingerprint": None,
        })

    # -- streaming ---------------------------------------------------------------------------------
    async def _sse(self, gen: _Generation, first: list[tuple[int, RequestOutput]]):
        p = gen.parsed
        tok = self.client.tokenizer
        chat = p.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        readers = [ToolCallReader() for _ in gen.choices] if p.reads_tool_calls else None

        def chunk(choices: list[dict], **extra) -> str:
            data = {"id": gen.id, "object": obj, "created": gen.created, "model": p.model,
                    "choices": choices, **extra}
            if p.include_usage and "usage" not in data:
                data["usage"] = None
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def delta(index: int, out: RequestOutput) -> str | None:
            c = gen.choices[index]
            offset = len(c.text)
            c.add(out)
            new_text, new_logprobs = (out.new_text, out.logprobs) if c.keep_output else ("", [])
            echo = "" if c.echoed else _echo(p, index)  # the prompt goes out with a choice's first delta
            c.echoed = True
            if not new_text and not echo and not out.finished and not (p.logprobs is not None and new_logprobs):
                return None
            reason = c.finish_reason if out.finished else None
            ended = {"finish_reason": reason, "stop_reason": c.stop_reason if out.finished else None}
            if chat:
                d: dict[str, Any] = {"content": new_text} if new_text else {}
                if readers is not None:
                    d = _tool_delta(readers[index], new_text, out.finished)
                    if readers[index].calls and out.finished and reason == "stop":
                        ended["finish_reason"] = "tool_calls"
                    if not d and not out.finished and not (p.logprobs is not None and new_logprobs):
                        return None  # held back: it may be the start of a tool call
                lp = chat_logprobs(tok, new_logprobs) if p.logprobs is not None else None
                return chunk([{"index": index, "delta": d, "logprobs": lp, **ended}])
            lp = None
            if p.logprobs is not None:
                lp = (_completion_logprobs(tok, p, c, new_logprobs, 0) if echo
                      else completion_logprobs(tok, new_logprobs, len(_echo(p, index)) + offset))
            return chunk([{"index": index, "text": echo + new_text, "logprobs": lp, **ended}])

        try:
            if chat:
                for c in gen.choices:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            pending = p.num_choices
            for index, out in first:
                pending -= out.finished
                if (text := delta(index, out)) is not None:
                    yield text
            while pending:
                index, item = await gen.queue.get()
                if isinstance(item, _Disconnected):
                    return
                if isinstance(item, BaseException):
                    status = _engine_error(item)
                    err = json.loads(status.body)
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                pending -= item.finished
                if (text := delta(index, item)) is not None:
                    yield text
            else:
                if p.include_usage:
                    yield chunk([], usage=gen.usage())
            yield "data: [DONE]\n\n"
        finally:
            gen.close()


def _tool_delta(reader: ToolCallReader, text: str, finished: bool) -> dict[str, Any]:
    """A streamed chat delta read for tool calls: the content that may go out now, and each call
    completed (numbered across the choice: the clients accumulate deltas by that index)."""
    content, calls = reader.feed(text)
    if finished:
        content += reader.finish()
    d: dict[str, Any] = {"content": content} if content else {}
    if calls:
        first = len(reader.calls) - len(calls)
        d["tool_calls"] = [{"index": first + k, **call} for k, call in enumerate(calls)]
    return d


def _echo(p: ParsedRequest, index: int) -> str:
    """The prompt text choice ``index`` starts with (``echo``), or nothing."""
    return p.echo_texts[index // p.n] if p.echo_texts is not None else ""


def _completion_logprobs(tok: Tokenizer, p: ParsedRequest, c: Choice, lps: list, offset: int) -> dict[str, Any]:
    """A choice's logprobs from its start: with ``echo``, its prompt's tokens first."""
    if p.echo_texts is None:
        return completion_logprobs(tok, lps, offset)
    prompt = c.prompt_logprobs
    if prompt is None:  # echo without prompt logprobs asked: impossible, they come with logprobs
        raise RuntimeError("an echoed choice has no prompt logprobs")
    return completion_logprobs(tok, lps, prompt=prompt, prompt_ids=p.prompts[c.index // p.n],
                               after_prompt=len(_echo(p, c.index)) + offset)


def _bearer(request: Request) -> str:
    return bearer_token(request.scope["headers"])


def _same(token: str, key: str) -> bool:
    return hmac.compare_digest(token.encode(), key.encode())


def _no_key() -> Response:
    return _error(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'",
                  "invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _operators(server: OpenAIServer, endpoint: Callable[[Request], Awaitable[Response]]
               ) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        if (denied := server._indexer_denied(request)) is not None:
            return denied
        return await endpoint(request)
    return handle


class _EchoRequestId:
    """Every response to a request with an ``X-Request-Id`` header carries it back (as vLLM's and
    most proxies' do), errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        theirs = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None) \
            if scope["type"] == "http" else None
        if theirs is None:
            return await self.app(scope, receive, send)

        async def echoing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", theirs)]}
            await send(message)
        await self.app(scope, receive, echoing)


def build_app(
    client: EngineClient,
    settings: ServerSettings | None = None,
    manage_engine: bool = True,
    extra_routes: list[Route] | None = None,
    operator_routes: list[Route] | None = None,
) -> Starlette:
    """The starlette app over ``client``. With ``manage_engine`` the app's lifespan starts the
    client (loading in the background) and shuts it down; without it the caller does (several
    apps may share one client). ``extra_routes``: e.g. the Conductor's registration route;
    ``operator_routes``: routes that take the operator key, as /stats does (the Conductor's indexer API)."""
    settings = settings or ServerSettings()
    metrics = ServerMetrics(client, client.model_name)
    server = OpenAIServer(client, settings, metrics)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        if manage_engine:
            await client.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, server.close)
            if manage_engine:
                await client.shutdown()

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _error(exc.status_code, exc.detail, "invalid_request_error", headers=exc.headers)

    async def internal_error(request: Request, exc: Exception) -> Response:
        fault = _fault(f"unhandled error on {request.method} {request.url.path}", exc, exc_info=exc)
        return _error(500, f"internal server error (see the server log, error id {fault.error_id})",
                      "internal_server_error")

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/tokenizer_info", server.tokenizer_info, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
        Route("/stats", server.stats, methods=["GET"]),
        *(extra_routes or []),
        *(Route(r.path, _operators(server, r.endpoint), methods=r.methods) for r in operator_routes or []),
    ]
    middleware = [Middleware(_EchoRequestId)]
    if settings.allowed_origins:
        # The preflight (OPTIONS, no key) is answered here, before any route checks a key.
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                                     allow_methods=["*"], allow_headers=["*"], expose_headers=["X-Request-Id"]))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    app.state.engine_client = client
    app.state.settings = settings
    app.state.metrics = metrics
    return app
