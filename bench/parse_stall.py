"""``python -m bench.parse_stall``: how long the server's event loop stops while large prompts are
tokenized, parsed inline (on the loop, as before issue 31) against the tokenizer process
(``server/parse_worker.py``, what the server does for a body over 32 KiB).

A ticker on the loop wakes every 10 ms; its longest gap while ``N`` prompts of ``--mib`` MiB are
parsed at once is the longest any other stream would have waited for its next token. The prompts
are longer than the model's context, so each is refused (400) once all of it is tokenized, as a
hostile client's would be.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

from engine.default_model import resolve_model
from engine.tokenizer import Tokenizer
from server.parse_worker import PARSERS, ParseWorker
from server.protocol import ModelLimits, ProtocolError


async def longest_pause(n: int, parse: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """The loop's longest pause while ``n`` parses run at once, and how long they took."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await asyncio.gather(*(parse() for _ in range(n)), return_exceptions=True)
    took = time.monotonic() - t0
    stop.set()
    await tick
    return max(gaps), took


async def run(counts: list[int], mib: float) -> list[tuple[int, str, float, float]]:
    tokenizer = Tokenizer(resolve_model(None))
    limits = ModelLimits("m", tokenizer, 8192, tokenizer.vocab_size)
    body = {"prompt": ("lorem ipsum dolor sit amet, consectetur adipiscing elit " * 40000)[: int(mib * 2**20)],
            "max_tokens": 1}
    worker = ParseWorker(tokenizer)
    await worker.parse("completion", {"prompt": "warm up", "max_tokens": 1}, limits)  # the process starts

    async def inline() -> None:
        try:
            PARSERS["completion"](body, limits)
        except ProtocolError:
            pass

    async def in_worker() -> None:
        await worker.parse("completion", body, limits)

    rows = []
    try:
        for n in counts:
            for name, parse in (("inline", inline), ("tokenizer process", in_worker)):
                pause, took = await longest_pause(n, parse)
                rows.append((n, name, pause, took))
    finally:
        worker.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.parse_stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", type=int, nargs="+", default=[4, 32], help="prompts parsed at once, per row")
    p.add_argument("--mib", type=float, default=1.0, help="size of each prompt")
    args = p.parse_args(argv)
    rows = asyncio.run(run(args.counts, args.mib))
    print(f"{'prompts':>8} {'parsed':<18} {'longest pause s':>16} {'all parsed in s':>16}")
    for n, name, pause, took in rows:
        print(f"{n:>8} {name:<18} {pause:>16.3f} {took:>16.1f}")
    for n in args.counts:
        inline, worker = [r[2] for r in rows if r[0] == n]
        print(f"{n} prompts: the tokenizer process pauses the loop {inline / worker:.0f}x less than inline parsing")


if __name__ == "__main__":
    main()
