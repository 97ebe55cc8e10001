"""The prefills and decodes running on this instance, each with the Conductor that started it.

Two things need this record. Ownership: only the Conductor that started a request aborts it, and
an id runs for one Conductor at a time (``claim`` raises ``NotOwner``). And the load the instance
reports in every poll answer (``InstanceState.work``): each Conductor books its own
requests exactly, so what it needs from the instance is the others' work, grouped by Conductor id
so that every poller can leave out its own.

Touched only from the event loop (the routes and the poll answer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.protocol import ConductorWork, NotOwner


@dataclass
class _Run:
    conductor: str
    started: float  # monotonic
    prompt_tokens: int
    cached_tokens: int  # of the prompt, found in this instance's prefix cache when it arrived
    prefilling: bool  # False once its first token is out (it decodes here, or it is done)
    generated: int = 0


class WorkBook:
    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def claim(self, request_id: str, conductor: str, prompt_tokens: int = 0, cached_tokens: int = 0,
              prefilling: bool = True) -> None:
        """``request_id`` runs here for ``conductor`` until ``let_go``: ``NotOwner`` if it runs
        for another Conductor already. ``prefilling`` False: it arrives prefilled (KV taken over)."""
        self.check(request_id, conductor)
        self._runs[request_id] = _Run(conductor, time.monotonic(), prompt_tokens, min(cached_tokens, prompt_tokens),
                                      prefilling)

    def check(self, request_id: str, conductor: str) -> None:
        """``NotOwner`` unless ``request_id`` runs for ``conductor`` here, or not at all."""
        run = self._runs.get(request_id)
        if run is not None and run.conductor != conductor:
            raise NotOwner(f"request {request_id!r} runs for Conductor {run.conductor!r}, not {conductor!r}")

    def decoding(self, request_id: str, generated: int) -> None:
        """``generated`` more tokens of ``request_id`` went out: its prefill is over."""
        run = self._runs.get(request_id)
        if run is not None:
            run.prefilling = False
            run.generated += generated

    def let_go(self, request_id: str) -> None:
        self._runs.pop(request_id, None)

    def report(self, incoming: dict[str, list[int]]) -> dict[str, ConductorWork]:
        """What each Conductor's requests make this instance do now; ``incoming``: the prompt
        lengths of the reservations each holds here whose KV has not been taken over yet."""
        now = time.monotonic()
        work: dict[str, ConductorWork] = {c: ConductorWork(incoming=list(n)) for c, n in incoming.items()}
        for run in self._runs.values():
            w = work.setdefault(run.conductor, ConductorWork())
            age = round(max(now - run.started, 0.0), 3)
            if run.prefilling:
                w.prefills.append((age, run.prompt_tokens, run.cached_tokens))
            else:
                w.decodes.append((age, run.prompt_tokens, run.prompt_tokens + run.generated))
        return work
