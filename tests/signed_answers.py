"""Mock instances that sign their answers as real ones do (``cluster.protocol.AnswerSigner``), for
tests that run the real Conductor client against an ``httpx.MockTransport``."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from cluster.protocol import ANSWER_SIGNATURE_HEADER, INSTANCE, AnswerSigner, derive_key

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


def signed_transport(handler: Handler, secret: bytes) -> httpx.MockTransport:
    """``httpx.MockTransport(handler)`` whose answers are signed with the instances' key for the
    call they answer: a whole answer in its header, a streamed one (``content`` an async
    iterator of lines) line by line."""
    key = derive_key(secret, INSTANCE)

    async def signed(request: httpx.Request) -> httpx.Response:
        answer = handler(request)
        if inspect.isawaitable(answer):
            answer = await answer
        signer = AnswerSigner(key)
        if isinstance(answer.stream, httpx.AsyncByteStream) and not hasattr(answer, "_content"):
            lines = answer.stream

            async def signed_lines() -> AsyncIterator[bytes]:
                index = 0
                async for line in lines:
                    yield signer.line(request.headers, index, line.rstrip(b"\n"))
                    index += 1

            return httpx.Response(answer.status_code, headers=answer.headers, content=signed_lines())
        body = answer.read()
        return httpx.Response(answer.status_code, content=body, headers={
            **{k: v for k, v in answer.headers.items() if k.lower() != "content-length"},
            ANSWER_SIGNATURE_HEADER: signer.answer(request.headers, answer.status_code, body)})

    return httpx.MockTransport(signed)
