"""The interface the HTTP front end talks to: an asynchronous engine client.

The OpenAI server (``server/app.py``) only ever sees this interface. ``AsyncLLMEngine``
(``engine/async_engine.py``) implements it over one local ``LLMEngine``; ``cluster/conductor/conductor.py``
implements it over prefill and decode instances. Nothing here knows about HTTP: errors are
plain exceptions that the front end maps to status codes.

Invariants every implementation keeps:

* ``generate`` yields ``RequestOutput`` deltas for one request, in order, and stops right after
  the one with ``finished=True``. It never hangs: if the engine fails, the iterator raises
  ``EngineError``; if the request cannot be served (bad prompt, too long for the context or
  the KV cache), it raises ``ValueError`` before yielding anything.
* Leaving the iterator early (``break``, ``aclose()``, task cancellation, an exception in the
  consumer) aborts the request, and its KV blocks are freed shortly after, without the
  consumer having to await anything.
* ``abort`` is idempotent: aborting an unknown or finished request does nothing.
* ``stats`` never blocks on the engine; it returns the latest snapshot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.session import SessionHint
from engine.tokenizer import Tokenizer


class EngineError(RuntimeError):
    """The engine failed while serving a request (not the request's fault)."""


class RequestFailed(EngineError):
    """One request failed inside the engine (an internal error its step raised while it was in
    the batch): that request ends, the engine and the other requests go on."""


class NotStarted(Exception):
    """A request's ``start`` (``AsyncLLMEngine.stream``) refused it for a reason that lies outside
    the engine: the KV it was to start from arrived corrupt, say. Handed back to the caller as it
    is, which may place the request elsewhere; read as an ``EngineError`` it would make a healthy
    instance look failed."""


class EngineNotReady(RuntimeError):
    """The model is still loading (or failed to load), or a part the engine needs is down; no
    request can be served now. ``retry_after``: seconds after which a retry may succeed (None:
    no estimate)."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class EngineOverloaded(RuntimeError):
    """Too many requests are already waiting; the client should retry later."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineClient(ABC):
    """Asynchronous access to an engine (local, or a cluster behind a conductor)."""

    # -- lifecycle ---------------------------------------------------------------------------------
    @abstractmethod
    async def start(self) -> None:
        """Begin loading in the background and return at once (idempotent)."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop serving: in-flight requests fail with ``EngineError``; resources are released."""

    @property
    @abstractmethod
    def is_ready(self) -> bool:
        """True once the model is loaded and requests can be served."""

    @property
    @abstractmethod
    def load_error(self) -> str | None:
        """Why loading failed, or None (still loading, or loaded)."""

    def not_ready(self) -> EngineNotReady:
        """The error for a request that arrives while ``is_ready`` is False, saying why."""
        return EngineNotReady("the model is still loading", retry_after=5.0)

    # -- model facts (valid once ready; model_name always) ----------------------------------------
    @property
    @abstractmethod
    def model_name(self) -> str:
        """The name clients use in the ``model`` field; known before loading finishes."""

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer; raises ``EngineNotReady`` before the model is loaded."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Context length in tokens (prompt + output); raises ``EngineNotReady`` before loading."""

    # -- requests ---------------------------------------------------------------------------------
    @abstractmethod
    def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, session: SessionHint | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Serve one request and yield its output deltas (see the module docstring). ``session``:
        the client's session hint (``engine.session``); it never changes the output.

        Raises ``EngineNotReady`` / ``EngineOverloaded`` on the first iteration when the request
        is refused before reaching the engine, ``ValueError`` when the engine rejects it.
        """

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV; its ``generate`` iterator then ends with an
        ``abort`` finish (or simply stops if already finished)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Latest engine statistics as a JSON-able dict. Keys at least: ``num_running``,
        ``num_waiting``, ``num_blocks``, ``num_free_blocks``, ``num_used_blocks``,
        ``kv_cache_usage``, ``prefix_cache_queries``, ``prefix_cache_hits`` (tokens),
        ``max_num_running_seen``."""
