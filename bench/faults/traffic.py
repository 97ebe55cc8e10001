"""bench.faults: the requests of a row, their greedy references, and how an answer is judged.

Every prompt is made of words drawn with a seed of the row's own, so no two rows share a prefix
block (a row's KV must really be computed and moved, not found in a cache a row before filled).
A **session** is two turns: the first (~110 words, ~150 tokens, and 128 generated) ends past
one pool object of the shipped 256 tokens, which only the decode instance can store into the
pool, when the turn ends (the prefill instance computed less than an object); the second
resends it with the reference's answer and a question, as token ids (text would be tokenized
anew, and a token merged across the turn's boundary would change every pool key after it), and
finds that object in the pool (the prefill instance's own cache holds only the first prompt's
blocks). The references come from an engine in the bench's own process, with the cluster's
precision, before the cluster starts.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bench.harness import sse_events

IDENTICAL, DIFFERS, ERROR, HUNG = "identical", "differs", "error", "hung"

# A fixed vocabulary: prompts read as text, and a seed gives the same prompt on every machine.
_WORDS = ("river mountain lantern copper orchard velvet harbor meadow thunder pebble falcon garden "
          "marble canyon ember willow anchor saddle quartz meadow violet tundra beacon cedar glacier "
          "harvest island jasmine kettle lagoon mosaic nectar oasis prairie quiver raven summit timber "
          "umbrella vessel walnut yarrow zephyr almond bramble cobalt dune fern granite hazel ivory "
          "juniper kelp lichen magnet nickel opal pepper quill rustic sable thistle ochre tulip "
          "ripple sparrow cinder fable grotto hollow inkwell jigsaw kernel ledger mantle nomad orbit").split()


@dataclass(frozen=True)
class Ask:
    """One request of a row: a completion, greedy, ``max_tokens`` long (EOS ignored, so every path
    generates as many tokens), streamed or not; ``want`` is the reference text."""

    label: str
    prompt: str | list[int]  # text, or token ids
    max_tokens: int
    stream: bool
    want: str = ""

    def body(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": self.stream}


@dataclass
class Outcome:
    ask: Ask
    result: str = HUNG
    status: int | None = None
    error: str = ""
    text: str = ""
    seconds: float = 0.0


def words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."


def fresh_asks(tag: str, n: int, max_tokens: int, n_words: int = 100) -> list[Ask]:
    """``n`` prompts of ``n_words`` words (~110-130 tokens: 7-8 KV blocks), every other one streamed."""
    return [Ask(f"{tag}/{i}", words(f"{tag}/{i}", n_words), max_tokens, stream=i % 2 == 1) for i in range(n)]


def session_firsts(tag: str, n: int) -> list[Ask]:
    return [Ask(f"{tag}/s{i}/1", words(f"{tag}/s{i}", 110), 128, stream=False) for i in range(n)]


def session_seconds(first: Ask, turn: list[int], questions: Sequence[list[int]], max_tokens: int) -> list[Ask]:
    """The second turns of ``first``: its prompt and answer as token ids (``turn``), then each
    question's; sent at once, they share the whole first turn's blocks."""
    return [Ask(f"{first.label[:-2]}/2{'abcd'[i]}", turn + q, max_tokens, stream=i % 2 == 1)
            for i, q in enumerate(questions)]


# --------------------------------------------------------------------------- sending and judging


def _error_of(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    return ""


async def send(http: httpx.AsyncClient, ask: Ask, deadline_s: float) -> Outcome:
    """Send ``ask`` and judge the answer against its reference: identical, differs (a 200 whose
    text is not the reference's: the failure this bench exists to find), a clear error (a status
    with an OpenAI error body, or a stream that ends with an error event), or hung (no answer by
    the deadline; an answer that is neither of the others counts as hung too: it is not clear)."""
    out = Outcome(ask)
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(deadline_s):
            if ask.stream:
                async with http.stream("POST", "/v1/completions", json=ask.body()) as r:
                    out.status = r.status_code
                    if r.status_code != 200:
                        raw = await r.aread()
                        out.result, out.error = (ERROR, _error_of(raw)) if _error_of(raw) else (HUNG, raw[:200].decode(
                            "utf-8", "replace"))
                    else:
                        events = sse_events([line async for line in r.aiter_lines()])
                        if events.error is not None:
                            out.result, out.error = ERROR, str(events.error.get("message", events.error))[:300]
                        elif not events.done:
                            out.result, out.error = HUNG, "the stream ended without [DONE]"
                        else:
                            out.text = events.text
                            out.result = IDENTICAL if out.text == ask.want else DIFFERS
            else:
                r = await http.post("/v1/completions", json=ask.body())
                out.status = r.status_code
                if r.status_code == 200:
                    out.text = r.json()["choices"][0]["text"]
                    out.result = IDENTICAL if out.text == ask.want else DIFFERS
                elif _error_of(r.content):
                    out.result, out.error = ERROR, _error_of(r.content)
                else:
                    out.result, out.error = HUNG, f"an answer without an error body: {r.text[:200]!r}"
    except TimeoutError:
        out.result, out.error = HUNG, f"no answer within {deadline_s:g} s"
    except ValueError as e:  # a stream whose framing broke
        out.result, out.error = HUNG, f"a broken stream: {e}"
    except httpx.HTTPError as e:
        out.result, out.error = HUNG, f"connection: {type(e).__name__}: {e}"
    out.seconds = time.monotonic() - t0
    return out


async def send_all(http: httpx.AsyncClient, asks: Sequence[Ask], deadline_s: float) -> list[Outcome]:
    return list(await asyncio.gather(*(send(http, a, deadline_s) for a in asks)))
