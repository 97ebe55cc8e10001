"""The Conductor's per-instance ledger: what it routed where, with rollback.

Every request passes through the Conductor, so it keeps an exact, immediate record of each
instance's load: prefills queued or running there (with their predicted times), decodes running
there (with their contexts, counted as tokens stream back), KV on its way there, and the
reservations it holds there (which it renews, ``reservations``). A queue length polled every
0.2 s would be stale, and a burst of arrivals would all pile onto the instance that last looked
idle: so a placement is booked in the same synchronous step that decided it (``Booking``), and
every entry a booking made is undone by ``Booking.close`` on whatever path the request leaves.
From the ledger come the snapshots the policies read (``cluster/policies/snapshot.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.conductor.registry import InstanceRecord
from cluster.policies.snapshot import DecodeInstanceState, PrefillInstanceState


@dataclass
class RunningDecode:
    start_s: float
    prompt_tokens: int
    generated: int = 1  # the first token came from the prefill


@dataclass
class InstanceLoad:
    prefilling: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (start, predicted s)
    running: dict[str, RunningDecode] = field(default_factory=dict)
    incoming: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (predicted arrival, prompt)
    reserved: dict[str, bool] = field(default_factory=dict)  # reservation id -> no KV write can be in flight

    def prefill_queue_s(self, now: float) -> float:
        """Predicted prefill seconds left of what is placed here (on a decode instance: the
        prompts it prefills itself)."""
        # Queued work drains in order; the oldest request has been running for a while already.
        queue = sum(predicted for _, predicted in self.prefilling.values())
        if self.prefilling:
            oldest_start, oldest = min(self.prefilling.values())
            queue -= min(oldest, max(now - oldest_start, 0.0))
        return max(queue, 0.0)

    def prefill_state(self, index: int, now: float, rec: InstanceRecord) -> PrefillInstanceState:
        return PrefillInstanceState(index, self.prefill_queue_s(now), rec)

    def decode_state(self, index: int, now: float, rec: InstanceRecord | None = None) -> DecodeInstanceState:
        running = list(self.running.values())
        incoming = list(self.incoming.values())
        return DecodeInstanceState(
            index=index,
            running_start_s=[r.start_s for r in running],
            running_prompt=[r.prompt_tokens for r in running],
            context_tokens=sum(r.prompt_tokens + r.generated for r in running),
            incoming_ready_s=[t for t, _ in incoming],
            incoming_prompt=[n for _, n in incoming],
            local_prefill_s=self.prefill_queue_s(now),
            cache=rec,
        )

    def describe(self) -> dict[str, Any]:
        return {"prefilling": len(self.prefilling), "running": len(self.running),
                "incoming": len(self.incoming), "reserved": len(self.reserved)}


class Ledger:
    def __init__(self) -> None:
        self._loads: dict[InstanceRecord, InstanceLoad] = {}

    def load(self, rec: InstanceRecord) -> InstanceLoad:
        load = self._loads.get(rec)
        if load is None:
            load = self._loads[rec] = InstanceLoad()
        return load

    def forget(self, rec: InstanceRecord) -> None:
        """A new incarnation of ``rec``: whatever the old one was doing is gone."""
        self._loads.pop(rec, None)

    def holds(self, rec: InstanceRecord) -> bool:
        """Whether any request of this Conductor is on ``rec`` (placed, running or reserved)."""
        load = self._loads.get(rec)
        return load is not None and any(load.describe().values())

    def reservations(self) -> dict[InstanceRecord, list[str]]:
        """The reservations held on each instance, to renew."""
        return {rec: list(load.reserved) for rec, load in self._loads.items() if load.reserved}

    def book(self) -> Booking:
        return Booking(self)

    def total_running(self) -> int:
        return sum(len(load.running) for load in self._loads.values())


class Booking:
    """The ledger entries of one request. ``add`` books, ``remove`` ends an entry that is over
    (nothing to abort there any more), and ``close`` ends whatever is left."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._entries: list[tuple[InstanceRecord, str, str]] = []  # (instance, table, key)

    def add(self, rec: InstanceRecord, table: str, key: str, value: Any) -> Any:
        getattr(self._ledger.load(rec), table)[key] = value
        self._entries.append((rec, table, key))
        return value

    def remove(self, rec: InstanceRecord, table: str, key: str) -> None:
        getattr(self._ledger.load(rec), table).pop(key, None)

    def close(self) -> dict[tuple[InstanceRecord, str], bool]:
        """Undo every entry. Returns what instances may still hold of the request (a
        reservation, a queued prefill, a running decode) as {(instance, id): writes done}, to
        abort there; ``writes done`` is False for a reservation whose KV may still be arriving."""
        holds: dict[tuple[InstanceRecord, str], bool] = {}
        for rec, table, key in self._entries:
            value = getattr(self._ledger.load(rec), table).pop(key, None)
            if value is not None and table != "incoming":
                done = value if table == "reserved" else True
                holds[rec, key] = holds.get((rec, key), True) and done
        self._entries.clear()
        return holds
