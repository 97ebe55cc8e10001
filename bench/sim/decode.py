"""A simulated decode instance: continuous batching under a step-time model.

The instance is advanced lazily: nothing happens between the moments the simulator looks at it
(an arrival, a request's KV arriving, a load sample), and ``advance_to`` then runs every step
that starts before that moment. Steps are atomic, so a request arriving mid-step joins at the
next step boundary, as in a real continuous-batching loop.

Per-sequence context is never stored per step: a sequence that joined after step ``s0`` with a
``prompt``-token context holds ``prompt + (steps - s0)`` tokens, so the batch total is
``sum(prompt) + batch * steps - sum(s0)``, kept as two running sums.

A request it prefills itself (local prefill, ``cluster/policies/local_prefill.py``) computes its
prompt in chunks, one chunk on top of each step, first come first served; its first token comes
at the end of its last chunk's step (``on_first_token``), and it joins the batch there.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable

from cluster.policies.cost_model import DecodeStepModel
from cluster.policies.snapshot import DecodeInstanceState

FinishCallback = Callable[[int, float], None]


class DecodeInstance:
    def __init__(self, index: int, step: DecodeStepModel, on_finish: FinishCallback,
                 on_first_token: FinishCallback | None = None) -> None:
        self.index = index
        self.step = step
        self.on_finish = on_finish
        self.on_first_token = on_first_token
        # Local prefills, in order: [request, chunk seconds left (next first), prompt, decode steps, placed at].
        self.local: deque[list] = deque()
        self.clock = 0.0
        self.steps = 0
        self.step_end: list[float] = []  # step_end[k] = time step k + 1 finished
        self._finish_heap: list[tuple[int, int]] = []  # (step that emits the last token, request)
        self.running: dict[int, tuple[float, int, int]] = {}  # request -> (join time, prompt, s0)
        self._prompt_sum = 0
        self._s0_sum = 0
        self.waiting: deque[tuple[int, int, int]] = deque()  # (request, prompt, steps) short of HBM
        self.incoming: dict[int, tuple[float, int]] = {}  # request -> (predicted KV arrival, prompt)
        self.join_step: dict[int, int] = {}

    @property
    def batch_size(self) -> int:
        return len(self.running)

    @property
    def context_tokens(self) -> int:
        return self._prompt_sum + len(self.running) * self.steps - self._s0_sum

    def state(self) -> DecodeInstanceState:
        running = self.running.values()
        incoming = self.incoming.values()
        waiting = [(self.clock, prompt) for _, prompt, _ in self.waiting]
        return DecodeInstanceState(
            index=self.index,
            # Local prefills count as running from their placement, as in the live Conductor's ledger.
            running_start_s=[r[0] for r in running] + [p[4] for p in self.local],
            running_prompt=[r[1] for r in running] + [p[2] for p in self.local],
            context_tokens=self.context_tokens + sum(p[2] for p in self.local),
            # Sequences waiting for HBM are as good as arriving now.
            incoming_ready_s=[r[0] for r in incoming] + [w[0] for w in waiting],
            incoming_prompt=[r[1] for r in incoming] + [w[1] for w in waiting],
            local_prefill_s=sum(sum(p[1]) for p in self.local),
        )

    def advance_to(self, t: float) -> None:
        while (self.running or self.local) and self.clock < t:
            self._run_step()
        if not self.running and not self.local and self.clock < t:
            self.clock = t

    def prefill_locally(self, request: int, prompt: int, chunk_s: list[float], decode_steps: int) -> None:
        """Queue a prompt to compute here, ``chunk_s`` seconds a step (call ``advance_to`` first)."""
        if not chunk_s:
            raise ValueError("a local prefill computes at least one chunk")
        self.local.append([request, deque(chunk_s), prompt, decode_steps, self.clock])

    def join(self, request: int, prompt: int, decode_steps: int) -> None:
        """Add a request whose KV has arrived (call ``advance_to`` first); it waits if HBM is full."""
        if decode_steps <= 0:
            self.join_step[request] = self.steps
            self.on_finish(request, self.clock)
            return
        if self.running and self.context_tokens + prompt > self.step.kv_capacity_tokens:
            self.waiting.append((request, prompt, decode_steps))
            return
        self._start(request, prompt, decode_steps)

    def drain(self) -> None:
        while self.running or self.local:
            self._run_step()

    def _start(self, request: int, prompt: int, decode_steps: int) -> None:
        self.running[request] = (self.clock, prompt, self.steps)
        self._prompt_sum += prompt
        self._s0_sum += self.steps
        self.join_step[request] = self.steps
        heapq.heappush(self._finish_heap, (self.steps + decode_steps, request))

    def _run_step(self) -> None:
        chunk = self.local[0][1].popleft() if self.local else 0.0
        # A step of the batch alone costs nothing when the batch is empty (only a prompt computes).
        self.clock += chunk + (self.step.step_s(len(self.running), self.context_tokens) if self.running else 0.0)
        self.steps += 1
        self.step_end.append(self.clock)
        if self.local and not self.local[0][1]:
            request, _, prompt, decode_steps, _ = self.local.popleft()
            if self.on_first_token is not None:
                self.on_first_token(request, self.clock)
            self.join(request, prompt, decode_steps)
        heap = self._finish_heap
        while heap and heap[0][0] == self.steps:
            _, request = heapq.heappop(heap)
            _, prompt, s0 = self.running.pop(request)
            self._prompt_sum -= prompt
            self._s0_sum -= s0
            self.on_finish(request, self.clock)
        while self.waiting and (
            not self.running
            or self.context_tokens + self.waiting[0][1] <= self.step.kv_capacity_tokens
        ):
            self._start(*self.waiting.popleft())
