"""bench.chaos: malformed input: handmade and generated bodies, bad framing, slow clients' raw requests."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx

from bench.chaos.config import CHAT, COMPLETIONS, HOST, HUNG, PROMPTS
from bench.chaos.traffic import request_body


# --------------------------------------------------------------------------- malformed requests


@dataclass
class FuzzCase:
    label: str
    path: str
    body: bytes
    content_type: str = "application/json"


@dataclass
class FuzzOutcome:
    label: str
    path: str
    body: str  # repr of the body (its first 2000 bytes), to reproduce a failure
    body_len: int
    status: int | None = None
    result: str = HUNG  # "answered", "no answer" or "hung"
    reply: str = ""


def _nested(depth: int, open_: bytes = b"[", close: bytes = b"]", inner: bytes = b"") -> bytes:
    return open_ * depth + inner + close * depth


def handmade_cases() -> list[FuzzCase]:
    """Malformed bodies chosen by hand: each class of bad input at least once."""
    ok_prompt = b'"prompt": "Hello", '
    cases = [
        ("empty body", COMPLETIONS, b""),
        ("JSON null", COMPLETIONS, b"null"),
        ("JSON array at the top", CHAT, b"[1, 2, 3]"),
        ("JSON string at the top", COMPLETIONS, b'"prompt"'),
        ("empty object", COMPLETIONS, b"{}"),
        ("truncated JSON", COMPLETIONS, b'{"prompt": "The capital of', ),
        ("truncated chat JSON", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}'),
        ("trailing garbage", COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 2} xyz'),
        ("10k nested lists as prompt", COMPLETIONS, b'{"prompt": ' + _nested(10_000) + b', "max_tokens": 2}'),
        ("500 nested lists as prompt", COMPLETIONS, b'{"prompt": ' + _nested(500) + b', "max_tokens": 2}'),
        ("100k nested lists at the top", CHAT, _nested(100_000)),
        ("10k nested objects as stop", COMPLETIONS,
         b'{' + ok_prompt + b'"max_tokens": 2, "stop": ' + _nested(10_000, b'{"a": ', b"}", b"1") + b"}"),
        ("10k nested lists as messages", CHAT, b'{"messages": ' + _nested(10_000) + b', "max_tokens": 2}'),
        ("max_tokens 1e999", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 1e999}'),
        ("max_tokens 10**400", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 1' + b"0" * 400 + b"}"),
        ("max_tokens with 5000 digits", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 1' + b"0" * 5000 + b"}"),
        ("max_tokens -1", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": -1}'),
        ("max_tokens as string", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": "2"}'),
        ("temperature 10**400", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}"),
        ("temperature NaN", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 2, "temperature": NaN}'),
        ("top_p -Infinity", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 2, "top_p": -Infinity}'),
        ("n 10**9", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 2, "n": 1000000000}'),
        ("logprobs 10**9", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 2, "logprobs": 1000000000}'),
        ("seed -1", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 2, "seed": -1}'),
        ("stream as string", COMPLETIONS, b'{' + ok_prompt + b'"max_tokens": 2, "stream": "yes"}'),
        ("wrong types everywhere", COMPLETIONS,
         b'{"prompt": 5, "max_tokens": [2], "temperature": "hot", "stream": {}, "n": true}'),
        ("invalid UTF-8 bytes in prompt", COMPLETIONS, b'{"prompt": "\xff\xfe\xc3\x28", "max_tokens": 2}'),
        ("invalid UTF-8 bytes in chat", CHAT, b'{"messages": [{"role": "user", "content": "\x80\x80"}], "max_tokens": 2}'),
        ("lone surrogate in prompt", COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("lone surrogate in chat content", CHAT,
         b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}'),
        ("token id out of the vocabulary", COMPLETIONS, b'{"prompt": [1000000000000], "max_tokens": 2}'),
        ("negative token id", COMPLETIONS, b'{"prompt": [5, -3], "max_tokens": 2}'),
        ("5000 prompts in one body", COMPLETIONS, json.dumps({"prompt": ["Hi"] * 5000, "max_tokens": 1}).encode()),
        ("5000 token-id prompts in one body", COMPLETIONS,
         json.dumps({"prompt": [[100, 200]] * 5000, "max_tokens": 1}).encode()),
        ("5000 chat messages", CHAT,
         json.dumps({"messages": [{"role": "user", "content": "Hi"}] * 5000, "max_tokens": 1}).encode()),
        ("10k stop strings", COMPLETIONS,
         json.dumps({"prompt": "Hi", "max_tokens": 2, "stop": ["x"] * 10_000}).encode()),
        ("body over the size limit (2 MiB)", COMPLETIONS,
         b'{"prompt": "' + b"a" * (2 << 20) + b'", "max_tokens": 2}'),
        ("unknown role", CHAT, b'{"messages": [{"role": "wizard", "content": "Hi"}], "max_tokens": 2}'),
        ("content parts of the wrong type", CHAT,
         b'{"messages": [{"role": "user", "content": [{"type": "image", "url": 5}]}], "max_tokens": 2}'),
        ("not JSON at all", CHAT, b"hello world"),
    ]
    return [FuzzCase(label, path, body) for label, path, body in cases]


def _hypothesis():
    try:
        import hypothesis
        from hypothesis import strategies
    except ImportError as exc:  # an optional package: the server never fuzzes itself
        raise ImportError("bench.chaos needs hypothesis: pip install -e '.[bench]'", name=exc.name) from exc
    return hypothesis, strategies


def _fuzz_strategy():
    """Structured requests with bad fields, arbitrary JSON and raw bytes; then maybe truncated or
    with invalid UTF-8 spliced in."""
    _, st = _hypothesis()
    text = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=24)
    # No integer a valid field accepts as "large": a valid max_tokens would make a valid request
    # generate for minutes, which is load, not malformed input.
    bad_int = st.one_of(st.integers(max_value=0), st.integers(min_value=10**6, max_value=10**400))
    leaf = st.one_of(st.none(), st.booleans(), bad_int, st.floats(), text)
    junk = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(text, inner, max_size=4)),
                        max_leaves=12)
    # None would mean "absent", and an absent max_tokens means "up to the context length".
    max_tokens = st.one_of(st.integers(1, 4), junk.filter(lambda v: v is not None))
    sampling = {
        "temperature": st.one_of(st.floats(0, 2), junk),
        "top_p": st.one_of(st.floats(0, 1), junk),
        "top_k": st.one_of(st.integers(-1, 50), junk),
        "n": st.one_of(st.integers(1, 3), junk),
        "stream": st.one_of(st.booleans(), junk),
        "stream_options": st.one_of(st.just({"include_usage": True}), junk),
        "stop": st.one_of(st.lists(text, max_size=3), junk),
        "seed": st.one_of(st.integers(0, 2**32), junk),
        "model": junk,
        "presence_penalty": junk,
        "user": junk,
    }
    prompt = st.one_of(st.sampled_from([p for path, p in PROMPTS if path == COMPLETIONS]),
                       st.lists(st.integers(100, 2000), min_size=1, max_size=8), junk)
    completion = st.fixed_dictionaries({"prompt": prompt, "max_tokens": max_tokens},
                                       optional={**sampling, "logprobs": st.one_of(st.integers(0, 5), junk)})
    message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), junk),
                                     "content": st.one_of(text, junk)})
    chat = st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(message, max_size=3), junk), "max_tokens": max_tokens},
        optional={**sampling, "logprobs": junk, "top_logprobs": junk,
                  "max_completion_tokens": st.one_of(st.integers(1, 4), junk.filter(lambda v: v is not None))})
    extras = st.dictionaries(text, junk, max_size=2)

    @st.composite
    def case(draw) -> FuzzCase:
        kind = draw(st.sampled_from(["completion", "chat", "json", "bytes"]))
        path = CHAT if kind == "chat" else COMPLETIONS if kind == "completion" else draw(
            st.sampled_from([COMPLETIONS, CHAT]))
        if kind == "bytes":
            return FuzzCase("hypothesis: raw bytes", path, draw(st.binary(max_size=200)))
        if kind == "json":
            value: Any = draw(junk)
        else:
            # The known fields win over a colliding extra key, so max_tokens stays small or invalid.
            value = {**draw(extras), **draw(chat if kind == "chat" else completion)}
        body = json.dumps(value).encode()
        mutation = draw(st.sampled_from(["none", "truncate", "invalid utf-8", "flip byte"]))
        if mutation != "none" and body:
            at = draw(st.integers(0, len(body) - 1))
            if mutation == "truncate":
                body = body[:at]
            elif mutation == "invalid utf-8":
                body = body[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"])) + body[at:]
            else:
                body = body[:at] + bytes([draw(st.integers(0, 255))]) + body[at + 1:]
        return FuzzCase(f"hypothesis: {kind}, {mutation}", path, body)

    return case()


def generated_cases(n: int, seed: int) -> list[FuzzCase]:
    """``n`` bodies from :func:`_fuzz_strategy`, the same ones for the same seed: a ``@given``
    function run once, with the database off and only the generate phase (nothing fails, so
    nothing would be shrunk)."""
    if n <= 0:
        return []
    hypothesis, _ = _hypothesis()
    out: list[FuzzCase] = []

    @hypothesis.settings(max_examples=n, database=None, deadline=None, phases=[hypothesis.Phase.generate],
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.seed(seed)
    @hypothesis.given(_fuzz_strategy())
    def collect(case: FuzzCase) -> None:
        out.append(case)

    collect()
    return out[:n]


async def send_fuzz(client: httpx.AsyncClient, base_url: str, case: FuzzCase, deadline_s: float) -> FuzzOutcome:
    out = FuzzOutcome(case.label, case.path, repr(case.body[:2000]), len(case.body))
    try:
        async def exchange() -> None:
            async with client.stream("POST", base_url + case.path, content=case.body,
                                     headers={"Content-Type": case.content_type}) as resp:
                out.status = resp.status_code
                out.reply = (await resp.aread())[:300].decode("utf-8", "replace")

        await asyncio.wait_for(exchange(), deadline_s)
        out.result = "answered"
    except (asyncio.TimeoutError, httpx.TimeoutException):
        out.result, out.reply = HUNG, f"no answer within {deadline_s:g} s"
    except httpx.HTTPError as e:
        out.result, out.reply = "no answer", f"{type(e).__name__}: {e}"[:300]
    return out


# --------------------------------------------------------------------------- raw sockets


@dataclass
class RawOutcome:
    label: str
    status: int | None
    closed: bool  # the server closed the connection
    hung: bool
    detail: str = ""


async def raw_request(port: int, label: str, data: bytes, *, byte_gap_s: float = 0.0,
                      deadline_s: float = 60.0, half_close: bool = False) -> RawOutcome:
    """Write ``data`` (one byte per ``byte_gap_s`` when set), maybe half-close, and read the answer
    until the server closes or ``deadline_s`` passes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        if byte_gap_s > 0:
            for i in range(len(data)):
                writer.write(data[i:i + 1])
                await writer.drain()
                await asyncio.sleep(byte_gap_s)
        else:
            writer.write(data)
            await writer.drain()
        if half_close:
            writer.write_eof()
        try:
            raw = await asyncio.wait_for(reader.read(), deadline_s)
        except asyncio.TimeoutError:
            return RawOutcome(label, None, False, True, f"no answer within {deadline_s:g} s")
        except ConnectionError as e:
            return RawOutcome(label, None, True, False, f"{type(e).__name__}")
    finally:
        writer.close()
    status = None
    head = raw.split(b"\r\n", 1)[0].split()
    if len(head) >= 2 and head[1].isdigit():
        status = int(head[1])
    # Enough of the answer to hold a whole short completion (the byte-by-byte check parses it).
    return RawOutcome(label, status, True, False, raw[:4000].decode("utf-8", "replace"))


def http_request(path: str, body: bytes) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def framing_cases() -> list[tuple[str, bytes, bool, bool]]:
    """(label, bytes, half_close, an answer is expected): requests whose HTTP framing is bad."""
    body = json.dumps(request_body(0, False, 2)).encode()
    return [
        ("Content-Length not a number", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n"
         b"Connection: close\r\n\r\n" + body, False, True),
        ("negative Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n"
         b"Connection: close\r\n\r\n" + body, False, True),
        ("malformed chunked encoding", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
         b"Connection: close\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n", False, True),
        ("garbage request line", b"\x00\x01\x02 not http at all\r\n\r\n", False, True),
        # The client promises more body than it sends, then stops writing: the server may answer
        # or just close; it must do one of them.
        ("body shorter than Content-Length, then EOF",
         b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\nConnection: close\r\n\r\n" + body,
         True, False),
    ]


# --------------------------------------------------------------------------- the cluster
