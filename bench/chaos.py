"""Chaos benchmark: faults against a running cluster, and whether every request still gets a clear answer.

Run with ``python -m bench.chaos`` (``--help`` for flags; ``--quick`` for a shorter run). It starts
a ``python -m server`` cluster at the shipped lease and timeout defaults (a Conductor plus two
prefill and two decode instances, on an etcd the bench starts itself when there is an etcd
binary; ``--server-arg`` / ``--server-args`` add flags such as ``--instance-threads 1``) on a free
loopback port, in its own session, with a cluster secret in its environment, and waits until every
instance is up. Then:

0. the **expected texts**: each prompt of a small fixed set (completions and chat) is sent once,
   alone, greedy (temperature 0) before any fault; the server (in float32 here, where batching
   does not change the rounding) is deterministic for greedy decoding, so every later answer
   that completes normally must repeat that text exactly;
1. a **steady stream** starts: Poisson arrivals (``bench.serving.arrival_times``) at ``--rate``
   req/s, each request one of those prompts, streamed (SSE) or not, ``--max-tokens`` tokens; and
   the **long-prompt load** of ``bench/chaos_isolation.py`` (``--long-clients`` clients sending
   prompts of ``--long-words`` words, each twice: both answers must be the same text); both
   run under all the faults below, one after another with ``--pause-s`` between them, while a
   monitor watches the Conductor's view of every instance that is not being faulted;
2. ``kill -9`` of one of the two **decode** instances (its pid from the Conductor's ``/stats``); the
   benchmark only watches: the Conductor's supervisor must start it again (a new pid, ``up``) and
   a request must then complete with the expected text;
3. the same for one **prefill** instance;
4. **SIGSTOP** of one instance of each role (``--stop-role``) for ``--stop-s`` seconds, then SIGCONT;
   it must be up again and serve;
5. the faults of ``bench/chaos_isolation.py``: the metadata store (etcd) stopped, a pool node
   stopped then killed, a replayed / stale-epoch control call, an unsigned 1 GiB control body
   (a partition is not run here: tests/test_across_hosts.py; a late KV writer:
   tests/test_late_write.py);
6. a **burst** of ``--burst`` requests at once, far above what two cores serve;
7. a **fuzz** of the HTTP API: handmade bodies (malformed and truncated JSON, wrong types, huge
   numbers, 10k-deep nesting, invalid UTF-8, lone surrogates, thousands of prompts, a body over
   the size limit, ...), ``--fuzz-examples`` bodies that ``hypothesis`` generates with a fixed
   seed (structured requests with bad fields, arbitrary JSON, raw bytes, then truncated or with
   invalid bytes spliced in), raw-socket requests with bad framing, and slow clients: requests
   sent byte by byte, and ``--stall-connections`` connections that stall (no bytes, half the
   headers, half the body) while a well-formed request must still be served.

Every request has a deadline (``--deadline-s``): one with no answer by then is counted as hung,
not waited on. Afterwards the stream stops, the benchmark waits up to ``--drain-s`` for the
instances to hold nothing (aborts are asynchronous), prints a table and, with ``--json PATH``,
writes the same figures. Rows marked "must be 0":

* hung requests (well-formed or malformed);
* well-formed requests with no clear answer: a dropped connection, a stream that ends without
  ``[DONE]``, an error status without an OpenAI error body;
* completed answers whose text differs from the expected greedy text;
* requests lost while a healthy instance of their role was up (a 5xx or an error event: with two
  instances of each role and one faulted at a time, there always was one), and healthy instances
  the Conductor marked down;
* stale, replayed or altered control calls an instance accepted, and an unsigned huge control
  body the Conductor did not refuse from its headers (401 / 413, peak RSS growing less than 64 MiB);
* 5xx answers to malformed input, and malformed requests the server dropped without an answer
  (a 503, the cluster not serving, and a 500 for a body the engine accepted and then failed are
  shown apart: the rows above and below account for them);
* faults not recovered: a killed instance not restarted by the Conductor, a stopped one not up
  again, or no request served afterwards; slow-client checks that failed;
* blocks, reservations, running or waiting requests and staging ranges still held at the end
  (on the instances, and in the Conductor's books), and instances not up at the end.

The exit status is 0 when they all are 0, 1 otherwise, 2 when the cluster did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from bench import chaos_isolation as iso
from bench.harness import INSTANCE_HELD, ServerProcess, launch_server, sse_events
from bench.serving import arrival_times

SECRET_ENV = "MOONCAKE_CLUSTER_SECRET"
HOST = "127.0.0.1"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# The fixed prompt set: (endpoint, prompt). Few prompts, so every one is answered many times.
PROMPTS: tuple[tuple[str, str], ...] = (
    (COMPLETIONS, "The capital of France is"),
    (COMPLETIONS, "def fibonacci(n):"),
    (COMPLETIONS, "List three colors of the rainbow:"),
    (COMPLETIONS, "Once upon a time, in a small village by the sea,"),
    (CHAT, "Name a fruit."),
    (CHAT, "What is the boiling point of water?"),
)

LOST = "requests lost while a healthy instance of their role was up"
MARKED_DOWN = "healthy instances marked down"
STALE = "stale, replayed or altered control calls accepted"
HUGE = "unsigned huge control body not refused"

# The Conductor's own books about each instance.
CONDUCTOR_HELD = ("prefilling", "running", "incoming", "reserved")

COMPLETED, HTTP_ERROR, STREAM_ERROR, UNCLEAR, HUNG = "completed", "http_error", "stream_error", "unclear", "hung"
# The server's 500 for a request it accepted and its engine then failed (server/app.py): such a
# body passed validation, so it was not malformed input.
ENGINE_FAILED = "the engine failed while serving the request"


# --------------------------------------------------------------------------- configuration


@dataclass
class ChaosConfig:
    server_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    rate: float = 2.0  # steady stream, req/s
    max_tokens: int = 16
    deadline_s: float = 120.0
    pause_s: float = 5.0
    # Two instances of each role: one is faulted at a time, and the other must take its requests.
    prefill_instances: int = 2
    decode_instances: int = 2
    stop_role: str = "both"  # SIGSTOP one instance of this role ("both": one of each, in turn)
    stop_s: float = 20.0
    # The long-prompt load (bench/chaos_isolation.py) under every fault.
    long_clients: int = 4
    long_words: int = 500
    long_max_tokens: int = 16
    etcd: bool = True  # run on an etcd of the bench's own, and stop it (when there is an etcd binary)
    etcd_stop_s: float = 10.0
    pool_node: bool = True  # a pool node of its own, stopped and then killed
    pool_stop_s: float = 10.0
    huge_body_bytes: int = 1 << 30
    burst: int = 200
    fuzz_examples: int = 150
    fuzz_concurrency: int = 4
    slow_request_s: float = 3.0  # how long one byte-by-byte request takes to send
    stall_connections: int = 50
    stall_s: float = 5.0
    restart_timeout_s: float = 240.0
    probe_timeout_s: float = 90.0
    # How long the quiet cluster may take to release everything. A receive staging range whose
    # reservation ended unsettled (its writer may still be late) is reused only after twice the
    # transfer timeout: 60 s at the shipped 30 s. The wait ends as soon as nothing is held.
    drain_s: float = 75.0
    health_timeout_s: float = 300.0
    seed: int = 0
    log_path: Path = Path("out") / "chaos" / "server.log"

    @classmethod
    def quick(cls, **overrides: Any) -> ChaosConfig:
        """The same scenarios, smaller: what tests/test_chaos.py runs."""
        # Two long-prompt clients, not four: on CI's two cores four keep the CPU so busy that
        # each restart after a kill takes half a minute longer.
        base = cls(rate=1.0, pause_s=0.5, stop_s=3.0, burst=40, fuzz_examples=40, slow_request_s=2.0,
                   stall_connections=16, stall_s=2.0, restart_timeout_s=180.0, probe_timeout_s=60.0,
                   long_clients=2, long_words=150, long_max_tokens=8, etcd_stop_s=2.0, pool_stop_s=2.0)
        return replace(base, **overrides)


# --------------------------------------------------------------------------- well-formed requests


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
    long_key: str = ""  # a long prompt (bench.chaos_isolation): which one; prompt is then -1


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


@dataclass
class Cluster:
    server: ServerProcess
    seen_pids: set[int] = field(default_factory=set)  # every instance pid /stats ever named
    secret: str = ""  # the cluster secret (the stale-epoch check signs with it, as the Conductor does)
    etcd: iso.Etcd | None = None  # the metadata store the bench started (None: the embedded one)
    pool_node: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.server.base_url

    @property
    def port(self) -> int:
        return urlsplit(self.server.base_url).port

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is an instance this cluster started (checked before every signal: a
        recycled pid must never be hit)."""
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        conductor = self.url.encode()
        return any(a == b"--conductor" and b == conductor for a, b in zip(args, args[1:]))


