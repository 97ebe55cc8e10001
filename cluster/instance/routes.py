"""An instance's HTTP routes for the Conductor (all under ``/instance``, all authenticated with
signed requests, ``cluster/protocol.py``), and ``/health`` / ``/stats``:

* ``GET  /instance/info``     role, model facts, KV page layout, Messenger address, measured profile
* ``GET  /instance/state``    load, free blocks, and the cached prefix keys (changes since ``since``)
* ``POST /instance/reserve``  hold blocks + a receive-staging range for a prompt's KV (a lease);
  507 when there is no room now
* ``POST /instance/renew``    extend the leases of the Conductor's reservations here
* ``POST /instance/prefill``  (prefill) compute a prompt, stream its KV layer by layer into the
  given destination, answer the first token once the last layer has been written
* ``POST /instance/generate`` (decode/both) stream the rest of a request as NDJSON
  ``RequestOutput`` deltas: from a reservation whose KV has landed, or (both) from the prompt
* ``POST /instance/abort``    drop a request wherever it is (idempotent)
* ``POST /instance/push``     (prefill) send cached prefix blocks into another instance's
  reservation; ``POST /instance/adopt`` there keeps them as cached blocks
* ``POST /instance/stage/join`` (a first pipeline stage whose later stages are started by hand,
  ``cluster.cpp.group``) a later stage takes its ``StageSpec``, then its links

Every call carries the Conductor's epoch (header ``X-Conductor-Epoch``): a newer one makes the
instance release the older Conductor's reservations; an older one is refused (409).
Status codes: 400 bad request, 404 unknown reservation, 409 stale Conductor, 429 too many
waiting (with Retry-After), 502 a KV write failed, 503 not ready / staging busy, 507 no room.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cluster.instance.receiver import StaleEpoch
from cluster.instance.service import InstanceService
from cluster.instance.kv_stream import KVDestination
from cluster.cpp.group import peer_from
from cluster.messenger import TransferError
from cluster.protocol import CONTROL, ControlVerifier, derive_key, verify_request
from cluster.protocol import EPOCH_HEADER, output_to_dict, params_from_dict, token_ids
from engine.disaggregation import KVCapacityError
from engine.engine_client import EngineError, EngineNotReady, EngineOverloaded

Handler = Callable[[Request], Awaitable[Response]]

_JOIN_WAIT_S = 60.0  # how long one stage-join call waits for the rest of the group


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def _mapped(e: BaseException) -> JSONResponse:
    """The status code of an exception raised while serving a control call."""
    if isinstance(e, EngineOverloaded):
        return _error(429, str(e), **{"Retry-After": str(max(1, round(e.retry_after)))})
    if isinstance(e, KVCapacityError):
        return _error(507, f"no room for the KV: {e}")
    if isinstance(e, StaleEpoch):
        return _error(409, str(e))
    if isinstance(e, LookupError):
        return _error(404, str(e))
    if isinstance(e, (ValueError, json.JSONDecodeError)):
        return _error(400, str(e))
    if isinstance(e, TransferError):
        return _error(502, f"KV transfer failed: {e}")
    if isinstance(e, TimeoutError):
        return _error(503, str(e) or "timed out")
    if isinstance(e, (EngineError, EngineNotReady)):
        return _error(500, str(e))
    raise e


async def _request_body(request: Request) -> tuple[str, dict[str, Any]]:
    body = await request.json()
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    rid = body.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise ValueError("request_id must be a non-empty string")
    return rid, body


class InstanceRoutes:
    def __init__(self, service: InstanceService) -> None:
        self.s = service
        # One verifier for every route, so a nonce seen by one is a replay on all.
        self._verifier = ControlVerifier(derive_key(service.config.secret, CONTROL))

    def _control(self, roles: tuple[str, ...] | None = None, needs_ready: bool = True) -> Callable[[Handler], Handler]:
        """Wrap a control route: authenticate, note the Conductor's epoch, check readiness and
        role, and map the exceptions it raises to status codes."""

        def wrap(handler: Handler) -> Handler:
            async def route(request: Request) -> Response:
                s = self.s
                if (denied := await verify_request(self._verifier, request)) is not None:
                    return _error(401, denied)
                if needs_ready and not s.ready:
                    # "fatal": the engine could not start and will not by itself (a bad model, say).
                    return JSONResponse({"error": s.error or "instance is starting", "fatal": s.error is not None},
                                        status_code=503)
                if roles is not None and s.config.role not in roles:
                    return _error(400, f"a {s.config.role} instance does not do this")
                try:
                    if s.receiver is not None:
                        await s.receiver.observe_epoch(_epoch(request))
                    return await handler(request)
                except Exception as e:  # noqa: BLE001 -- mapped to a status, or re-raised
                    return _mapped(e)

            return route

        return wrap

    # -- polled ------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        s = self.s
        if s.ready and s.client.is_ready:
            return JSONResponse({"status": "ok", "role": s.config.role})
        return JSONResponse({"status": "error" if s.error else "starting", "error": s.error}, status_code=503)

    async def stats(self, request: Request) -> Response:
        return JSONResponse(self.s.stats())

    async def info(self, request: Request) -> Response:
        return JSONResponse(self.s.info())

    async def state(self, request: Request) -> Response:
        since = request.query_params.get("since")
        return JSONResponse(self.s.state(int(since) if since else None))

    # -- requests ----------------------------------------------------------------------------------
    async def reserve(self, request: Request) -> Response:
        rid, body = await _request_body(request)
        ids, params = token_ids(body.get("prompt_token_ids")), params_from_dict(body.get("params"))
        dest = await self.s.receiver.reserve(rid, ids, params, _epoch(request))
        return JSONResponse({"dest": dest.to_dict()})

    async def renew(self, request: Request) -> Response:
        body = await request.json()
        rids = body.get("request_ids") if isinstance(body, dict) else None
        if not isinstance(rids, list) or not all(isinstance(r, str) for r in rids):
            raise ValueError("request_ids must be a list of strings")
        return JSONResponse({"gone": self.s.receiver.renew(rids, _epoch(request))})

    async def prefill(self, request: Request) -> Response:
        rid, body = await _request_body(request)
        ids, params = token_ids(body.get("prompt_token_ids")), params_from_dict(body.get("params"))
        out = await self.s.serving.prefill(rid, ids, params, KVDestination.from_dict(body.get("dest")))
        return JSONResponse({"output": output_to_dict(out)})

    async def generate(self, request: Request) -> Response:
        rid, body = await _request_body(request)
        prefilled = body.get("prefilled")
        if prefilled is None:
            if self.s.config.role != "both":
                raise ValueError("a decode instance only continues requests whose KV it received")
            stream = self.s.serving.whole(rid, token_ids(body.get("prompt_token_ids")), params_from_dict(body.get("params")))
        else:
            if isinstance(prefilled, dict) and isinstance(prefilled.get("sampler_state"), str):
                prefilled = {**prefilled, "sampler_state": base64.b64decode(prefilled["sampler_state"])}
            stream = self.s.serving.continue_decode(rid, prefilled)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            raise EngineError("the engine ended the request without output") from None
        return StreamingResponse(_ndjson(first, stream), media_type="application/x-ndjson")

    async def abort(self, request: Request) -> Response:
        rid, body = await _request_body(request)
        if self.s.client.is_ready:
            await self.s.client.abort(rid)  # a live request (its stream ends with "abort")
        if self.s.receiver is not None:
            await self.s.receiver.release(rid, settled=body.get("writes_done") is True)
        return JSONResponse({"aborted": rid})

    async def push(self, request: Request) -> Response:
        rid, body = await _request_body(request)
        dest = KVDestination.from_dict(body.get("dest"))
        try:
            pushed = await self.s.replicator.push(rid, token_ids(body.get("prompt_token_ids")), dest)
        except ValueError as e:
            return _error(409, str(e))  # the prefix is not (all) cached here any more
        return JSONResponse({"pushed": pushed})

    async def adopt(self, request: Request) -> Response:
        rid, body = await _request_body(request)
        return JSONResponse({"adopted": await self.s.replicator.adopt(rid, body.get("ok") is True)})

    async def stage_join(self, request: Request) -> Response:
        """A later pipeline stage started by hand: without ``peer``, its ``StageSpec``; with it,
        its links once every stage has joined (a wait of up to a minute per call: 503 while
        stages are missing, and the stage asks again)."""
        rendezvous = self.s.rendezvous
        if rendezvous is None:
            raise ValueError("this instance leads no pipeline group that stages join")
        body = await request.json()
        group, stage = body.get("group"), body.get("stage")
        if not isinstance(group, str) or type(stage) is not int or body.get("stages") != rendezvous.stages:
            raise ValueError(f"a join names its group, its stage and the group's size ({rendezvous.stages})")
        loop = asyncio.get_running_loop()
        if body.get("peer") is None:
            spec = await loop.run_in_executor(None, rendezvous.spec, group, stage, _JOIN_WAIT_S)
            return JSONResponse({"spec": spec})
        try:
            peer = peer_from(body["peer"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed peer: {e}") from None
        return JSONResponse(await loop.run_in_executor(None, rendezvous.join, group, stage, peer, _JOIN_WAIT_S))

    def routes(self) -> list[Route]:
        c = self._control
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/instance/info", c()(self.info), methods=["GET"]),
            Route("/instance/state", c()(self.state), methods=["GET"]),
            Route("/instance/reserve", c()(self.reserve), methods=["POST"]),
            Route("/instance/renew", c()(self.renew), methods=["POST"]),
            Route("/instance/prefill", c(("prefill",))(self.prefill), methods=["POST"]),
            Route("/instance/generate", c(("decode", "both"))(self.generate), methods=["POST"]),
            # An abort must work while starting too: it only ever frees things.
            Route("/instance/abort", c(needs_ready=False)(self.abort), methods=["POST"]),
            Route("/instance/push", c(("prefill", "both"))(self.push), methods=["POST"]),
            Route("/instance/adopt", c()(self.adopt), methods=["POST"]),
            Route("/instance/stage/join", c(("prefill",), needs_ready=False)(self.stage_join), methods=["POST"]),
        ]


def _epoch(request: Request) -> int:
    value = request.headers.get(EPOCH_HEADER, "0")
    if not value.isdigit():
        raise ValueError(f"{EPOCH_HEADER} must be a non-negative integer")
    return int(value)


async def _ndjson(first, stream: AsyncIterator) -> AsyncIterator[bytes]:
    # Leaving early (the Conductor disconnected) closes ``stream``, which aborts the request.
    try:
        yield (json.dumps(output_to_dict(first)) + "\n").encode()
        if first.finished:
            return
        async for out in stream:
            yield (json.dumps(output_to_dict(out)) + "\n").encode()
    except (EngineError, EngineNotReady, ValueError) as e:
        yield (json.dumps({"error": str(e)}) + "\n").encode()
    finally:
        await stream.aclose()


def build_instance_app(service: InstanceService) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):
        await service.start()
        try:
            yield
        finally:
            await service.shutdown()

    return Starlette(routes=InstanceRoutes(service).routes(), lifespan=lifespan)
