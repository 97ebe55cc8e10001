"""The Conductor's per-instance ledger: each instance's load, from the requests' bookings.

Every request passes through the Conductor, so it keeps an exact, immediate record of each
instance's load: prefills queued or running there (with their predicted times), decodes running
there (with their contexts, counted as tokens stream back), KV on its way there, and the
reservations it holds there (which it renews, ``reservations``). A queue length polled every
0.2 s would be stale, and a burst of arrivals would all pile onto the instance that last looked
idle: so a placement is booked in the same synchronous step that decided it. Each request keeps
its own ``Booking`` (``flow.py``: where it stands, step by step, on the request path); the
ledger holds the open ones and adds them up per instance (``load``), and from those loads come
the snapshots the policies read (``cluster/policies/snapshot.py``).

Other Conductors may front the same instances. Their requests are not in this ledger,
but every poll answer says what each Conductor's requests make the instance do
(``InstanceState.work``): the snapshots add the others' part of it (``Others``) to this
Conductor's own exact bookings, so N Conductors neither admit N times what an instance can take
nor predict 1/N of its queue. The others' part is as old as the last poll (``poll_interval_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from cluster.conductor.flow import Booking, RunningDecode
from cluster.conductor.registry import InstanceRecord
from cluster.policies.snapshot import DecodeInstanceState, PrefillInstanceState


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
class _Arrivals:
    """How fast the other Conductors' prefills have been arriving on one instance, and how long
    each was predicted to take, from its successive reports. A report is up to a poll interval
    old when it is read, and the others go on placing meanwhile: at 10 requests a second over
    four Conductors each missed about one request's prefill (0.4 s) of the queue it admitted
    against, and their TTFT p90 grew 18% over one Conductor's (bench.conductors).
    ``since`` is what arrived after the report at the recent pace, in predicted seconds."""

    WEIGHT = 0.3  # of the latest report, in the moving averages

    at: float = 0.0  # the report last counted (its ``state_at``)
    per_s: float = 0.0  # prefills a second
    mean_s: float = 0.0  # predicted seconds of one

    def update(self, at: float, prefills: Sequence[tuple[float, float]]) -> None:
        if at <= self.at:
            return
        if self.at:
            gap = at - self.at
            new = [predicted for start, predicted in prefills if start > self.at]
            self.per_s += self.WEIGHT * (len(new) / gap - self.per_s)
            if new:
                mean = sum(new) / len(new)
                self.mean_s = mean if not self.mean_s else self.mean_s + self.WEIGHT * (mean - self.mean_s)
        self.at = at

    def since(self, at: float, now: float) -> float:
        return self.per_s * max(now - at, 0.0) * self.mean_s


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
        self._open: list[Booking] = []
        self._arrivals: dict[InstanceRecord, _Arrivals] = {}

    def book(self, request_id: str, moved: bool = False) -> Booking:
        """A new request's booking (``moved``: an attempt after a move), counted in every load
        until it is closed."""
        booking = Booking(request_id, moved)
        self._open.append(booking)
        return booking

    def _bookings(self) -> list[Booking]:
        self._open = [b for b in self._open if not b.closed]
        return self._open

    def load(self, rec: InstanceRecord) -> InstanceLoad:
        """What this Conductor's open bookings hold on ``rec`` now."""
        load = InstanceLoad()
        for b in self._bookings():
            if b.prefill is not None and b.prefill[0] is rec:
                load.prefilling[b.request_id] = b.prefill[1:]
            if b.kv is not None and b.kv[0] is rec:
                load.incoming[b.request_id] = b.kv[1:]
            if b.decode is not None and b.decode[0] is rec:
                load.running[b.request_id] = b.decode[1]
            for (at, key), writes_done in b.reserved.items():
                if at is rec:
                    load.reserved[key] = writes_done
        return load

    def others(self, rec: InstanceRecord, now: float | None = None) -> Others:
        """What ``rec`` last reported of the other Conductors' work on it; with ``now``, plus the
        prefills they have likely placed there since (``_Arrivals``)."""
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
        arrivals = self._arrivals.setdefault(rec, _Arrivals())
        arrivals.update(at, prefills)
        if now is not None and (unseen := arrivals.since(at, now)) > 0:
            prefills.append((now, unseen))
        return Others(prefills, decodes, incoming)

    def prefill_state(self, rec: InstanceRecord, index: int, now: float) -> PrefillInstanceState:
        """``rec`` as the prefill scheduler sees it: every Conductor's queue there."""
        return self.load(rec).prefill_state(index, now, rec, self.others(rec, now))

    def decode_state(self, rec: InstanceRecord, index: int, now: float) -> DecodeInstanceState:
        """``rec`` as the decode balancer and admission see it: every Conductor's batch there."""
        return self.load(rec).decode_state(index, now, rec, self.others(rec, now))

    def queued(self, rec: InstanceRecord) -> int:
        """Requests waiting for or in their prefill on ``rec``, every Conductor's."""
        return self.load(rec).queued(self.others(rec))

    def forget(self, rec: InstanceRecord) -> None:
        """A new incarnation of ``rec``: whatever the old one was doing is gone (nothing to abort)."""
        for b in self._bookings():
            b.forget(rec)

    def holds(self, rec: InstanceRecord) -> bool:
        """Whether any request of this Conductor is on ``rec`` (placed, running or reserved)."""
        return any(self.load(rec).describe().values())

    def reservations(self) -> dict[InstanceRecord, list[str]]:
        """The reservations held on each instance, to renew."""
        held: dict[InstanceRecord, list[str]] = {}
        for b in self._bookings():
            for rec, key in b.reserved:
                held.setdefault(rec, []).append(key)
        return held

    def total_running(self) -> int:
        return sum(b.decode is not None for b in self._bookings())
