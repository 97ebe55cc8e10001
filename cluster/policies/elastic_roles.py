"""Elastic roles: when to move one instance between prefill and decode, and which.

A fixed split of instances can only refuse requests when the load shifts between the stages
(arXiv 2407.00079 §7: early rejection makes prefill and decode load swing in anti-phase). This
policy moves capacity instead: every ``ElasticConfig.interval_s`` the caller (the simulator,
later the live Conductor) hands it what the Conductor predicted over the last ``horizon_s``
(kept by ``PredictionLog``), and it answers with at most one instance to move, or None.

**What it reads** (``RoleView``): the state snapshots of both roles' serving instances (as the
schedulers read them), and one prediction per request of the last horizon: the TTFT the prefill
scheduler predicted on arrival (``TTFTPrediction``: the queue wait, the rest, and the prefill time
the chosen instance's own cache saved), and, for each request whose KV reached decode, the batch
it joins on the decode instance it was routed to (``TBTPrediction``).

**Misses with k instances in place of n.** A request misses its TTFT SLO when its predicted TTFT
exceeds the SLO, its TBT when the predicted step time exceeds the TBT limit (the SLO times
``tbt_target``): the thresholds admission refuses at, so with today's split a miss is a request
refused, or (late binding) one its planned decode instance cannot take, moved to another at the
cost of a KV copy in its first gap. Each prediction carries the number n of its role's instances
serving when it was made (so predictions from before a switch still count); with k in place of
n, the same work spreads over k: a queue wait scales by n/k (k FIFOs take what n did), a decode
batch and its context by n/k. The rest of a TTFT (the request's own prefill and transfers) does
not change: a prompt too long for the SLO on an idle instance misses with any split. What
prefill admits goes on to decode, so a prefill role that would miss fewer requests sends decode
proportionally more (``inflow``).

**Whether.** Moving one instance from the donor role to the needy one takes ``transit`` = its
drain + ``switch_cost_s``: the donor loses it at once (it takes no new work while it drains), the
needy role gains it after the transit. Over the ``horizon_s`` the new split is expected to hold,
the share of requests saved is

    gain = (needy misses now - needy misses with n + 1) * (1 - transit / horizon)
           - (donor misses with n - 1 - donor misses now)

(misses as shares of the horizon's arrivals), and it switches when ``gain > margin``. A switch
whose transit outlasts the horizon never pays; the margin is the hysteresis: with the same
predictions after a switch, moving the instance back would lose more than ``margin`` (the two
gains have opposite signs up to the transit factor). Predictions are noisy, though, and around a
balanced split the noise alone can beat any small margin: so a role that took an instance less
than ``min_dwell_s`` ago (or started then) gives none back. Moves in one direction may follow
each other; a move back waits a dwell, long enough for the horizon the switch counted on.

**Which.** The donor's cheapest instance: for prefill, the least queued work (its drain) plus
the prefill time its own cache saved over the horizon (the cache lost to the prefill pool while
it serves decode: the others recompute those prefixes); for decode, the least predicted drain
(its running requests finishing, each assumed to decode ``decode_time_s`` from when it joined),
then the least KV held.

Invariants (``ElasticRolePolicy.decide``):

* it never leaves a role with fewer than ``min_per_role`` (>= 1) serving instances, and a role
  below that (an instance died, or was started in the other role) is refilled first from the
  other, if it has more, whatever the gain and the dwell (``refill``);
* at most one switch is in flight: it answers None while ``RoleView.switching``;
* a role none of whose instances took it less than ``min_dwell_s`` ago is the only kind that
  gives one up: no instance moves twice, and no role gives back, within a dwell;
* it is a pure function of the view: no I/O, no state of its own, the same answer twice.
"""

from __future__ import annotations

from collections import deque
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping, Sequence

from cluster.policies.cost_model import DecodeStepModel
from cluster.policies.early_rejection import SLO
from cluster.policies.snapshot import DecodeInstanceState, PrefillInstanceState


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ElasticConfig:
    """The policy's knobs. The defaults suit the overload experiment (bench/README.md):
    requests of ~26 s of decode, a TTFT SLO of 30 s, ~6 requests a second on 16 instances.

    * ``interval_s``: how often the policy is asked;
    * ``horizon_s``: how long a new split is expected to hold, so a switch must pay its transit
      back within it, and how far back the predictions it reads go (the evidence for a split
      spans as long as the split is to hold: one interval's few hundred requests are too noisy
      to bet a decode instance on, and moved roles back and forth in the overload experiment);
    * ``min_dwell_s``: after a role takes an instance (or starts), how long before it may give
      one up: the hysteresis in time (the horizon's promise, kept);
    * ``margin``: the least net share of requests a switch must save (a dead band);
    * ``switch_cost_s``: seconds a drained instance serves neither role while it changes (no
      weights reload: the role is a setting, the prefix cache stays);
    * ``decode_time_s``: the decode time each running request is assumed to take, to predict a
      decode instance's drain (``t_d`` of predictive early rejection);
    * ``min_per_role``: the fewest serving instances either role keeps.
    """

    interval_s: float = 30.0
    horizon_s: float = 120.0
    min_dwell_s: float = 120.0
    margin: float = 0.02
    switch_cost_s: float = 10.0
    decode_time_s: float = 25.0
    min_per_role: int = 1

    def __post_init__(self) -> None:
        if min(self.interval_s, self.horizon_s, self.decode_time_s) <= 0:
            raise ValueError(f"interval_s, horizon_s and decode_time_s must be positive: {self}")
        if min(self.min_dwell_s, self.margin, self.switch_cost_s) < 0:
            raise ValueError(f"min_dwell_s, margin and switch_cost_s must be >= 0: {self}")
        if self.min_per_role < 1:
            raise ValueError(f"min_per_role must be >= 1, got {self.min_per_role}")


