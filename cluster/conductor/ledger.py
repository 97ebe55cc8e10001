"""The Conductor's per-instance ledger: what it routed where, with rollback.

Every request passes through the Conductor, so it keeps an exact, immediate record of each
instance's load: prefills queued or running there (with their predicted times), decodes running
there (with their contexts, counted as tokens stream back), KV on its way there, and the
reservations it holds there (which it renews, ``reservations``). A queue length polled every
0.2 s would be stale, and a burst of arrivals would all pile onto the instance that last looked
idle: so a placement is booked in the same synchronous step that decided it (``Booking``), and
every entry a booking made is undone by ``Booking.close`` on whatever path the request leaves.
From the ledger come the snapshots the policies read (``cluster/policies/snapshot.py``).

Other Conductors may front the same instances (issue 41). Their requests are not in this ledger,
but every poll answer says what each Conductor's requests make the instance do
(``InstanceState.work``): the snapshots add the others' part of it (``Others``) to this
Conductor's own exact bookings, so N Conductors neither admit N times what an instance can take
nor predict 1/N of its queue. The others' part is as old as the last poll (``poll_interval_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from cluster.conductor.registry import InstanceRecord
from cluster.policies.snapshot import DecodeInstanceState, PrefillInstanceState


@dataclass
class RunningDecode:
    start_s: float
    prompt_tokens: int
    generated: int = 1  # the first token came from the prefill


@dataclass(frozen=True)
class Others:
    """The other Conductors' work on one instance as it last reported it, in this Conductor's
    clock: prefills as (start, predicted s), decodes as (start, prompt, context now), and the
    prompts of their reservations whose KV is on its way."""

    prefills: Sequence[tuple[float, float]] = ()
    decodes: Sequence[tuple[float, int, int]] = ()
    incoming: Sequence[int] = ()


NOBODY = Others()


@dataclass
class InstanceLoad:
    prefilling: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (start, predicted s)
    running: dict[str, RunningDecode] = field(default_factory=dict)
    incoming: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (predicted arrival, prompt)
    reserved: dict[str, bool] = field(default_factory=dict)  # reservation id -> no KV write can be in flight

    def prefill_queue_s(self, now: float, others: Others = NOBODY) -> float:
        """Predicted prefill seconds left of what is placed here (on a decode instance: the
        prompts it prefills itself), the other Conductors' prefills included."""
        # Queued work drains in order; the oldest request has been running for a while already.
        queued = [*self.prefilling.values(), *others.prefills]
        queue = sum(predicted for _, predicted in queued)
        if queued:
            oldest_start, oldest = min(queued)
            queue -= min(oldest, max(now - oldest_start, 0.0))
        return max(queue, 0.0)

    def queued(self, others: Others = NOBODY) -> int:
        """Requests waiting for or in their prefill here, every Conductor's."""
        return len(self.prefilling) + len(others.prefills)

    def prefill_state(self, index: int, now: float, rec: InstanceRecord, others: Others = NOBODY
                      ) -> PrefillInstanceState:
        return PrefillInstanceState(index, self.prefill_queue_s(now, others), rec)

    def decode_state(self, index: int, now: float, rec: InstanceRecord | None = None, others: Others = NOBODY
                     ) -> DecodeInstanceState:
        running = [(r.start_s, r.prompt_tokens, r.prompt_tokens + r.generated) for r in self.running.values()]
        running += others.decodes
        # The others' KV on its way: when it lands is theirs to predict; taken as landing now.
        incoming = [*self.incoming.values(), *((now, n) for n in others.incoming)]
        return DecodeInstanceState(
            index=index,
            running_start_s=[start for start, _, _ in running],
            running_prompt=[prompt for _, prompt, _ in running],
            context_tokens=sum(context for _, _, context in running),
            incoming_ready_s=[t for t, _ in incoming],
            incoming_prompt=[n for _, n in incoming],
            local_prefill_s=self.prefill_queue_s(now, others),
            cache=rec,
        )

    def describe(self) -> dict[str, Any]:
        return {"prefilling": len(self.prefilling), "running": len(self.running),
                "incoming": len(self.incoming), "reserved": len(self.reserved)}


class Ledger:
    def __init__(self, own: str = "") -> None:
        """``own``: this Conductor's id, whose work in the instances' reports is the ledger's own."""
        self.own = own
        # How much longer prefills take live than calibrated (the Conductor's ``TTFTCorrection``):
        # the others' reported prompts are predicted as this Conductor's own are.
        self.prefill_factor = 1.0
        self._loads: dict[InstanceRecord, InstanceLoad] = {}

    def load(self, rec: InstanceRecord) -> InstanceLoad:
        load = self._loads.get(rec)
        if load is None:
            load = self._loads[rec] = InstanceLoad()
        return load

    def others(self, rec: InstanceRecord) -> Others:
        """What ``rec`` last reported of the other Conductors' work on it."""
        state, profile = rec.state, rec.profile
        if state is None or not state.work or profile is None:
            return NOBODY
        at = rec.state_at
        prefills, decodes, incoming = [], [], []
        for conductor, work in state.work.items():
            if conductor == self.own:
                continue
            prefills += [(at - age, profile.prefill.seconds(n, cached) * self.prefill_factor)
                         for age, n, cached in work.prefills]
            decodes += [(at - age, prompt, context) for age, prompt, context in work.decodes]
            incoming += work.incoming
        return Others(prefills, decodes, incoming)

    def prefill_state(self, rec: InstanceRecord, index: int, now: float) -> PrefillInstanceState:
        """``rec`` as the prefill scheduler sees it: every Conductor's queue there."""
        return self.load(rec).prefill_state(index, now, rec, self.others(rec))

    def decode_state(self, rec: InstanceRecord, index: int, now: float) -> DecodeInstanceState:
        """``rec`` as the decode balancer and admission see it: every Conductor's batch there."""
        return self.load(rec).decode_state(index, now, rec, self.others(rec))

    def queued(self, rec: InstanceRecord) -> int:
        """Requests waiting for or in their prefill on ``rec``, every Conductor's."""
        return self.load(rec).queued(self.others(rec))

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