def start_cluster(cfg: ChaosConfig) -> Cluster:
    # float32, the reference precision: there a greedy answer does not depend on how requests
    # were batched, which the expected texts rely on (the CPU default, int4 weights,
    # rounds differently at different batch sizes). --server-arg can still choose another.
    # Leases and timeouts are the shipped defaults: no flag here sets them.
    secret = os.environ.get(SECRET_ENV) or secrets.token_hex(16)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), SECRET_ENV: secret}
    etcd = iso.start_etcd(cfg.log_path.parent) if cfg.etcd else None
    flags = ["--dtype", "float32", "--prefill-instances", str(cfg.prefill_instances),
             "--decode-instances", str(cfg.decode_instances), *(["--etcd", etcd.url] if etcd else [])]
    try:
        server = launch_server([*flags, *cfg.server_args], cfg.log_path, name="chaos", python=cfg.python,
                               host=HOST, env=env)
    except BaseException:
        iso.stop_process(etcd.proc if etcd else None)
        raise
    return Cluster(server, secret=secret, etcd=etcd)


def stop_cluster(cluster: Cluster, timeout_s: float = 30.0) -> None:
    """Stop the Conductor's process group, then any instance left over. Instances live in their own
    process groups and follow the Conductor on its death (SIGTERM); a stopped one cannot, so each
    gets SIGCONT first, and the group of one still there after ``timeout_s`` gets SIGKILL."""
    for pid in cluster.seen_pids:
        if cluster.owns(pid):
            _signal(pid, signal.SIGCONT)
    iso.stop_process(cluster.pool_node)
    cluster.server.stop(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(cluster.owns(p) for p in cluster.seen_pids):
        time.sleep(0.2)
    for pid in cluster.seen_pids:
        if cluster.owns(pid):
            try:
                if os.getpgid(pid) == pid:  # the launcher makes each instance the leader of its own group
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if cluster.etcd is not None:
        iso.stop_process(cluster.etcd.proc)
        shutil.rmtree(cluster.etcd.data_dir, ignore_errors=True)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


async def conductor_stats(client: httpx.AsyncClient, cluster: Cluster) -> dict[str, Any] | None:
    try:
        r = await client.get(cluster.url + "/stats", timeout=10)
        stats = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if stats:
        cluster.seen_pids.update(i["pid"] for i in stats.get("instances", []) if i.get("pid"))
        cluster.seen_pids.update(s["pid"] for s in stats.get("supervised", []) if s.get("pid"))
    return stats


async def wait_until(check: Callable[[], Awaitable[Any]], timeout_s: float, interval_s: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy (returned) or ``timeout_s`` passes (None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if value := await check():
            return value
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(interval_s)


async def all_up(client: httpx.AsyncClient, cluster: Cluster) -> dict[str, Any] | None:
    """The Conductor's stats when each supervised instance is alive and up, else None."""
    stats = await conductor_stats(client, cluster)
    if not stats or not stats.get("instances"):
        return None
    up = {i["url"] for i in stats["instances"] if i["up"]}
    supervised = stats.get("supervised") or []
    if all(s["alive"] and s["url"] in up for s in supervised) and {"prefill", "decode"} <= {
            i["role"] for i in stats["instances"] if i["up"]}:
        return stats
    return None


# --------------------------------------------------------------------------- the run


def _progress(msg: str) -> None:
    print(f"[bench.chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Run:
    """One chaos run against a started cluster: the load, the faults, and everything observed."""

    def __init__(self, cfg: ChaosConfig, cluster: Cluster, client: httpx.AsyncClient):
        self.cfg = cfg
        self.cluster = cluster
        self.client = client
        self.phase = "expected"
        self.outcomes: list[Outcome] = []
        self.expected: dict[int, str] = {}
        self.faults: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self.errors: list[str] = []  # scenarios that could not run
        self.faulted: set[str] = set()  # URLs of the instances being faulted now
        self.monitor = iso.Monitor()
        self.rng = np.random.default_rng([cfg.seed, 11])
        self.t0 = time.monotonic()

    def _elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    async def request(self, prompt: int, stream: bool) -> Outcome:
        out = Outcome(self.phase, prompt, stream)
        self.outcomes.append(out)
        return await send(self.client, self.cluster.url, out, self.cfg.max_tokens, self.cfg.deadline_s)

    def _random_request(self) -> Awaitable[Outcome]:
        return self.request(int(self.rng.integers(len(PROMPTS))), bool(self.rng.integers(2)))

    # -- load ----------------------------------------------------------------------------------------
    async def expected_texts(self) -> None:
        """Each prompt once, alone, before any fault: the answer every later one must repeat."""
        for i in range(len(PROMPTS)):
            out = await self.request(i, False)
            if out.result != COMPLETED:
                raise RuntimeError(f"the fault-free answer to prompt {i} failed: {out.error or out.status}")
            self.expected[i] = out.text

    async def steady(self, stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
        """Poisson arrivals until ``stop``; at most an hour's worth of them."""
        offsets = arrival_times(max(1, int(self.cfg.rate * 3600)), self.cfg.rate, seed=self.cfg.seed)
        start = time.monotonic()
        for offset in offsets:
            delay = start + offset - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            if stop.is_set():
                return
            tasks.append(asyncio.create_task(self._random_request()))

    async def probe(self) -> dict[str, Any]:
        """Requests until one completes with the expected text (bounded): is the cluster serving?"""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.probe_timeout_s
        attempts = 0
        while time.monotonic() < deadline and attempts < 200:
            attempts += 1
            out = await self.request(attempts % len(PROMPTS), bool(attempts % 2))
            if out.result == COMPLETED and out.text == self.expected[out.prompt]:
                return {"served": True, "served_after_s": round(time.monotonic() - t0, 1), "attempts": attempts}
            await asyncio.sleep(1.0)
        return {"served": False, "served_after_s": None, "attempts": attempts}

    # -- faults --------------------------------------------------------------------------------------
    async def _instance(self, role: str) -> dict[str, Any]:
        stats = await conductor_stats(self.client, self.cluster)
        if not stats:
            raise RuntimeError("the Conductor's /stats did not answer")
        up = [i for i in stats["instances"] if i["role"] == role and i["up"] and self.cluster.owns(i["pid"])]
        if not up:
            raise RuntimeError(f"no {role} instance of this cluster is up: {stats['instances']}")
        restarts = [s["restarts"] for s in stats.get("supervised", []) if s["url"] == up[0]["url"]]
        return {**up[0], "restarts": restarts[0] if restarts else 0}

    async def kill(self, role: str) -> None:
        await self._fault(role, "kill -9", self._kill)

    async def _fault(self, role: str, kind: str,
                     run: Callable[[str, dict[str, Any], dict[str, Any]], Awaitable[None]]) -> None:
        """Record a fault of ``kind`` against an instance of ``role`` that is up and ``run`` it
        there; the instance counts as faulted (the monitor expects its failures) until it ends."""
        victim = await self._instance(role)
        fault: dict[str, Any] = {"kind": kind, "role": role, "url": victim["url"], "old_pid": victim["pid"],
                                 "at_s": self._elapsed()}
        self.faults.append(fault)
        self.faulted.add(victim["url"])
        try:
            await run(role, victim, fault)
        finally:
            self.faulted.discard(victim["url"])

    async def _kill(self, role: str, victim: dict[str, Any], fault: dict[str, Any]) -> None:
        fault["restarts_before"] = victim["restarts"]
        _progress(f"kill -9 {role} instance pid {victim['pid']} ({victim['url']})")
        t0 = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)

        async def back() -> dict[str, Any] | None:
            stats = await conductor_stats(self.client, self.cluster)
            if not stats:
                return None
            inst = [i for i in stats["instances"] if i["url"] == victim["url"] and i["up"]
                    and i["pid"] != victim["pid"]]
            sup = [s for s in stats.get("supervised", []) if s["url"] == victim["url"]]
            if inst and sup and sup[0]["restarts"] > victim["restarts"]:
                return {"inst": inst[0], "sup": sup[0]}
            return None

        found = await wait_until(back, self.cfg.restart_timeout_s)
        fault["restarted"] = found is not None
        if found:
            fault.update(new_pid=found["inst"]["pid"], restart_s=round(time.monotonic() - t0, 1),
                         restarts=found["sup"]["restarts"], last_exit=found["sup"]["last_exit"],
                         new_instance_id=found["inst"]["instance_id"])
            _progress(f"{role} instance back as pid {fault['new_pid']} after {fault['restart_s']} s "
                      f"(restarts {fault['restarts']}, last exit {fault['last_exit']})")
        else:
            _progress(f"{role} instance NOT back within {self.cfg.restart_timeout_s:g} s")
        fault.update(await self.probe())
        fault["recovered"] = bool(fault["restarted"] and fault["served"])
        _progress(f"after the {role} kill: served again: {fault['served']} ({fault['served_after_s']} s)")

    async def stop_and_continue(self, role: str) -> None:
        await self._fault(role, "SIGSTOP", self._stop_and_continue)

    async def _stop_and_continue(self, role: str, victim: dict[str, Any], fault: dict[str, Any]) -> None:
        fault["stopped_s"] = self.cfg.stop_s
        _progress(f"SIGSTOP {role} instance pid {victim['pid']} for {self.cfg.stop_s:g} s")
        marked_down = False
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            end = time.monotonic() + self.cfg.stop_s
            while time.monotonic() < end:
                stats = await conductor_stats(self.client, self.cluster)
                marked_down |= bool(stats) and any(i["url"] == victim["url"] and not i["up"]
                                                   for i in stats["instances"])
                await asyncio.sleep(min(0.5, max(0.0, end - time.monotonic())))
        finally:
            _signal(victim["pid"], signal.SIGCONT)
        fault["marked_down_while_stopped"] = marked_down
        t0 = time.monotonic()
        up = await wait_until(lambda: all_up(self.client, self.cluster), self.cfg.restart_timeout_s)
        fault["up_again"] = up is not None
        fault["up_again_s"] = round(time.monotonic() - t0, 1) if up else None
        if up:
            (inst,) = [i for i in up["instances"] if i["url"] == victim["url"]]
            fault["new_pid"] = inst["pid"]
        fault.update(await self.probe())
        fault["recovered"] = bool(fault["up_again"] and fault["served"])
        _progress(f"SIGCONT sent; marked down meanwhile: {marked_down}; up again: {fault['up_again']}; "
                  f"served again: {fault['served']}")

    async def burst(self) -> dict[str, Any]:
        _progress(f"burst of {self.cfg.burst} requests at once")
        t0 = time.monotonic()
        outs = await asyncio.gather(*(self._random_request() for _ in range(self.cfg.burst)))
        counts = Counter(o.result if o.result != HTTP_ERROR else f"http {o.status}" for o in outs)
        _progress(f"burst answered in {time.monotonic() - t0:.1f} s: {dict(counts)}")
        return {"size": self.cfg.burst, "duration_s": round(time.monotonic() - t0, 1), "results": dict(counts)}

    # -- fuzz ----------------------------------------------------------------------------------------
    async def fuzz(self, cases: list[FuzzCase]) -> list[FuzzOutcome]:
        _progress(f"fuzz: {len(cases)} malformed bodies, {self.cfg.fuzz_concurrency} at a time")
        sem = asyncio.Semaphore(self.cfg.fuzz_concurrency)
        # A fresh connection per body: the server may close one after an error, and a reused one
        # would then fail on the client side for reasons that are not the next body's.
        async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0),
                                     timeout=httpx.Timeout(self.cfg.deadline_s, connect=10)) as fresh:
            async def one(case: FuzzCase) -> FuzzOutcome:
                async with sem:
                    return await send_fuzz(fresh, self.cluster.url, case, self.cfg.deadline_s)

            outs = await asyncio.gather(*(one(c) for c in cases))
        by_class = Counter(f"{o.status // 100}xx" if o.status else o.result for o in outs)
        _progress(f"fuzz answered: {dict(by_class)}")
        return list(outs)

    async def framing(self) -> list[RawOutcome]:
        outs = []
        for label, data, half_close, _ in framing_cases():
            outs.append(await raw_request(self.cluster.port, label, data, half_close=half_close,
                                          deadline_s=self.cfg.deadline_s))
        return outs

    async def slow_clients(self) -> dict[str, Any]:
        """Byte-by-byte requests (must be answered), then stalled connections while a well-formed
        request must still be served."""
        port = self.cluster.port
        _progress(f"slow clients: byte-by-byte requests, {self.cfg.stall_connections} stalled connections")
        slow = []
        for prompt in (0, 4):
            path = PROMPTS[prompt][0]
            data = http_request(path, json.dumps(request_body(prompt, False, self.cfg.max_tokens)).encode())
            out = await raw_request(port, f"byte by byte ({path})", data, byte_gap_s=self.cfg.slow_request_s / len(data),
                                    deadline_s=self.cfg.deadline_s)
            body = out.detail.split("\r\n\r\n", 1)[-1] if out.status == 200 else ""
            try:
                text = choice_text(json.loads(body), path) if body else None
            except ValueError:
                text = None
            slow.append({**asdict(out), "text_as_expected": text == self.expected[prompt]})
        body = json.dumps(request_body(0, False, 2)).encode()
        partial = [
            b"",  # connected, says nothing
            f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {HOST}\r\nContent-".encode(),  # half the headers
            http_request(COMPLETIONS, body)[:-len(body) // 2],  # the headers, half the body
        ]
        conns: list[asyncio.StreamWriter] = []
        try:
            for i in range(self.cfg.stall_connections):
                _, writer = await asyncio.open_connection(HOST, port)
                conns.append(writer)
                writer.write(partial[i % len(partial)])
                await writer.drain()
            t0 = time.monotonic()
            served = await self.probe()
            await asyncio.sleep(max(0.0, self.cfg.stall_s - (time.monotonic() - t0)))
        finally:
            for w in conns:
                w.close()
        _progress(f"slow clients: byte-by-byte answered {[s['status'] for s in slow]}; "
                  f"served while stalled: {served['served']}")
        return {"byte_by_byte": slow, "stalled_connections": len(conns), "served_while_stalled": served}

    # -- quiet ---------------------------------------------------------------------------------------
    async def held_at_end(self) -> dict[str, Any]:
        """Poll until nothing is held anywhere or ``drain_s`` passes; the last observation."""
        last: dict[str, Any] = {}

        async def clean() -> bool:
            nonlocal last
            stats = await conductor_stats(self.client, self.cluster)
            if not stats:
                last = {"conductor_stats": "no answer"}
                return False
            held: dict[str, dict[str, int]] = {}
            down = {f"{i['url']} ({i['role']})": i.get("last_error") for i in stats["instances"] if not i["up"]}
            for inst in stats["instances"]:
                books = {f"conductor.{k}": inst.get(k, 0) for k in CONDUCTOR_HELD if inst.get(k)}
                own: dict[str, int] = {}
                if inst["up"]:
                    try:
                        s = (await self.client.get(inst["url"] + "/stats", timeout=10)).json()
                        own = {k: s[k] for k in INSTANCE_HELD if s.get(k)}
                    except (httpx.HTTPError, ValueError) as e:
                        own = {f"stats error: {type(e).__name__}": 1}
                if books or own:
                    held[inst["url"]] = {**books, **own}
            last = {"held": held, "down": down, "stats": stats}
            return not held and not down

        await wait_until(clean, self.cfg.drain_s, interval_s=0.5)
        return last

    async def pause(self) -> None:
        await asyncio.sleep(self.cfg.pause_s)

    def begin(self, name: str) -> None:
        self.phase = name
        self.phases.append({"name": name, "start_s": self._elapsed()})
        _progress(f"phase: {name}")


async def run_scenarios(cfg: ChaosConfig, cluster: Cluster, fuzz_cases: list[FuzzCase]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=cfg.burst + 1000, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.deadline_s, connect=10)) as client:
        up = await wait_until(lambda: all_up(client, cluster), cfg.health_timeout_s, interval_s=1.0)
        if not up:
            raise RuntimeError("the cluster's instances did not all come up")
        run = Run(cfg, cluster, client)
        run.begin("expected")
        await run.expected_texts()
        _progress(f"expected texts: {run.expected}")

        stop, tasks = asyncio.Event(), []
        run.begin("steady")
        feeder = asyncio.create_task(run.steady(stop, tasks))
        long_load = asyncio.create_task(iso.long_clients(run, stop))
        watcher = asyncio.create_task(iso.monitor(run, stop))
        extra: dict[str, Any] = {"partition": iso.partition_support(), "late_writer": iso.LATE_WRITER}
        stop_roles = ["decode", "prefill"] if cfg.stop_role == "both" else [cfg.stop_role]
        scenarios: list[tuple[str, Callable[[], Awaitable[Any]], str | None]] = [
            ("kill decode", lambda: run.kill("decode"), None),
            ("kill prefill", lambda: run.kill("prefill"), None),
            *((f"SIGSTOP {role}", lambda role=role: run.stop_and_continue(role), None) for role in stop_roles),
        ]
        if cluster.etcd is not None:
            scenarios.append(("etcd stopped", lambda: iso.stop_etcd(run), None))
        if cfg.pool_node:
            scenarios.append(("pool node stopped", lambda: iso.stop_pool_node(run), None))
        scenarios += [
            ("stale epoch", lambda: iso.stale_epoch(run), "stale_epoch"),
            ("huge control body", lambda: iso.huge_body(run), "huge_body"),
            ("burst", run.burst, "burst"),
            ("fuzz", lambda: run.fuzz(fuzz_cases), "fuzz"),
            ("bad framing", run.framing, "framing"),
            ("slow clients", run.slow_clients, "slow_clients"),
        ]
        try:
            for name, scenario, key in scenarios:
                await run.pause()
                run.begin(name)
                try:
                    result = await scenario()
                except (RuntimeError, OSError, httpx.HTTPError, ValueError, KeyError, TimeoutError) as e:
                    # One scenario that cannot run must not hide what the others find.
                    run.errors.append(f"{name}: {type(e).__name__}: {e}")
                    _progress(f"{name} FAILED to run: {type(e).__name__}: {e}")
                    continue
                if key is not None:
                    extra[key] = result
            await run.pause()
        finally:
            stop.set()
            await feeder
            run.begin("drain")
            _progress(f"waiting for {sum(not t.done() for t in tasks)} requests still in flight")
            await asyncio.gather(*tasks, long_load, watcher)  # each bounded by its deadline
        end = await run.held_at_end()
        extra["front_memory"] = {"pid": cluster.server.proc.pid, **iso.memory_kib(cluster.server.proc.pid)}
        return build_report(cfg, run, extra, end)


# --------------------------------------------------------------------------- report


def build_report(cfg: ChaosConfig, run: Run, extra: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    outs = run.outcomes
    requests = Counter()
    for o in outs:
        requests["sent"] += 1
        requests[o.result if o.result != HTTP_ERROR else f"http {o.status}"] += 1
    # A long prompt's answers must all be the first completed one's (cold and warm; moved or not).
    long_first: dict[str, str] = {}
    for o in outs:
        if o.long_key and o.result == COMPLETED:
            long_first.setdefault(o.long_key, o.text)
    wrong = [o for o in outs if o.result == COMPLETED
             and o.text != (long_first[o.long_key] if o.long_key else run.expected.get(o.prompt))]
    # With two instances of each role and one faulted at a time, every role always had an instance
    # up: a 5xx or an error event is a request lost although a healthy instance could serve it.
    lost = [o for o in outs if (o.result == HTTP_ERROR and (o.status or 0) >= 500) or o.result == STREAM_ERROR]
    no_retry_after = sum(o.retry_after is False for o in outs)
    by_phase: dict[str, Counter] = {}
    for o in outs:
        by_phase.setdefault(o.phase, Counter())[o.result if o.result != HTTP_ERROR else f"http {o.status}"] += 1

    fuzz: list[FuzzOutcome] = extra.get("fuzz", [])
    # A 503 says the cluster was not serving (the "instances not up" row tells why); a 500 from the
    # engine says the body was valid. Any other 5xx is the server failing on the input itself.
    fuzz_unavailable = [f for f in fuzz if f.status == 503]
    fuzz_engine = [f for f in fuzz if f.status == 500 and ENGINE_FAILED in f.reply]
    fuzz_5xx = [f for f in fuzz if (f.status or 0) >= 500 and f.status != 503
                and not (f.status == 500 and ENGINE_FAILED in f.reply)]
    fuzz_no_answer = [f for f in fuzz if f.result != "answered"]
    framing: list[RawOutcome] = extra.get("framing", [])
    expects_answer = {label: answer for label, _, _, answer in framing_cases()}
    slow = extra.get("slow_clients", {})
    slow_failed = sum(not (s["status"] == 200 and s["text_as_expected"]) for s in slow.get("byte_by_byte", []))
    if slow and not slow["served_while_stalled"]["served"]:
        slow_failed += 1
    held = end.get("held", {})
    held_total = sum(v for per in held.values() for v in per.values())
    mon: iso.Monitor = run.monitor
    stale = extra.get("stale_epoch") or {}
    huge = extra.get("huge_body") or {}
    front = extra.get("front_memory") or {}
    peak_mib = max(mon.peak_hwm_kib, front.get("VmHWM", 0)) // 1024

    must_be_zero = {
        "hung requests": requests[HUNG] + sum(f.result == HUNG for f in fuzz) + sum(r.hung for r in framing),
        "requests with no clear answer": requests[UNCLEAR],
        "completed with a different text": len(wrong),
        "requests lost while a healthy instance of their role was up": len(lost),
        "healthy instances marked down": len(mon.marked_down),
        "stale, replayed or altered control calls accepted": stale.get("accepted", 0),
        "unsigned huge control body not refused": int(bool(huge) and not huge.get("refused")),
        "5xx answers to malformed input": len(fuzz_5xx) + sum((r.status or 0) >= 500 for r in framing),
        "malformed requests dropped unanswered": len(fuzz_no_answer) - sum(f.result == HUNG for f in fuzz)
        + sum(bool(expects_answer.get(r.label)) and r.status is None and not r.hung for r in framing),
        "faults not recovered": sum(not f.get("recovered") for f in run.faults),
        "scenarios that failed to run": len(run.errors),
        "slow-client checks failed": slow_failed,
        "resources held at the end": held_total,
        "instances not up at the end": len(end.get("down", [])) + ("conductor_stats" in end),
    }
    stats = end.get("stats") or {}
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "expected": {PROMPTS[i][1]: t for i, t in run.expected.items()},
        "phases": run.phases,
        "requests": dict(requests),
        "missing_retry_after": no_retry_after,
        "by_phase": {k: dict(v) for k, v in by_phase.items()},
        "wrong_texts": [{"phase": o.phase, "prompt": f"long prompt {o.long_key}" if o.long_key else PROMPTS[o.prompt][1],
                         "stream": o.stream, "got": o.text,
                         "expected": long_first[o.long_key] if o.long_key else run.expected.get(o.prompt)}
                        for o in wrong[:20]],
        "long_prompts": {"sent": sum(bool(o.long_key) for o in outs),
                         "completed": sum(bool(o.long_key) and o.result == COMPLETED for o in outs),
                         "prompts": len({o.long_key for o in outs if o.long_key}),
                         "latency_p50_s": _p50([o.latency_s for o in outs if o.long_key and o.result == COMPLETED])},
        "lost": [{"phase": o.phase, "status": o.status, "result": o.result, "long": bool(o.long_key),
                  "stream": o.stream, "error": o.error[:200]} for o in lost[:30]],
        "lost_by_phase": dict(Counter(o.phase for o in lost)),
        "marked_down": mon.marked_down,
        "monitor_samples": mon.samples,
        "requests_moved": stats.get("requests_moved"),
        "front_memory": {"pid": front.get("pid"), "peak_mib": peak_mib, "rss_end_mib": front.get("VmRSS", 0) // 1024,
                         "rss_samples": mon.rss_kib[::max(1, len(mon.rss_kib) // 50)]},
        "stale_epoch": stale,
        "huge_body": huge,
        "partition": extra.get("partition"),
        "late_writer": extra.get("late_writer"),
        "error_samples": sorted({f"{o.phase}: {o.status} {o.error[:160]}" for o in outs if o.error})[:30],
        "faults": run.faults,
        "scenario_errors": run.errors,
        "burst": extra.get("burst"),
        "fuzz": {"sent": len(fuzz), "by_status": dict(Counter(str(f.status) for f in fuzz)),
                 "unavailable": len(fuzz_unavailable), "engine_failed": len(fuzz_engine),
                 "statuses": {f.label: f.status for f in fuzz if not f.label.startswith("hypothesis")},
                 "failures": [asdict(f) for f in fuzz_5xx + fuzz_no_answer][:30]},
        "framing": [asdict(r) for r in framing],
        "slow_clients": slow,
        "held_at_end": held,
        "down_at_end": end.get("down", {}),
        "server_log": scan_log(cfg.log_path),
        "conductor": {k: stats.get(k) for k in ("requests_accepted", "requests_rejected", "requests_failed",
                                                "requests_moved", "rejections_by_reason", "supervised", "pool")},
        "must_be_zero": must_be_zero,
        "ok": not any(must_be_zero.values()),
    }


def _p50(values: list[float]) -> float | None:
    return round(float(np.median(values)), 2) if values else None


def scan_log(path: Path) -> dict[str, Any]:
    """Unhandled exceptions the server logged (some reach no client: one that left mid-body), with
    the first few messages."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"unhandled": 0, "samples": []}
    hits = [line for line in lines if "unhandled error on" in line]
    return {"unhandled": len(hits), "samples": hits[:10]}


def format_table(report: dict[str, Any]) -> str:
    w, v = 58, 10
    req = report["requests"]
    fuzz = report["fuzz"]
    must = report["must_be_zero"]

    def row(label: str, value: Any, must_key: str | None = None) -> str:
        mark = ""
        if must_key is not None:
            mark = "  must be 0" + ("" if not must[must_key] else "  <-- FAIL")
        return f"{label:<{w}}{value!s:>{v}}{mark}"

    statuses = sorted((k for k in req if k.startswith("http ")), key=lambda k: int(k.split()[1]))
    lines = ["=" * (w + v + 22), f"{'Chaos benchmark':^{w + v}}", "=" * (w + v + 22),
             row("well-formed requests sent", req.get("sent", 0)),
             row("  completed", req.get(COMPLETED, 0))]
    lines += [row(f"  clear error: HTTP {k.split()[1]}", req[k]) for k in statuses]
    lines += [
        row("  clear error: stream error event", req.get(STREAM_ERROR, 0)),
        row("  429/503 without Retry-After", report["missing_retry_after"]),
        row("  no clear answer (dropped, truncated, odd body)", must["requests with no clear answer"],
            "requests with no clear answer"),
        row("hung (no answer within the deadline)", must["hung requests"], "hung requests"),
        row("completed with text != the greedy answer", must["completed with a different text"],
            "completed with a different text"),
        row("lost while a healthy instance of their role was up", must[LOST], LOST),
        row("  (a 5xx or an error event; 2 instances per role, 1 faulted)", ""),
        row("healthy instances marked down (Conductor /stats)", must[MARKED_DOWN], MARKED_DOWN),
        row("requests moved to another instance (Conductor)", report.get("requests_moved")),
        row(f"long prompts (~{report['config'].get('long_words')} words, "
            f"{report['config'].get('long_clients')} clients): sent/completed",
            f"{report['long_prompts']['sent']}/{report['long_prompts']['completed']}"),
        row("front (Conductor) process peak memory, VmHWM MiB", report["front_memory"]["peak_mib"]),
        row("malformed requests sent (fuzz + bad framing)", fuzz["sent"] + len(report["framing"])),
    ]
    lines += [row(f"  answered HTTP {s}", n) for s, n in sorted(fuzz["by_status"].items())]
    lines += [
        row("  5xx to malformed input", must["5xx answers to malformed input"], "5xx answers to malformed input"),
        row("  503: the cluster was not serving (not counted above)", fuzz["unavailable"]),
        row("  500: the engine failed on a valid body (not counted above)", fuzz["engine_failed"]),
        row("  dropped without an answer", must["malformed requests dropped unanswered"],
            "malformed requests dropped unanswered"),
    ]
    for f in report["faults"]:
        if "summary" in f:
            what = f["summary"] if f.get("recovered") else f"NOT recovered: {f['summary']}"
            lines.append(f"fault: {f['kind']} {f['role']} (pid {f['old_pid']}): {what}")
            continue
        if f["kind"] == "kill -9":
            what = (f"restarted in {f.get('restart_s')} s, served {f.get('served_after_s')} s later"
                    if f.get("recovered") else "NOT recovered")
        else:
            what = (f"up again in {f.get('up_again_s')} s, served {f.get('served_after_s')} s later"
                    if f.get("recovered") else "NOT recovered")
        lines.append(f"fault: {f['kind']} {f['role']} (pid {f['old_pid']} -> {f.get('new_pid')}): {what}")
    lines.append(f"fault: partition of one instance: {report.get('partition')}")
    lines.append(f"fault: late KV writer: {report.get('late_writer')}")
    huge = report.get("huge_body") or {}
    if huge:
        lines.append(f"fault: unsigned {huge['bytes'] / 2**30:g} GiB body to /cluster/register: HTTP {huge['status']} "
                     f"after {huge['sent_before_refusal_mib']} MiB sent; Conductor VmHWM {huge['vmhwm_before_mib']} -> "
                     f"{huge['vmhwm_after_mib']} MiB")
    lines.append(row("  unsigned huge control body not refused", must[HUGE], HUGE))
    stale = report.get("stale_epoch") or {}
    if stale:
        lines.append("fault: control calls to " + stale["instance"] + ": " +
                     "; ".join(f"{label} -> {status}" for label, status in stale["calls"].items()))
    lines.append(row("  stale, replayed or altered control calls accepted", must[STALE], STALE))
    lines += [
        row("faults not recovered", must["faults not recovered"], "faults not recovered"),
        row("slow-client checks failed", must["slow-client checks failed"], "slow-client checks failed"),
        row("scenarios that failed to run", must["scenarios that failed to run"], "scenarios that failed to run"),
        row("blocks/reservations/staging held at the end", must["resources held at the end"],
            "resources held at the end"),
        row("instances not up at the end", must["instances not up at the end"], "instances not up at the end"),
        row("unhandled exceptions in the server log", report["server_log"]["unhandled"]),
        "=" * (w + v + 22),
        "RESULT: " + ("OK, every must-be-0 row is 0" if report["ok"] else
                      "FAIL: " + ", ".join(k for k, n in must.items() if n)),
    ]
    for phase, counts in report["by_phase"].items():
        lines.append(f"phase {phase}: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    for e in report["scenario_errors"]:
        lines.append(f"scenario error: {e}")
    for label, why in report["down_at_end"].items():
        lines.append(f"down at the end: {label}: {why}")
    for label, per in report["held_at_end"].items():
        lines.append(f"held at the end by {label}: {per}")
    for f in report["fuzz"]["failures"][:10]:
        lines.append(f"fuzz failure: {f['label']} -> {f['status'] or f['result']}: POST {f['path']} "
                     f"{f['body'][:300]}")
    for wt in report["wrong_texts"][:5]:
        lines.append(f"different text: {wt}")
    for lost in report["lost"][:10]:
        lines.append(f"lost: {lost}")
    for down in report["marked_down"][:10]:
        lines.append(f"healthy instance marked down: {down}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- entry points


def run_chaos(cfg: ChaosConfig) -> dict[str, Any]:
    """Start the cluster, run every scenario, stop the cluster (always); the report."""
    fuzz_cases = handmade_cases() + generated_cases(cfg.fuzz_examples, cfg.seed)
    cluster = start_cluster(cfg)
    _progress(f"starting: {shlex.join(cluster.server.cmd)} (log: {cfg.log_path})")
    try:
        report = {"startup_s": round(cluster.server.wait_healthy(cfg.health_timeout_s), 1)}
        _progress(f"healthy after {report['startup_s']} s")
        report.update(asyncio.run(run_scenarios(cfg, cluster, fuzz_cases)))
    finally:
        _progress("stopping the cluster")
        stop_cluster(cluster)
    report.update(command=cluster.server.cmd, url=cluster.url, instance_pids=sorted(cluster.seen_pids))
    return report


def write_json(path: Path, report: dict[str, Any]) -> None:
    """The report, the table included, as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**report, "table": format_table(report)}, indent=1, default=str))


def build_parser() -> argparse.ArgumentParser:
    d = ChaosConfig()
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter: smaller burst and fuzz, shorter pauses")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra server flag, repeatable (--server-arg=--instance-threads=1)")
    p.add_argument("--server-args", default="", help="extra server flags, shell-split ('--kv-cache-gib 0.5')")
    p.add_argument("--python", default=d.python, help="interpreter that runs the server (default: this one)")
    p.add_argument("--rate", type=float, default=None, help=f"steady stream req/s (default {d.rate}; quick 1.5)")
    p.add_argument("--max-tokens", type=int, default=None, help=f"tokens per request (default {d.max_tokens})")
    p.add_argument("--deadline-s", type=float, default=None, help=f"per request (default {d.deadline_s:g})")
    p.add_argument("--pause-s", type=float, default=None, help=f"between faults (default {d.pause_s:g})")
    p.add_argument("--stop-role", choices=["prefill", "decode", "both"], default=None, help=f"default {d.stop_role}")
    p.add_argument("--stop-s", type=float, default=None, help=f"SIGSTOP duration (default {d.stop_s:g})")
    p.add_argument("--long-clients", type=int, default=None, help=f"long-prompt clients (default {d.long_clients})")
    p.add_argument("--long-words", type=int, default=None, help=f"words per long prompt (default {d.long_words})")
    p.add_argument("--etcd-stop-s", type=float, default=None, help=f"default {d.etcd_stop_s:g}")
    p.add_argument("--no-etcd", action="store_true", help="the embedded metadata store (not stopped)")
    p.add_argument("--pool-stop-s", type=float, default=None, help=f"default {d.pool_stop_s:g}")
    p.add_argument("--no-pool-node", action="store_true", help="no pool node of the bench's own")
    p.add_argument("--burst", type=int, default=None, help=f"requests at once (default {d.burst})")
    p.add_argument("--fuzz-examples", type=int, default=None,
                   help=f"hypothesis-generated bodies (default {d.fuzz_examples})")
    p.add_argument("--stall-connections", type=int, default=None, help=f"default {d.stall_connections}")
    p.add_argument("--restart-timeout-s", type=float, default=None, help=f"default {d.restart_timeout_s:g}")
    p.add_argument("--drain-s", type=float, default=None, help=f"default {d.drain_s:g}")
    p.add_argument("--seed", type=int, default=None, help=f"default {d.seed}")
    p.add_argument("--log", type=Path, default=None, help=f"server log (default {d.log_path})")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    return p


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    cfg = ChaosConfig.quick() if args.quick else ChaosConfig()
    given = {"rate": args.rate, "max_tokens": args.max_tokens, "deadline_s": args.deadline_s,
             "pause_s": args.pause_s, "stop_role": args.stop_role, "stop_s": args.stop_s, "burst": args.burst,
             "fuzz_examples": args.fuzz_examples, "stall_connections": args.stall_connections,
             "restart_timeout_s": args.restart_timeout_s, "drain_s": args.drain_s, "seed": args.seed,
             "log_path": args.log, "long_clients": args.long_clients, "long_words": args.long_words,
             "etcd_stop_s": args.etcd_stop_s, "pool_stop_s": args.pool_stop_s,
             "etcd": False if args.no_etcd else None, "pool_node": False if args.no_pool_node else None}
    return replace(cfg, python=args.python, server_args=[*args.server_arg, *shlex.split(args.server_args)],
                   **{k: v for k, v in given.items() if v is not None})


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        report = run_chaos(cfg)
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the cluster is already stopped (run_chaos's finally)
        return 130
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
        _progress(f"wrote {args.json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