@dataclass(frozen=True)
class TTFTPrediction:
    """The prefill scheduler's prediction for one arriving request, on the instance it chose."""

    instance: int
    serving: int  # prefill instances serving when it was predicted
    queue_s: float  # the wait for that instance
    rest_s: float  # the request's own transfer and prefill
    cached_s: float = 0.0  # prefill time that instance's own cache saved the request


@dataclass(frozen=True)
class TBTPrediction:
    """One request whose KV reached decode: the batch of the decode instance it was routed to,
    with it."""

    serving: int  # decode instances serving when it was predicted
    batch: int
    context_tokens: int


class PredictionLog:
    """The predictions of the last ``horizon_s``, as the caller gathers them for ``RoleView``."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._ttft: deque[tuple[float, TTFTPrediction]] = deque()
        self._tbt: deque[tuple[float, TBTPrediction]] = deque()

    def add_ttft(self, at: float, prediction: TTFTPrediction) -> None:
        self._ttft.append((at, prediction))

    def add_tbt(self, at: float, prediction: TBTPrediction) -> None:
        self._tbt.append((at, prediction))

    def window(self, now: float) -> tuple[list[TTFTPrediction], list[TBTPrediction]]:
        """Drops what is older than the horizon; returns the rest (added in time order)."""
        for log in (self._ttft, self._tbt):
            while log and log[0][0] <= now - self.horizon_s:
                log.popleft()
        return [p for _, p in self._ttft], [p for _, p in self._tbt]


@dataclass(frozen=True)
class RoleView:
    """What the policy reads at one decision. ``prefill`` and ``decode`` are the instances
    serving each role now (one that drains or changes role is in neither); ``ttft`` holds one
    prediction per request that arrived during the last ``horizon_s`` (refused ones included),
    ``tbt`` one per request whose KV reached decode in it. ``changed_at``: when each instance
    took its present role, or started (absent: long enough ago to count as settled); the
    dwell at the start lets the predictions cover a horizon before the first switch, and
    the load reach decode (it trails prefill by a TTFT and a decode time)."""

    now: float
    prefill: Sequence[PrefillInstanceState]
    decode: Sequence[DecodeInstanceState]
    ttft: Sequence[TTFTPrediction]
    tbt: Sequence[TBTPrediction]
    switching: bool = False
    changed_at: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoleSwitch:
    """Move ``instance`` to ``to_role``; ``gain`` and ``transit_s`` are what the policy predicted."""

    instance: int
    to_role: Role
    gain: float
    transit_s: float


class ElasticRolePolicy:
    """Decides whether to move one instance between prefill and decode (module doc)."""

    def __init__(self, config: ElasticConfig, slo: SLO, step: DecodeStepModel, tbt_target: float = 1.0) -> None:
        if not 0 < tbt_target <= 1:
            raise ValueError(f"tbt_target must be in (0, 1], got {tbt_target}")
        self.config = config
        self.slo = slo
        self.step = step
        self.tbt_limit = slo.tbt_s * tbt_target

    def ttft_misses(self, predictions: Sequence[TTFTPrediction], k: int) -> int:
        """Requests whose TTFT breaks the SLO with ``k`` prefill instances doing the work of the
        ``serving`` ones each was predicted with."""
        return sum(p.queue_s * p.serving / k + p.rest_s > self.slo.ttft_s for p in predictions)

    def tbt_misses(self, predictions: Sequence[TBTPrediction], k: int, inflow: float = 1.0) -> int:
        """Requests whose step time breaks the TBT limit with ``k`` decode instances holding the
        batches of the ``serving`` ones each was predicted with, and ``inflow`` times as many
        requests reaching decode."""
        return sum(self.step.step_s(p.batch * p.serving / k * inflow, p.context_tokens * p.serving / k * inflow)
                   > self.tbt_limit for p in predictions)

    def decide(self, view: RoleView) -> RoleSwitch | None:
        """One instance to move and where, or None (module doc: the gain, the invariants)."""
        cfg = self.config
        arrivals = len(view.ttft)
        if view.switching:
            return None
        if (switch := refill(cfg, view)) is not None:
            return switch
        if not arrivals:
            return None

        def may_give(states: Sequence[PrefillInstanceState] | Sequence[DecodeInstanceState]) -> bool:
            # A role that took an instance less than min_dwell_s ago gives none back: the
            # margin alone does not stop noise around a balanced split from moving one instance
            # back and forth (another instance each time, so a dwell per instance does not either).
            return all(view.now - view.changed_at.get(s.index, -math.inf) >= cfg.min_dwell_s for s in states)

        n_p, n_d = len(view.prefill), len(view.decode)
        ttft_now = self.ttft_misses(view.ttft, n_p)
        tbt_now = self.tbt_misses(view.tbt, n_d)

        def inflow(ttft_misses: int) -> float:
            # What prefill admits goes on to decode: a move to prefill that saves TTFT misses
            # also grows decode's batches, which decode's own predictions cannot show yet.
            return (arrivals - ttft_misses) / max(arrivals - ttft_now, 1)

        options: list[RoleSwitch] = []
        if n_p > cfg.min_per_role and may_give(view.prefill):
            saved: dict[int, float] = {}
            for p in view.ttft:
                saved[p.instance] = saved.get(p.instance, 0.0) + p.cached_s
            # Its drain and the prefill its cache did the pool's requests: both are prefill
            # seconds the switch costs the prefill role.
            donor = min(view.prefill, key=lambda s: (s.queue_s + saved.get(s.index, 0.0), s.index))
            transit = donor.queue_s + cfg.switch_cost_s
            ttft_after = self.ttft_misses(view.ttft, n_p - 1)
            needy = tbt_now - self.tbt_misses(view.tbt, n_d + 1, inflow(ttft_after))
            gain = self._gain(needy, ttft_after - ttft_now, transit, arrivals)
            options.append(RoleSwitch(donor.index, Role.DECODE, gain, transit))
        if n_d > cfg.min_per_role and may_give(view.decode):
            donor_d, drain_s = quickest_drained(cfg, view.decode, view.now)
            transit = drain_s + cfg.switch_cost_s
            ttft_after = self.ttft_misses(view.ttft, n_p + 1)
            lost = self.tbt_misses(view.tbt, n_d - 1, inflow(ttft_after)) - tbt_now
            options.append(RoleSwitch(donor_d.index, Role.PREFILL,
                                      self._gain(ttft_now - ttft_after, lost, transit, arrivals), transit))
        best = max(options, key=lambda o: o.gain, default=None)
        return best if best is not None and best.gain > cfg.margin else None

    def _gain(self, needy_saved: int, donor_lost: int, transit_s: float, arrivals: int) -> float:
        """Net share of requests saved over the horizon (module doc)."""
        useful = max(0.0, 1.0 - transit_s / self.config.horizon_s)
        return (needy_saved * useful - donor_lost) / arrivals


def decode_drain_s(config: ElasticConfig, state: DecodeInstanceState, now: float) -> float:
    """Until a decode instance's last running request ends, each decoding ``decode_time_s`` from
    its join."""
    last_end = max((start + config.decode_time_s for start in state.running_start_s), default=now)
    return max(0.0, last_end - now)


def quickest_drained(config: ElasticConfig, decodes: Sequence[DecodeInstanceState], now: float
                     ) -> tuple[DecodeInstanceState, float]:
    """The decode instance a switch to prefill takes (the least predicted drain, then the least KV
    held), and its drain."""
    donor = min(decodes, key=lambda s: (decode_drain_s(config, s, now), s.context_tokens, s.index))
    return donor, decode_drain_s(config, donor, now)


def refill(config: ElasticConfig, view: RoleView) -> RoleSwitch | None:
    """A role with fewer than ``min_per_role`` serving instances takes one from the other, if
    that has more: its least loaded (the least queued prefill, or the quickest drained decode).
    Without it, a role left empty stays empty: every request a 503. It needs no cost model: a
    cluster whose decode role is empty may have none of decode yet (``ElasticRoles``)."""
    need = config.min_per_role
    if view.switching:
        return None
    if len(view.decode) < need < len(view.prefill):
        donor = min(view.prefill, key=lambda s: (s.queue_s, s.index))
        return RoleSwitch(donor.index, Role.DECODE, math.inf, donor.queue_s + config.switch_cost_s)
    if len(view.prefill) < need < len(view.decode):
        donor_d, drain_s = quickest_drained(config, view.decode, view.now)
        return RoleSwitch(donor_d.index, Role.PREFILL, math.inf, drain_s + config.switch_cost_s)
    return None
