"""Large request bodies are parsed (validated, chat-templated, tokenized) in a process of their own.

HF tokenizers' ``encode`` holds the GIL while it runs: on the event loop, or on a thread of the
server's process, a prompt of a megabyte stops every other stream for a few tenths of a second,
and thirty of them for seconds (a 12.5 s pause of an innocent stream was measured). So a
body over ``INLINE_BYTES`` is handed to a worker process (``python -m server.parse_worker``,
which loads the same tokenizer), one at a time, over a pipe of pickled messages
(``multiprocessing.connection``), while the event loop serves everyone else; a smaller body is
parsed inline, where the round trip would cost more than the parse.

The worker is started on first use and again whenever it died; every wait is bounded: a body
waits at most ``timeout_s`` for its turn and as long again for its answer, then the request gets
a 503 (``ParseUnavailable``) and a worker that did not answer is killed. The queue is bounded
too: past ``max_queued`` bodies waiting (each held in memory until its turn) a new one is
refused at once with a 429 (``ParseBusy``).
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection, Pipe
from typing import Any

from engine.tokenizer import Tokenizer
from server.protocol import (
    ModelLimits, ParsedRequest, ProtocolError, parse_chat, parse_completion, parse_detokenize, parse_tokenize,
)

log = logging.getLogger(__name__)

INLINE_BYTES = 32 << 10  # parsed on the event loop: ~10 ms of tokenizing at most
PARSERS = {"completion": parse_completion, "chat": parse_chat, "tokenize": parse_tokenize,
           "detokenize": parse_detokenize}


class ParseUnavailable(Exception):
    """The worker could not parse a body in time (or died doing so): the server's fault, a 503."""


class ParseBusy(Exception):
    """Too many large bodies already wait for the tokenizer process: the client retries later (429)."""


class ParseWorker:
    """Parses bodies with ``parse_completion`` / ``parse_chat`` in a worker process. One at a
    time, in arrival order; ``parse`` is called from the event loop."""

    def __init__(self, tokenizer: Tokenizer, timeout_s: float = 30.0, max_queued: int = 64) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, got {max_queued}")
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self._queued = 0  # bodies handed to parse() and not answered yet (event loop only)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="parse-worker")  # talks to the process
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._starts = 0

    @property
    def restarts(self) -> int:
        """Worker processes started after the first (it died, or stopped answering)."""
        return max(0, self._starts - 1)

    async def parse(self, kind: str, body: Any, limits: ModelLimits) -> Any:
        """``ProtocolError`` for the client's mistakes, as inline; ``ParseUnavailable`` when the
        worker did not answer within the bounds; ``ParseBusy`` when ``max_queued`` bodies wait."""
        if self._queued >= self.max_queued:
            raise ParseBusy(f"{self._queued} large request bodies are waiting to be tokenized")
        # The tokenizer does not travel: the worker has its own, loaded from the same folder.
        job = (kind, body, replace(limits, tokenizer=None))
        self._queued += 1
        try:
            # A job not started within the timeout is dropped from the queue (cancelled).
            status, value = await asyncio.wait_for(
                asyncio.wrap_future(self._thread.submit(self._exchange, job)), 2 * self.timeout_s)
        except TimeoutError:
            raise ParseUnavailable(f"the tokenizer process did not parse the body within {2 * self.timeout_s:g} s "
                                   "(too many large requests at once)") from None
        finally:
            self._queued -= 1
        if status == "refused":
            raise ProtocolError(*value)
        if status == "failed":  # a bug in parsing, as it would be inline: a 500
            raise RuntimeError(f"parsing failed in the tokenizer process: {value}")
        return value

    def _exchange(self, job: tuple) -> tuple[str, Any]:
        """On the worker thread: one job, with one restart if the process was found dead."""
        for attempt in range(2):
            conn = self._connection()
            try:
                conn.send(job)
                if not conn.poll(self.timeout_s):
                    self._kill(f"it did not answer within {self.timeout_s:g} s")
                    raise ParseUnavailable(f"the tokenizer process did not answer within {self.timeout_s:g} s")
                answer = conn.recv()
            except (EOFError, OSError) as e:  # it died (OOM, killed): start it again, once
                self._kill(f"its pipe failed: {type(e).__name__}: {e}")
                if attempt:
                    raise ParseUnavailable("the tokenizer process died twice in a row") from None
                continue
            return answer
        raise AssertionError("unreachable")

    def _connection(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.poll() is None:
            return self._conn
        if self._process is not None:
            self._kill("it exited")
        ours, theirs = Pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "server.parse_worker", str(theirs.fileno())], pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self._conn = ours
        self._starts += 1
        ours.send(self.tokenizer.source)
        log.info("tokenizer process pid %d started", self._process.pid)
        return ours

    def _kill(self, why: str, level: int = logging.WARNING) -> None:
        if self._process is not None and self._process.poll() is None:
            log.log(level, "stopping the tokenizer process pid %d: %s", self._process.pid, why)
            self._process.kill()
        if self._process is not None:
            self._process.wait()
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)  # a job in flight ends within its bound
        self._kill("the server is stopping", logging.INFO)


def _serve(fd: int) -> None:
    conn = Connection(fd)
    folder, eos = conn.recv()
    tokenizer = Tokenizer(folder, eos)
    while True:
        try:
            kind, body, limits = conn.recv()
        except EOFError:  # the server is gone
            return
        try:
            conn.send(("ok", PARSERS[kind](body, replace(limits, tokenizer=tokenizer))))
        except ProtocolError as e:
            conn.send(("refused", (e.message, e.param, e.status, e.type, e.code)))
        except Exception as e:  # noqa: BLE001 -- reported to the server, which answers 500
            conn.send(("failed", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
