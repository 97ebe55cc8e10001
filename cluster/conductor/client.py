"""The instance client: the only place the Conductor speaks HTTP to instances.

Typed calls, each with a bound, and one error mapping:

* no answer, a timeout, a broken connection or a 5xx: ``InstanceUnavailable`` (the caller marks
  the instance down);
* 400: ``ValueError`` (the request itself is bad; the client gets a 400 too);
* 404 / 409 / 502: ``InstanceRefused`` (no such reservation, stale Conductor, prefix no longer
  cached; a KV write to *another* instance failed, which says nothing against this one);
* 429 / 503: ``InstanceBusy`` with the Retry-After the instance gave;
* 507: ``InstanceFull`` (no room for the KV now; the next instance may have it).

Every control call has a timeout of ``control_timeout_s``. The two long calls, a prefill and a
decode stream, last as long as the work does; they are bounded by ``request_timeout_s`` and end
early, with ``InstanceUnavailable``, when the registry loses the instance (``lost`` is set: it
stopped answering polls), so a wedged instance never hangs a request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import httpx

from cluster.protocol import CONTROL, ControlAuth, derive_key
from cluster.protocol import EPOCH_HEADER, output_from_dict, params_to_dict
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

T = TypeVar("T")


class InstanceUnavailable(RuntimeError):
    """The instance did not answer (in time), or failed: it should be marked down."""


class InstanceRefused(RuntimeError):
    """The instance answered that it will not do this (404, 409)."""


class InstanceBusy(RuntimeError):
    """The instance has too much waiting (429) or no staging free (503) right now."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class InstanceFull(RuntimeError):
    """No room for the request's KV on the instance now (507)."""


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
        return str(body.get("error", body)) if isinstance(body, dict) else str(body)
    except ValueError:
        return r.text[:300]


def _raise_for(r: httpx.Response, what: str) -> None:
    code = r.status_code
    if code == 200:
        return
    text = f"{what}: HTTP {code}: {_message(r)}"
    if code == 400:
        raise ValueError(_message(r))
    if code in (404, 409, 502):
        raise InstanceRefused(text)
    if code in (429, 503) and not (code == 503 and "fatal" in (r.text or "")):
        try:
            retry = float(r.headers.get("retry-after", "1"))
        except ValueError:
            retry = 1.0
        raise InstanceBusy(text, retry)
    if code == 507:
        raise InstanceFull(text)
    raise InstanceUnavailable(text)


