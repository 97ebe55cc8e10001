"""The Conductor's HTTP routes beside the OpenAI API (``server/app.py``), which ``server/launch.py``
mounts: an instance's registration (``POST /cluster/register``, signed with the instances' key),
and the indexer API (``POST /query``, ``/query_by_hash``, ``/register``, ``/unregister``: the
operator's routes, ``cluster/conductor/indexer.py`` answers them). The Conductor and the indexer
take typed requests and bodies; this file is where HTTP meets them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cluster.conductor.conductor import Conductor
from cluster.conductor.indexer import Indexer, IndexerError
from cluster.protocol import BadRequest, RegisterRequest, Unauthorized, verify_request

log = logging.getLogger(__name__)

# A RegisterRequest is a URL and an id.
REGISTER_BODY_BYTES = 64 << 10


def registration_route(conductor: Conductor) -> Route:
    """``POST /cluster/register``: the signature first, from the headers alone; then at most
    ``REGISTER_BODY_BYTES`` of body: an unsigned or oversized body is never read into memory."""
    async def register(request: Request) -> Response:
        if (denied := await verify_request(conductor.verifier, request, REGISTER_BODY_BYTES)) is not None:
            if isinstance(denied, Unauthorized):
                log.info("registration refused: %s", denied)
            return JSONResponse(denied.to_dict(), status_code=denied.status)
        try:
            body = await request.json()
        except ValueError:
            body = None  # not JSON: refused below as not a JSON object
        try:
            reply = await conductor.register(RegisterRequest.from_dict(body))
        except BadRequest as e:
            return JSONResponse(e.to_dict(), status_code=e.status)
        return JSONResponse(reply.to_dict())
    return Route("/cluster/register", register, methods=["POST"])


def indexer_routes(indexer: Indexer) -> list[Route]:
    """The indexer API's routes (the operator's: ``server/app.py`` checks the key before them)."""

    def answering(handle: Callable[[dict], Awaitable[dict]]) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            try:
                body = await _json_body(request, indexer.max_body_bytes)
                return JSONResponse(await handle(body))
            except IndexerError as e:
                return JSONResponse({"error": str(e)}, status_code=e.status)
        return answer

    return [Route("/query", answering(indexer.query_tokens), methods=["POST"]),
            Route("/query_by_hash", answering(indexer.query_hashes), methods=["POST"]),
            Route("/register", answering(indexer.register), methods=["POST"]),
            Route("/unregister", answering(indexer.unregister), methods=["POST"])]


async def _json_body(request: Request, limit: int) -> dict:
    size = 0
    chunks = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise IndexerError(f"the body is over {limit} bytes (the server's --max-body-bytes)", 413)
        chunks.append(chunk)
    try:
        body = await asyncio.to_thread(json.loads, b"".join(chunks))
    except (ValueError, RecursionError):
        raise IndexerError("the body must be JSON") from None
    if not isinstance(body, dict):
        raise IndexerError("the body must be a JSON object")
    return body
