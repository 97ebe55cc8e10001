"""An instance's HTTP routes for the Conductor (all under ``/instance``, all authenticated with
signed requests, ``cluster/protocol/``), and ``/health`` / ``/stats``:

* ``GET  /instance/info``     role, model facts, KV page layout, measured profile (``InstanceInfo``)
* ``GET  /instance/state``    load, free blocks, and the cached prefix keys, as changes since
  ``since`` (``InstanceState``)
* ``POST /instance/reserve``  hold blocks + a receive-staging range for a prompt's KV (a lease);
  507 when there is no room now
* ``POST /instance/renew``    extend the leases of the Conductor's reservations here
* ``POST /instance/prefill``  (prefill) compute a prompt, stream its KV layer by layer into the
  given destination, answer the first token once the last layer has been written; a caller
  that hangs up first (its client left, or it died) ends the prefill at once
* ``POST /instance/generate`` (decode/both) stream the rest of a request as NDJSON
  ``RequestOutput`` deltas: from a reservation whose KV has landed, or from the prompt (both;
  decode: a request the Conductor has it prefill itself)
* ``POST /instance/abort``    drop a request wherever it is (idempotent)
* ``POST /instance/push``     (prefill) send cached prefix blocks into another instance's
  reservation; ``POST /instance/adopt`` there keeps them as cached blocks
* ``POST /instance/role``     (prefill/decode) switch to the other role (``SwitchRoleRequest``,
  a Conductor with ``--elastic-roles``): new work is refused while it drains what it holds
  (``roles.py``); its state shows the switch and, once drained, the new role
* ``POST /instance/stage/join`` (a first pipeline stage whose later stages are started by hand,
  ``cluster.cpp.group``) a later stage takes its ``StageSpec``, then its links; signed with the
  instances' key (``INSTANCE``), not the Conductors' (``CONTROL``)
* ``GET|POST /instance/failpoints`` only in a process started with ``MOONCAKE_FAILPOINTS=1``
  (``cluster.failpoints``, for ``bench.faults``): arm faults with ``{"arm": {name: times}}``;
  both answer what is armed and what fired

Every call carries the calling Conductor's id and epoch (``Fence``, header ``X-Conductor-Epoch``,
inside the signed material): several Conductors call side by side; a newer epoch of one id makes
the instance release that id's older reservations; a reservation by an older one is refused
(409, ``WrongEpoch``). A call must be signed for this instance's advertised URL (its
``--url``), so one captured on its way to another instance is refused here; its signature is
checked from the headers before any body is read, and a body is read only up to its route's cap
(413 ``TooLarge`` beyond: ``NO_BODY`` for polls, ``PROMPT_BODY`` for calls carrying a prompt,
``SMALL_BODY`` for the rest). Bodies and answers are the messages of ``cluster/protocol/``; a refusal is one
of its ``ProtocolError``s, with its status (``_as_protocol_error`` says which exception is which).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cluster.failpoints import FAILPOINTS
from cluster.instance.roles import Work
from cluster.instance.service import InstanceService
from cluster.kv_stream import KVDestination
from cluster.cpp.group import peer_from
from cluster.messenger import TransferError
from cluster.protocol import (
    ANSWER_SIGNATURE_HEADER, CONTROL, EPOCH_HEADER, INSTANCE, AnswerSigner, ControlVerifier, Fence, derive_key,
    verify_request)
from cluster.protocol import NO_BODY, PROMPT_BODY, SMALL_BODY
from cluster.protocol import (
    AbortReply, AbortRequest, AdoptReply, AdoptRequest, BadRequest, GenerateRequest, InstanceBusy, InstanceFailed,
    InstanceNotReady, KVWriteFailed, NoKVRoom, PrefillReply, PrefillRequest, PrestageReply, PrestageRequest,
    ProtocolError, PushReply,
    PushRequest, RenewReply, RenewRequest, RequestFailed, ReserveReply, ReserveRequest, StageJoin, StageSpecReply,
    SwitchRoleRequest, stream_line)
from engine.disaggregation import KVCapacityError
from engine.engine_client import EngineError, EngineNotReady, EngineOverloaded
from engine.engine_client import RequestFailed as EngineRequestFailed
from engine.outputs import RequestOutput

Handler = Callable[[Request], Awaitable[Response]]

_JOIN_WAIT_S = 60.0  # how long one stage-join call waits for the rest of the group


def _answer(e: ProtocolError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(e.retry_after)))} if isinstance(e, InstanceBusy) else None
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)


def _as_protocol_error(e: Exception) -> ProtocolError:
    """The protocol's name for an exception raised while serving a control call; anything not
    named here is a bug, and re-raised."""
    if isinstance(e, ProtocolError):
        return e
    if isinstance(e, EngineOverloaded):
        return InstanceBusy(str(e), e.retry_after)
    if isinstance(e, KVCapacityError):
        return NoKVRoom(f"no room for the KV: {e}")
    if isinstance(e, ValueError):  # the engine's checks of a request (JSON errors are ValueErrors)
        return BadRequest(str(e))
    if isinstance(e, TransferError):
        return KVWriteFailed(f"KV transfer failed: {e}")
    if isinstance(e, TimeoutError):  # staging stayed full for a transfer timeout
        return InstanceBusy(str(e) or "timed out waiting for staging")
    if isinstance(e, EngineRequestFailed):  # the request's own failure: the engine goes on
        return RequestFailed(str(e))
    if isinstance(e, (EngineError, EngineNotReady)):
        return InstanceFailed(str(e))
    raise e


async def _body(request: Request) -> object:
    try:
        return await request.json()
    except ValueError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None


class InstanceRoutes:
    def __init__(self, service: InstanceService) -> None:
        self.s = service
        # One verifier for every route, so a nonce seen by one is a replay on all; it takes only
        # calls signed for the URL this instance advertises (and registers with).
        self._verifier = ControlVerifier(derive_key(service.config.secret, CONTROL), audiences=[service.config.url])
        # A later pipeline stage joining is an instance, and signs with the instances' key.
        self._stage_verifier = ControlVerifier(derive_key(service.config.secret, INSTANCE),
                                               audiences=[service.config.url])
        # Every answer to a control call is signed with the instances' key, bound to the call.
        self._signer = AnswerSigner(derive_key(service.config.secret, INSTANCE))

    def _control(self, roles: tuple[str, ...] | None = None, needs_ready: bool = True,
                 max_body: int = SMALL_BODY, verifier: ControlVerifier | None = None) -> Callable[[Handler], Handler]:
        """Wrap a control route: authenticate (before reading the body, which is read only up to
        ``max_body`` bytes; ``verifier``: the key its callers sign with, by default the
        Conductors'), note the Conductor's fence, check readiness and role, map the exceptions
        it raises to status codes, and sign the answer, whatever it is (``_signed``)."""

        def wrap(handler: Handler) -> Handler:
            async def route(request: Request) -> Response:
                return self._signed(request, await checked(request))

            async def checked(request: Request) -> Response:
                s = self.s
                if (denied := await verify_request(verifier or self._verifier, request, max_body)) is not None:
                    return _answer(denied)
                if needs_ready and not s.ready:
                    # "fatal": the engine could not start and will not by itself (a bad model, say).
                    return _answer(InstanceNotReady(s.error or "instance is starting", fatal=s.error is not None))
                if roles is not None and s.role not in roles:
                    if s.roles.switches:  # the caller has not seen the switch yet: not the request's fault
                        return _answer(InstanceBusy(f"this instance serves {s.role} now", 1.0))
                    return _answer(BadRequest(f"a {s.role} instance does not do this"))
                try:
                    fence = _fence(request)
                    confirmed = await s.epochs.check(fence)  # ``WrongEpoch`` for one its claim does not carry
                    if s.receiver is not None:
                        await s.receiver.observe(fence, confirmed)
                    return await handler(request)
                except Exception as e:  # noqa: BLE001 -- mapped to a status, or re-raised
                    return _answer(_as_protocol_error(e))

            return route

        return wrap

    def _signed(self, request: Request, response: Response) -> Response:
        """``response`` signed for the call ``request`` (``cluster.protocol.AnswerSigner``): a
        whole answer in a header, a streamed one line by line."""
        if isinstance(response, StreamingResponse):
            response.body_iterator = _signed_lines(self._signer, request, response.body_iterator)
        else:
            response.headers[ANSWER_SIGNATURE_HEADER] = self._signer.answer(request.headers, response.status_code,
                                                                             response.body)
        return response

    # -- polled ------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        s = self.s
        if s.ready and s.client.is_ready:
            return JSONResponse({"status": "ok", "role": s.role})
        return JSONResponse({"status": "error" if s.error else "starting", "error": s.error}, status_code=503)

    async def stats(self, request: Request) -> Response:
        return JSONResponse(self.s.stats())

    async def info(self, request: Request) -> Response:
        return JSONResponse(self.s.info().to_dict())

    async def state(self, request: Request) -> Response:
        since = request.query_params.get("since")
        if since and not (since.isascii() and since.isdigit() and int(since) < 1 << 63):
            # A cache version this instance gave out: a non-negative int64.
            raise BadRequest(f"since must be a cache version (a non-negative integer), not {since[:40]!r}")
        return JSONResponse(self.s.state(int(since) if since else None).to_dict())

    # -- requests ----------------------------------------------------------------------------------
    async def reserve(self, request: Request) -> Response:
        r = ReserveRequest.from_dict(await _body(request))
        with self.s.roles.work(Work.RESERVE):
            dest = await self.s.receiver.reserve(r.request_id, r.prompt_token_ids, r.params, _fence(request), r.session)
        return JSONResponse(ReserveReply(dest.to_dict()).to_dict())

    async def renew(self, request: Request) -> Response:
        r = RenewRequest.from_dict(await _body(request))
        return JSONResponse(RenewReply(self.s.receiver.renew(r.request_ids, _fence(request))).to_dict())

    async def prefill(self, request: Request) -> Response:
        r = PrefillRequest.from_dict(await _body(request))
        with self.s.roles.work(Work.PREFILL):
            self.s.work.claim(r.request_id, _fence(request).conductor, len(r.prompt_token_ids),
                              self.s.cached_tokens(r.prompt_token_ids, r.params.cache_salt))
            try:
                return await self._prefill(request, r)
            finally:
                self.s.work.let_go(r.request_id)

    async def _prefill(self, request: Request, r: PrefillRequest) -> Response:
        work = asyncio.ensure_future(
            self.s.prefiller.prefill(r.request_id, r.prompt_token_ids, r.params, KVDestination.from_dict(r.dest),
                                     r.session))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                # The Conductor hung up (it died, or its client left): nobody will take this KV.
                # Cancelling ends the engine request and lets go of the staging as on any error.
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                return Response(status_code=499)
            return JSONResponse(PrefillReply(work.result()).to_dict())
        finally:
            gone.cancel()

    async def generate(self, request: Request) -> Response:
        r = GenerateRequest.from_dict(await _body(request))
        fence = _fence(request)
        work, rid = self.s.work, r.request_id
        if r.prefilled is None:
            # A decode instance computes the prompt itself where the Conductor chose local prefill.
            stream = self.s.decoder.whole(rid, r.prompt_token_ids, r.params, r.session)
            cached = self.s.cached_tokens(r.prompt_token_ids, r.params.cache_salt)
        else:
            self.s.receiver.check_owner(rid, fence)  # another Conductor's KV is not to take
            stream = self.s.decoder.continue_decode(rid, r.prefilled, r.session)
            cached = len(r.prompt_token_ids)
        # Until ``let_go`` an abort from another Conductor is refused (``NotOwner``), and so is a
        # second run of the id for another.
        work.claim(rid, fence.conductor, len(r.prompt_token_ids), cached, prefilling=r.prefilled is None)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            work.let_go(rid)
            raise InstanceFailed("the engine ended the request without output") from None
        except BaseException:
            work.let_go(rid)
            raise
        return StreamingResponse(_ndjson(first, stream, lambda out: work.decoding(rid, len(out.new_token_ids)),
                                         lambda: work.let_go(rid)),
                                 media_type="application/x-ndjson")

    async def abort(self, request: Request) -> Response:
        r = AbortRequest.from_dict(await _body(request))
        fence = _fence(request)
        self.s.work.check(r.request_id, fence.conductor)
        if self.s.receiver is not None:
            self.s.receiver.check_owner(r.request_id, fence)
        if self.s.client.is_ready:
            await self.s.client.abort(r.request_id)  # a live request (its stream ends with "abort")
        if self.s.receiver is not None:
            await self.s.receiver.release(r.request_id, settled=r.writes_done, fence=fence)
        # A stream whose caller left before its first byte never ran its end: its owner goes here.
        self.s.work.let_go(r.request_id)
        return JSONResponse(AbortReply(r.request_id).to_dict())

    async def push(self, request: Request) -> Response:
        r = PushRequest.from_dict(await _body(request))
        with self.s.roles.work(Work.PUSH):
            pushed = await self.s.replicator.push(r.request_id, r.prompt_token_ids, KVDestination.from_dict(r.dest),
                                                r.cache_salt)
        return JSONResponse(PushReply(pushed).to_dict())

    async def adopt(self, request: Request) -> Response:
        r = AdoptRequest.from_dict(await _body(request))
        self.s.receiver.check_owner(r.request_id, _fence(request))
        return JSONResponse(AdoptReply(await self.s.replicator.adopt(r.request_id, r.ok)).to_dict())

    async def prestage(self, request: Request) -> Response:
        r = PrestageRequest.from_dict(await _body(request))
        if self.s.pool is None:
            raise BadRequest("this instance has no KVCache pool")
        return JSONResponse(PrestageReply(await self.s.pool.prestage(r.token_ids, r.session, r.cache_salt)).to_dict())

    async def switch_role(self, request: Request) -> Response:
        r = SwitchRoleRequest.from_dict(await _body(request))
        return JSONResponse(self.s.switch_role(r.role, _fence(request), r.drain_s).to_dict())

    async def stage_join(self, request: Request) -> Response:
        """A later pipeline stage started by hand: without ``peer``, its ``StageSpec``; with it,
        its links once every stage has joined (a wait of up to a minute per call: 503 while
        stages are missing, and the stage asks again)."""
        rendezvous = self.s.rendezvous
        if rendezvous is None:
            raise BadRequest("this instance leads no pipeline group that stages join")
        join = StageJoin.from_dict(await _body(request))
        if join.stages != rendezvous.stages:
            raise BadRequest(f"a join names its group, its stage and the group's size ({rendezvous.stages})")
        loop = asyncio.get_running_loop()
        try:
            if join.peer is None:
                spec = await loop.run_in_executor(None, rendezvous.spec, join.group, join.stage, _JOIN_WAIT_S)
                return JSONResponse(StageSpecReply(spec).to_dict())
            try:
                peer = peer_from(join.peer)
            except (KeyError, TypeError, ValueError) as e:
                raise BadRequest(f"malformed peer: {e}") from None
            links = await loop.run_in_executor(None, rendezvous.join, join.group, join.stage, peer, _JOIN_WAIT_S)
        except TimeoutError as e:  # the group is still forming: the stage asks again
            raise InstanceNotReady(str(e)) from None
        return JSONResponse(links.to_dict())

    async def failpoints(self, request: Request) -> Response:
        if request.method == "POST":
            body = await _body(request)
            arm = body.get("arm") if isinstance(body, dict) else None
            if not isinstance(arm, dict):
                raise BadRequest('the body is {"arm": {failpoint: times}}')
            FAILPOINTS.arm(arm)
        return JSONResponse(FAILPOINTS.state())

    def routes(self) -> list[Route]:
        c = self._control
        failpoints = ([Route("/instance/failpoints", c(needs_ready=False)(self.failpoints), methods=["GET", "POST"])]
                      if FAILPOINTS.enabled else [])
        return failpoints + [
            Route("/health", self.health, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/instance/info", c(max_body=NO_BODY)(self.info), methods=["GET"]),
            Route("/instance/state", c(max_body=NO_BODY)(self.state), methods=["GET"]),
            Route("/instance/reserve", c(max_body=PROMPT_BODY)(self.reserve), methods=["POST"]),
            Route("/instance/renew", c()(self.renew), methods=["POST"]),
            Route("/instance/prefill", c(("prefill",), max_body=PROMPT_BODY)(self.prefill), methods=["POST"]),
            Route("/instance/generate", c(("decode", "both"), max_body=PROMPT_BODY)(self.generate), methods=["POST"]),
            # An abort must work while starting too: it only ever frees things.
            Route("/instance/abort", c(needs_ready=False)(self.abort), methods=["POST"]),
            Route("/instance/push", c(("prefill", "both"), max_body=PROMPT_BODY)(self.push), methods=["POST"]),
            Route("/instance/adopt", c()(self.adopt), methods=["POST"]),
            Route("/instance/prestage", c(max_body=PROMPT_BODY)(self.prestage), methods=["POST"]),
            Route("/instance/role", c(("prefill", "decode"))(self.switch_role), methods=["POST"]),
            Route("/instance/stage/join", c(("prefill",), needs_ready=False, verifier=self._stage_verifier)(
                self.stage_join), methods=["POST"]),
        ]


async def _disconnected(request: Request) -> None:
    """Returns once the caller has closed its connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _fence(request: Request) -> Fence:
    return Fence.parse(request.headers.get(EPOCH_HEADER, "0"))


async def _ndjson(first: RequestOutput, stream: AsyncIterator[RequestOutput],
                  sent: Callable[[RequestOutput], None], ended: Callable[[], None]) -> AsyncIterator[bytes]:
    # Leaving early (the Conductor disconnected) closes ``stream``, which aborts the request.
    try:
        sent(first)
        yield stream_line(first)
        if first.finished:
            return
        async for out in stream:
            sent(out)
            yield stream_line(out)
    except (EngineError, EngineNotReady, ValueError, ProtocolError) as e:
        yield stream_line(_as_protocol_error(e))
    finally:
        await stream.aclose()
        ended()


async def _signed_lines(signer: AnswerSigner, request: Request, lines: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    # Each chunk a streaming route yields is one whole line (``stream_line``).
    # Closed however this ends: a caller that left ends the route's own stream (and aborts) now.
    async with contextlib.aclosing(lines):
        index = 0
        async for line in lines:
            yield signer.line(request.headers, index, line.rstrip(b"\n"))
            index += 1


def build_instance_app(service: InstanceService) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):
        await service.start()
        try:
            yield
        finally:
            await service.shutdown()

    return Starlette(routes=InstanceRoutes(service).routes(), lifespan=lifespan)