class InstanceClient:
    def __init__(self, secret: bytes, epoch: int, control_timeout_s: float = 10.0,
                 request_timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """``transport``: where the calls go (tests pass an ``httpx.MockTransport``)."""
        self.control_timeout_s = control_timeout_s
        self.request_timeout_s = request_timeout_s
        # Each call is signed with a key derived from the secret; the secret never travels.
        # No connection limit: a prefill or a decode stream holds its connection for as long as
        # the work lasts, and a bounded pool would make every other call (an abort, a poll)
        # queue behind them until it timed out. Polls get a client of their own all the same,
        # so the health of an instance is never judged by how busy the request path is.
        kwargs = dict(auth=ControlAuth(derive_key(secret, CONTROL)), headers={EPOCH_HEADER: str(epoch)},
                      timeout=httpx.Timeout(control_timeout_s), transport=transport,
                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))
        self._http = httpx.AsyncClient(**kwargs)
        self._polls = httpx.AsyncClient(**kwargs)

    async def close(self) -> None:
        await self._http.aclose()
        await self._polls.aclose()

    async def _post(self, url: str, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        try:
            r = await self._http.post(url + path, json=body, timeout=timeout or self.control_timeout_s)
        except httpx.HTTPError as e:
            raise InstanceUnavailable(f"{path}: {type(e).__name__}: {e}") from None
        _raise_for(r, path)
        return r.json()

    async def _get(self, url: str, path: str, timeout: float) -> dict[str, Any]:
        try:
            r = await self._polls.get(url + path, timeout=timeout)
        except httpx.HTTPError as e:
            raise InstanceUnavailable(f"{path}: {type(e).__name__}: {e}") from None
        if r.status_code == 503:
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            raise InstanceStarting(body.get("error") or "starting", fatal=body.get("fatal") is True)
        _raise_for(r, path)
        return r.json()

    # -- polls ---------------------------------------------------------------------------------------
    async def info(self, url: str, timeout: float) -> dict[str, Any]:
        return await self._get(url, "/instance/info", timeout)

    async def state(self, url: str, since: int | None, timeout: float) -> dict[str, Any]:
        return await self._get(url, "/instance/state" + ("" if since is None else f"?since={since}"), timeout)

    # -- reservations --------------------------------------------------------------------------------
    async def reserve(self, url: str, request_id: str, token_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        body = {"request_id": request_id, "prompt_token_ids": token_ids, "params": params_to_dict(params)}
        return (await self._post(url, "/instance/reserve", body))["dest"]

    async def renew(self, url: str, request_ids: list[str]) -> list[str]:
        """Extend the leases; returns the ids the instance no longer holds."""
        return (await self._post(url, "/instance/renew", {"request_ids": request_ids}))["gone"]

    async def abort(self, url: str, request_id: str, writes_done: bool = False) -> None:
        await self._post(url, "/instance/abort", {"request_id": request_id, "writes_done": writes_done})

    async def push(self, url: str, request_id: str, token_ids: list[int], dest: dict[str, Any]) -> int:
        body = {"request_id": request_id, "prompt_token_ids": token_ids, "dest": dest}
        return (await self._post(url, "/instance/push", body))["pushed"]

    async def adopt(self, url: str, request_id: str, ok: bool) -> int:
        return (await self._post(url, "/instance/adopt", {"request_id": request_id, "ok": ok}))["adopted"]

    # -- the long calls ------------------------------------------------------------------------------
    async def prefill(self, url: str, request_id: str, token_ids: list[int], params: SamplingParams,
                      dest: dict[str, Any], lost: asyncio.Event) -> RequestOutput:
        body = {"request_id": request_id, "prompt_token_ids": token_ids, "params": params_to_dict(params),
                "dest": dest}
        data = await _unless(lost, self._post(url, "/instance/prefill", body, timeout=self.request_timeout_s))
        return output_from_dict(data["output"])

    async def generate(self, url: str, body: dict[str, Any], lost: asyncio.Event) -> AsyncIterator[RequestOutput]:
        """POST /instance/generate and yield its NDJSON deltas until the finished one."""
        timeout = httpx.Timeout(self.control_timeout_s, read=self.request_timeout_s)
        try:
            async with self._http.stream("POST", url + "/instance/generate", json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    await r.aread()
                    _raise_for(r, "/instance/generate")
                lines = r.aiter_lines()
                while True:
                    try:
                        line = await _unless(lost, anext(lines))
                    except StopAsyncIteration:
                        raise InstanceUnavailable("the stream ended before the request finished") from None
                    if not line:
                        continue
                    data = json.loads(line)
                    if "error" in data:
                        raise InstanceUnavailable(f"the instance failed the request: {data['error']}")
                    out = output_from_dict(data)
                    yield out
                    if out.finished:
                        return
        except httpx.HTTPError as e:
            raise InstanceUnavailable(f"/instance/generate: {type(e).__name__}: {e}") from None


class InstanceStarting(RuntimeError):
    """The instance answers but is not ready (503 on a poll); ``fatal``: it never will be."""

    def __init__(self, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


async def _unless(lost: asyncio.Event, call: Awaitable[T]) -> T:
    """Await ``call`` unless the instance is lost first (then ``InstanceUnavailable``)."""
    task = asyncio.ensure_future(call)
    waiter = asyncio.ensure_future(lost.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task not in done:
        task.cancel()
        raise InstanceUnavailable("the instance stopped answering polls")
    return task.result()
