"""bench.chaos: well-formed requests and how their answers are judged (completed, an error with an
OpenAI body, a broken stream, hung)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.chaos.config import CHAT, COMPLETED, HTTP_ERROR, HUNG, PROMPTS, STREAM_ERROR, UNCLEAR
from bench.harness import sse_events

@dataclass
class Outcome:
    """One well-formed request: what came back."""

    phase: str
    prompt: int  # index into PROMPTS
    stream: bool
    result: str = HUNG
    status: int | None = None
    text: str = ""
    error: str = ""
    retry_after: bool | None = None  # for 429 / 503: whether Retry-After was sent
    latency_s: float = 0.0
    long_key: str = ""  # a long prompt (bench.chaos.load): which one; prompt is then -1


def request_body(prompt: int, stream: bool, max_tokens: int) -> dict[str, Any]:
    path, text = PROMPTS[prompt]
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def _is_error_body(raw: bytes) -> bool:
    """Whether ``raw`` is an OpenAI error object: a clear answer, not just any non-200."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str)


def choice_text(chunk: dict[str, Any], path: str) -> str | None:
    """The text of choice 0 in a response or stream chunk (None when the chunk carries no choice)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if path == CHAT:
        part = c.get("delta") if "delta" in c else c.get("message")
        return (part or {}).get("content") or ""
    return c.get("text") or ""


def parse_sse(lines: list[str], path: str) -> tuple[str, str, str]:
    """(result, text, error) of an SSE body: completed only with ``[DONE]`` and no error event."""
    try:
        stream = sse_events(lines)
    except ValueError as e:
        return UNCLEAR, "", f"broken stream: {str(e)[:200]}"
    text = "".join(t for chunk in stream.events if (t := choice_text(chunk, path)) is not None)
    if stream.error is not None:
        return STREAM_ERROR, text, str(stream.error)[:300]
    if not stream.done:
        return UNCLEAR, text, "stream ended without [DONE]"
    return COMPLETED, text, ""


async def _exchange(client: httpx.AsyncClient, base_url: str, out: Outcome, max_tokens: int,
                    override: tuple[str, dict[str, Any]] | None = None) -> None:
    path, body = override or (PROMPTS[out.prompt][0], request_body(out.prompt, out.stream, max_tokens))
    async with client.stream("POST", base_url + path, json=body) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            raw = await resp.aread()
            out.result = HTTP_ERROR if _is_error_body(raw) else UNCLEAR
            out.error = raw[:300].decode("utf-8", "replace")
            if resp.status_code in (429, 503):
                out.retry_after = "retry-after" in resp.headers
            return
        if out.stream:
            lines = [line async for line in resp.aiter_lines()]
            out.result, out.text, out.error = parse_sse(lines, path)
            return
        raw = await resp.aread()
    try:
        answer = json.loads(raw)
        text = choice_text(answer, path)
        finished = answer["choices"][0]["finish_reason"] is not None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        out.result, out.error = UNCLEAR, f"unparseable 200 body: {raw[:200]!r}"
        return
    out.result = COMPLETED if text is not None and finished else UNCLEAR
    out.text = text or ""


async def send(client: httpx.AsyncClient, base_url: str, out: Outcome, max_tokens: int,
               deadline_s: float, override: tuple[str, dict[str, Any]] | None = None) -> Outcome:
    """Send one well-formed request (``override``: its path and body instead of ``out.prompt``'s);
    ``out`` says what came back (hung when nothing did in time)."""
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(_exchange(client, base_url, out, max_tokens, override), deadline_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        out.result, out.error = HUNG, f"no answer within {deadline_s:g} s"
    except httpx.HTTPError as e:  # a dropped connection is no answer a client can act on
        out.result, out.error = UNCLEAR, f"{type(e).__name__}: {e}"[:300]
    out.latency_s = time.monotonic() - t0
    return out
