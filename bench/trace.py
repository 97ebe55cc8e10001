"""Mooncake trace loading and prompt synthesis for ``bench.serving``.

A Mooncake trace (e.g. ``../shared/eval/traces/conversation_trace.jsonl`` beside the repository) is a JSONL file,
one request per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival time in milliseconds; ``hash_ids`` names the request's prompt in
blocks of 512 tokens, each id a hash of the block *and everything before it* (prefix-chained),
so two requests sharing the first ``k`` ids share a ``k * 512``-token prefix. The trace carries
no text, so prompts are synthesized:

* **Shared blocks.** The tokens of block ``h`` are drawn from a random generator seeded with
  ``(seed, h)`` only, so every request naming ``h`` gets the very same tokens, and different
  ids get (with overwhelming probability) different tokens. Token ids are drawn uniformly from
  ``[100, vocab_size)``, avoiding the low ids where special tokens live.
* **Exact lengths.** A prompt is ``input_length`` tokens: the full blocks it covers come from
  its hash ids in order; the remaining tokens (the last partial block, and any full block the
  trace has no id for) come from a generator seeded with ``(seed, request index)``, unique to
  the request. So prefix sharing is exactly what the trace says, and the length is exact.
* **Scaling** (so a CPU can replay a trace meant for GPUs). ``length_scale`` multiplies the
  input length, the output length AND the block size by the same factor (rounded, at least
  1), so the block structure is kept: with 0.02 a 512-token block becomes 10 tokens and a
  6758-token prompt 135 tokens. ``time_scale`` multiplies every inter-arrival gap (2.0 =
  half the rate); arrivals are made relative to the first request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

TRACE_BLOCK_SIZE = 512
MIN_TOKEN_ID = 100


@dataclass
class TraceEntry:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)


@dataclass
class BenchRequest:
    """One request to send: exact prompt token ids (or text), output length, arrival offset (s)."""

    prompt: list[int] | str
    output_len: int
    arrival_s: float = 0.0


def load_trace(path: str, max_requests: int | None = None) -> list[TraceEntry]:
    """Read the first ``max_requests`` (all if None) entries of a JSONL trace."""
    entries: list[TraceEntry] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if max_requests is not None and len(entries) >= max_requests:
                break
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            entries.append(
                TraceEntry(
                    timestamp_ms=float(d.get("timestamp", 0)),
                    input_length=int(d["input_length"]),
                    output_length=int(d["output_length"]),
                    hash_ids=[int(h) for h in d.get("hash_ids", [])],
                )
            )
    return entries


def scale_length(n: int, scale: float) -> int:
    """``round(n * scale)``, at least 1."""
    return max(1, int(round(n * scale)))


def _random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID}, got {vocab_size}")
    return rng.integers(MIN_TOKEN_ID, vocab_size, size=n).tolist()


def block_tokens(hash_id: int, block_size: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The tokens of block ``hash_id``: a function of ``(seed, hash_id)`` only."""
    rng = np.random.default_rng([seed, 0, int(hash_id)])
    return _random_tokens(rng, block_size, vocab_size)


def synthesize_prompt(
    entry: TraceEntry,
    index: int,
    *,
    length_scale: float = 1.0,
    vocab_size: int = 32000,
    seed: int = 0,
    cache: dict[int, list[int]] | None = None,
) -> list[int]:
    """Exact-length prompt for ``entry`` (request number ``index``), see module docstring.

    ``cache`` (hash id -> block tokens) may be shared across calls with the same settings.
    """
    length = scale_length(entry.input_length, length_scale)
    bs = scale_length(TRACE_BLOCK_SIZE, length_scale)
    n_full = length // bs
    prompt: list[int] = []
    if cache is None:
        cache = {}
    for h in entry.hash_ids[:n_full]:
        if h not in cache:
            cache[h] = block_tokens(h, bs, vocab_size, seed)
        prompt.extend(cache[h])
    rest = length - len(prompt)
    if rest > 0:
        rng = np.random.default_rng([seed, 1, int(index)])
        prompt.extend(_random_tokens(rng, rest, vocab_size))
    return prompt


def synthesize_requests(
    entries: list[TraceEntry],
    *,
    length_scale: float = 1.0,
    time_scale: float = 1.0,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[BenchRequest]:
    """Turn trace entries into requests with synthesized prompts and scaled arrival times."""
    if not entries:
        return []
    t0 = min(e.timestamp_ms for e in entries)
    block_cache: dict[int, list[int]] = {}
    out: list[BenchRequest] = []
    for i, e in enumerate(entries):
        prompt = synthesize_prompt(
            e, i, length_scale=length_scale, vocab_size=vocab_size, seed=seed, cache=block_cache
        )
        out.append(
            BenchRequest(
                prompt=prompt,
                output_len=scale_length(e.output_length, length_scale),
                arrival_s=(e.timestamp_ms - t0) / 1000.0 * time_scale,
            )
        )
    return out
