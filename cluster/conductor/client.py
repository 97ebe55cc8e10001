"""The instance client: the only place the Conductor speaks HTTP to instances.

Typed calls (the messages of ``cluster/protocol/``), each with a bound, and one error mapping:
an answer that is not a 200 becomes the ``ProtocolError`` it carries (``protocol.error_from``);
no answer becomes ``Unreachable``, none in time ``TimedOut``, one that is not signed for the call
with the instances' key ``ForgedAnswer`` (ignored and counted: ``answers_refused``; streamed
answers are checked line by line, ``cluster.protocol.check_line``). The caller tells the two kinds
apart: a ``RequestError`` ends the request (or tries the next instance), an
``InstanceUnavailable`` marks the instance down.

Every control call has a timeout of ``control_timeout_s``. The two long calls, a prefill and a
decode stream, last as long as the work does; they are bounded by ``request_timeout_s`` and end
early, with ``Unreachable``, when the registry loses the instance (``lost`` is set: it stopped
answering polls), so a wedged instance never hangs a request.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import httpx

from cluster.protocol import (
    CONTROL, EPOCH_HEADER, INSTANCE, AnswerAuthError, ControlAuth, Fence, check_answer, check_line, derive_key)
from cluster.protocol import (
    AbortReply, AbortRequest, AdoptReply, AdoptRequest, BadRequest, ForgedAnswer, GenerateRequest, InstanceFailed,
    InstanceInfo,
    InstanceState, InstanceUnavailable, KVWriteFailed, PrefillReply, PrefillRequest, PrestageReply, PrestageRequest,
    ProtocolError, PushReply, PushRequest,
    RenewReply, RenewRequest, ReserveReply, ReserveRequest, SwitchRoleReply, SwitchRoleRequest, TimedOut, Unreachable,
    error_from, read_stream_line)
from engine.engine_client import EngineNotReady
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.session import SessionHint

T = TypeVar("T")
R = TypeVar("R", ReserveReply, RenewReply, AbortReply, PushReply, AdoptReply, PrefillReply, InstanceInfo,
            InstanceState, PrestageReply)


def _error(r: httpx.Response, what: str) -> ProtocolError:
    try:
        body = r.json()
    except ValueError:
        body = {"error": r.text[:300]}
    return error_from(r.status_code, body, r.headers.get("retry-after"), f"{what}: HTTP {r.status_code}: ")


def _json(r: httpx.Response, what: str) -> Any:
    try:
        return r.json()
    except ValueError as e:  # signed, so the instance's own: a bug there
        raise InstanceFailed(f"{what}: the answer is not JSON: {e}") from None


def _reply(cls: type[R], data: Any, what: str) -> R:
    """``data`` as the answer ``cls``; a malformed answer is the instance's fault, not the request's."""
    try:
        return cls.from_dict(data)
    except BadRequest as e:
        raise InstanceFailed(f"{what}: malformed answer: {e}") from None


# How long an idle connection to an instance is kept for the next call: well under the time an
# instance's server keeps one (uvicorn's ``timeout_keep_alive``, 5 s). At equal times (httpx's
# default was 5 s too) a call sent on a connection the instance was closing at that moment broke
# with a ReadError, and a healthy decode instance was marked down mid-stream (bench.chaos).
KEEPALIVE_EXPIRY_S = 2.0

# Failures of this process, not of the instance it called: out of descriptors or memory.
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class OwnResourcesExhausted(EngineNotReady):
    """The Conductor could not make a call for want of its own descriptors or memory: no
    instance's fault, so none is marked down; the client gets 503 with ``Retry-After``."""


def _local_cause(e: BaseException) -> OSError | None:
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _LOCAL_ERRNOS:
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def _no_answer(what: str, e: httpx.HTTPError) -> InstanceUnavailable | OwnResourcesExhausted:
    if (local := _local_cause(e)) is not None:
        return OwnResourcesExhausted(f"{what}: this server is out of resources ({local.strerror}); retry shortly",
                                     retry_after=1.0)
    cls = TimedOut if isinstance(e, httpx.TimeoutException) else Unreachable
    return cls(f"{what}: {type(e).__name__}: {e}")


class InstanceClient:
    def __init__(self, secret: bytes, fence: Fence, control_timeout_s: float = 10.0,
                 request_timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """``transport``: where the calls go (tests pass an ``httpx.MockTransport``)."""
        self.control_timeout_s = control_timeout_s
        self.request_timeout_s = request_timeout_s
        # Each call is signed with a key derived from the secret; the secret never travels.
        # No connection limit: a prefill or a decode stream holds its connection for as long as
        # the work lasts, and a bounded pool would make every other call (an abort, a poll)
        # queue behind them until it timed out. Polls get a client of their own all the same,
        # so the health of an instance is never judged by how busy the request path is.
        kwargs = dict(auth=ControlAuth(derive_key(secret, CONTROL)), headers={EPOCH_HEADER: fence.header()},
                      timeout=httpx.Timeout(control_timeout_s), transport=transport,
                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=32,
                                          keepalive_expiry=KEEPALIVE_EXPIRY_S))
        self._http = httpx.AsyncClient(**kwargs)
        self._polls = httpx.AsyncClient(**kwargs)
        self._answer_key = derive_key(secret, INSTANCE)
        self.answers_refused = 0  # answers that failed their signature (the Conductor's /metrics)

    def _forged(self, what: str, e: AnswerAuthError) -> ForgedAnswer:
        self.answers_refused += 1
        return ForgedAnswer(f"{what}: answer ignored: {e}")

    def _checked(self, r: httpx.Response, what: str) -> httpx.Response:
        """``r`` (read whole) once its signature verified; then a non-200 is the error it carries."""
        try:
            check_answer(self._answer_key, r)
        except AnswerAuthError as e:
            raise self._forged(what, e) from None
        if r.status_code != 200:
            raise _error(r, what)
        return r

    async def close(self) -> None:
        await self._http.aclose()
        await self._polls.aclose()

    async def _post(self, url: str, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        try:
            r = await self._http.post(url + path, json=body, timeout=timeout or self.control_timeout_s)
        except httpx.HTTPError as e:
            raise _no_answer(path, e) from None
        return _json(self._checked(r, path), path)

    async def _get(self, url: str, path: str, timeout: float) -> Any:
        try:
            r = await self._polls.get(url + path, timeout=timeout)
        except httpx.HTTPError as e:
            raise _no_answer(path, e) from None
        return _json(self._checked(r, path), path)

    # -- polls ---------------------------------------------------------------------------------------
    async def info(self, url: str, timeout: float) -> InstanceInfo:
        return _reply(InstanceInfo, await self._get(url, "/instance/info", timeout), "/instance/info")

    async def state(self, url: str, since: int | None, timeout: float) -> InstanceState:
        data = await self._get(url, "/instance/state" + ("" if since is None else f"?since={since}"), timeout)
        return _reply(InstanceState, data, "/instance/state")

    # -- reservations --------------------------------------------------------------------------------
    async def reserve(self, url: str, request_id: str, token_ids: list[int], params: SamplingParams,
                      session: SessionHint | None = None) -> ReserveReply:
        body = ReserveRequest(request_id, token_ids, params, session).to_dict()
        return _reply(ReserveReply, await self._post(url, "/instance/reserve", body), "/instance/reserve")

    async def renew(self, url: str, request_ids: list[str], timeout: float | None = None) -> list[str]:
        """Extend the leases; returns the ids the instance no longer holds."""
        data = await self._post(url, "/instance/renew", RenewRequest(request_ids).to_dict(), timeout)
        return _reply(RenewReply, data, "/instance/renew").gone

    async def abort(self, url: str, request_id: str, writes_done: bool = False) -> None:
        data = await self._post(url, "/instance/abort", AbortRequest(request_id, writes_done).to_dict())
        _reply(AbortReply, data, "/instance/abort")

    async def push(self, url: str, request_id: str, token_ids: list[int], dest: ReserveReply,
                   salt: str | None = None) -> int:
        body = PushRequest(request_id, token_ids, dest.dest, salt).to_dict()
        return _reply(PushReply, await self._post(url, "/instance/push", body), "/instance/push").pushed

    async def adopt(self, url: str, request_id: str, ok: bool) -> int:
        data = await self._post(url, "/instance/adopt", AdoptRequest(request_id, ok).to_dict())
        return _reply(AdoptReply, data, "/instance/adopt").adopted

    async def prestage(self, url: str, token_ids: list[int], session: SessionHint, salt: str | None = None) -> int:
        """Ask the instance to bring a session's last turn (cached under ``salt``) up from the pool's SSD tiers."""
        data = await self._post(url, "/instance/prestage", PrestageRequest(token_ids, session, salt).to_dict())
        return _reply(PrestageReply, data, "/instance/prestage").promoted

    # -- elastic roles ------------------------------------------------------------------------------
    async def switch_role(self, url: str, role: str, drain_s: float) -> SwitchRoleReply:
        """Ask the instance to switch to ``role`` (it answers at once; the drain runs there)."""
        data = await self._post(url, "/instance/role", SwitchRoleRequest(role, drain_s).to_dict())
        return _reply(SwitchRoleReply, data, "/instance/role")

    # -- the long calls ------------------------------------------------------------------------------
    async def prefill(self, url: str, request_id: str, token_ids: list[int], params: SamplingParams,
                      session: SessionHint | None, dest: ReserveReply, lost: asyncio.Event,
                      *dest_lost: asyncio.Event) -> RequestOutput:
        """``dest_lost``: set when the instance the KV streams to is lost, or the reservation
        there is gone; the prefill then ends at once with ``KVWriteFailed`` (its writes would only
        fail after the transfer timeout, and its compute is of no use)."""
        body = PrefillRequest(request_id, token_ids, params, dest.dest, session).to_dict()
        data = await _unless(lost, self._post(url, "/instance/prefill", body, timeout=self.request_timeout_s),
                             *dest_lost)
        return _reply(PrefillReply, data, "/instance/prefill").output

    async def generate(self, url: str, request: GenerateRequest, lost: asyncio.Event) -> AsyncIterator[RequestOutput]:
        """POST /instance/generate and yield its NDJSON deltas until the finished one."""
        timeout = httpx.Timeout(self.control_timeout_s, read=self.request_timeout_s)
        try:
            async with self._http.stream("POST", url + "/instance/generate", json=request.to_dict(),
                                         timeout=timeout) as r:
                try:
                    if r.status_code != 200:
                        await r.aread()
                        self._checked(r, "/instance/generate")
                    lines = r.aiter_lines()
                    index = 0
                    while True:
                        try:
                            line = await _unless(lost, anext(lines))
                        except StopAsyncIteration:
                            raise Unreachable("the stream ended before the request finished") from None
                        if not line:
                            continue
                        try:
                            line = check_line(self._answer_key, r.request, index, line)
                        except AnswerAuthError as e:
                            raise self._forged("/instance/generate", e) from None
                        index += 1
                        out = read_stream_line(line)
                        yield out
                        if out.finished:
                            return
                finally:
                    # Shielded: the caller is often cancelled right after the last output (the
                    # client's response is complete), and a close that is cancelled midway
                    # leaves the socket open for good (one per request, in CLOSE_WAIT once
                    # the instance hangs up). Closed here, the stream's own exit is a no-op.
                    await asyncio.shield(r.aclose())
        except httpx.HTTPError as e:
            raise _no_answer("/instance/generate", e) from None


async def _unless(lost: asyncio.Event, call: Awaitable[T], *dest_lost: asyncio.Event) -> T:
    """Await ``call`` unless the instance is lost first (then ``Unreachable``), or the one its
    KV goes to, or the reservation there (then ``KVWriteFailed``: the request cannot go on, the
    instance called is fine)."""
    task = asyncio.ensure_future(call)
    waiter = asyncio.ensure_future(lost.wait())
    dest_waiters = {asyncio.ensure_future(event.wait()) for event in dest_lost}
    try:
        done, _ = await asyncio.wait({task, waiter} | dest_waiters, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        for w in (waiter, *dest_waiters):
            w.cancel()
    if task not in done:
        task.cancel()
        if waiter in done:
            raise Unreachable("the instance stopped answering polls")
        raise KVWriteFailed("the instance receiving the KV, or its reservation there, was lost")
    return task.result()
