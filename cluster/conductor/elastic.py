"""The Conductor's elastic roles (``--elastic-roles``): it moves one instance at a time
between prefill and decode as the load shifts, instead of only refusing requests.

What it decides with is the simulator's (``bench/sim/roles.py``): the same policy,
``cluster/policies/elastic_roles.py`` ``ElasticRolePolicy``, asked every ``interval_s`` with
the predictions of the last ``horizon_s`` (``PredictionLog``). The Conductor feeds the log as it
places (``Conductor._place``): for each arriving request the TTFT its prefill scheduler predicted
on the instance it chose (refused ones included, when a plan was made), and for each accepted
disaggregated one the batch of the decode instance it was planned onto, with it (the simulator
notes the latter when the KV arrives; here the placement is the last moment the Conductor
predicts it).

A switch, followed through (``_switch``): the instance leaves placement at once
(``InstanceRecord.moving_to``); leaving prefill, the Conductor waits until the prefills it
placed there before the decision are done (one not sent yet would be refused), then asks the
instance to switch (``POST /instance/role``), which refuses new work, drains what it holds (the
reservations of requests placed before, whoever placed them, included) and changes role
(``cluster/instance/roles.py``); the registry's polls see the new role, and from then on the
instance is placed in it. Every wait is bounded by ``drain_s``: a switch that does
not finish in time is given up on, and the instance serves its old role again.

The step model the policy predicts TBT with is the calibrated one times ``StepSlowdown``: the
decode steps' live seconds over what the model predicts for the same batches. Calibration times
an idle instance; live, instances share cores (three single-thread instances on two cores in
bench.disagg's elastic deployment), and with the idle model the policy saw no TBT miss coming
while the real steps broke the SLO.

Several Conductors: one decides for the cluster. With etcd, each Conductor with
elastic roles asks for the decider key (``DeciderLease``, ``membership.hold_decider``) and
decides only while it surely holds it; the others place as usual and see the switches through
their polls (a draining instance is out of everyone's placement). The minimum per role then holds
cluster-wide, and a role left empty is refilled (``ElasticRolePolicy.refill``). Without etcd a
Conductor is alone, and decides.

Invariants: at most one switch in flight (the policy's, and ``_switching``); an instance is out
of placement from the decision until it serves the new role or the switch is given up on; the
policy sees instances by a number stable for the record's life (``_number``), so the dwell
(``changed_at``) follows the instance, not its place in a list.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor
from typing import Any

from cluster.conductor.client import InstanceClient
from cluster.conductor.ledger import Ledger
from cluster.conductor.registry import InstanceRecord, Registry
from cluster.metadata import MetadataStore
from cluster.metadata.membership import DEFAULT_TTL_S, LeasedKey, decider, hold_decider
from cluster.policies.cost_model import DecodeStepModel, PrefillTime
from cluster.policies.early_rejection import SLO
from cluster.policies.elastic_roles import (ElasticConfig, ElasticRolePolicy, PredictionLog, Role, RoleView,
                                            TBTPrediction, TTFTPrediction, refill)
from cluster.policies.scheduling import PrefillPlan
from cluster.policies.snapshot import DecodeInstanceState
from cluster.protocol import ProtocolError

log = logging.getLogger(__name__)

_SETTLE_POLL_S = 0.1  # how often a switch looks at the ledger and the registry
# The decode instances' step counters in their polled stats (engine/async_engine.py): steps that
# computed no prompt token, their seconds, sequences and KV tokens, summed.
_STEP_COUNTERS = ("decode_steps", "decode_step_seconds", "decode_step_seqs", "decode_step_context_tokens")


class StepSlowdown:
    """How many times longer the decode instances' steps take live than ``DecodeStepModel``
    predicts for the same batches. Each ``update`` reads the counters each decode instance
    reported since the previous one; ``factor`` changes only when they add up to at least
    ``MIN_STEPS`` steps (a few steps say little), and starts at 1 (the model as calibrated)."""

    MIN_STEPS = 20

    def __init__(self) -> None:
        self.factor = 1.0
        self._last: dict[InstanceRecord, tuple[float, ...]] = {}

    def update(self, model: DecodeStepModel, decodes: Sequence[InstanceRecord]) -> float:
        steps, seconds, predicted = 0.0, 0.0, 0.0
        for rec in decodes:
            stats = rec.state.stats if rec.state is not None else {}
            if not all(isinstance(stats.get(k), (int, float)) for k in _STEP_COUNTERS):
                continue  # not polled yet, or an instance that does not count its steps
            now = tuple(float(stats[k]) for k in _STEP_COUNTERS)
            before, self._last[rec] = self._last.get(rec), now
            if before is None or now[0] <= before[0]:
                continue  # the first reading, no step since, or a restarted engine counting afresh
            n = now[0] - before[0]
            # step_s is linear in both: n steps of the mean batch take what the n steps do.
            seconds += now[1] - before[1]
            predicted += n * model.step_s((now[2] - before[2]) / n, (now[3] - before[3]) / n)
            steps += n
        if steps >= self.MIN_STEPS and predicted > 0 and seconds > 0:
            self.factor = seconds / predicted
        return self.factor


class DeciderLease:
    """Whether this Conductor is the cluster's elastic-roles decider (``decides``). Alone (no
    membership store) it always is; with etcd, while it holds the decider key within its lease
    (``LeasedKey.held``). ``run_forever`` asks for the key while another holds it, each store
    call on ``executor`` and bounded by ``ttl_s``."""

    def __init__(self, store: MetadataStore | None, conductor_id: str, executor: Executor, key: bytes,
                 ttl_s: float = DEFAULT_TTL_S) -> None:
        """``key``: the membership key the decider's record is signed with."""
        self._store, self._id, self._executor, self.ttl_s = store, conductor_id, executor, ttl_s
        self._membership_key = key
        self._key: LeasedKey | None = None
        self._seen: str | None = None  # the Conductor that decides, as last read (when not this one)
        self.error: str | None = None  # why the last ask failed (the store did not answer)

    def decides(self) -> bool:
        return self._store is None or (self._key is not None and self._key.held)

    def holder(self) -> str | None:
        """Who decides, as this Conductor last saw it (itself when it does)."""
        return self._id if self.decides() else self._seen

    async def run_forever(self) -> None:
        if self._store is None:
            return
        loop = asyncio.get_running_loop()

        async def ask(call: Callable[..., Any], *args: Any) -> Any:
            return await asyncio.wait_for(loop.run_in_executor(self._executor, call, self._store, *args), self.ttl_s)

        while True:
            try:
                if self._key is not None and self._key.lost.is_set():
                    log.warning("elastic roles: another Conductor took the decider key")
                    self._key = None
                if self._key is None:
                    self._key = await ask(hold_decider, self._membership_key, self._id, self.ttl_s)
                    if self._key is not None:
                        log.info("elastic roles: this Conductor decides role switches for the cluster")
                if not self.decides():
                    self._seen = await ask(decider, self._membership_key)
                self.error = None
            except Exception as e:  # noqa: BLE001 -- asked again next round; no key, no decisions
                self.error = f"{type(e).__name__}: {e}"
            await asyncio.sleep(self.ttl_s / 3)

    def close(self) -> None:
        """Give the key up now (another Conductor takes over at its next ask)."""
        if self._key is not None:
            self._key.close()
            self._key = None


class ElasticRoles:
    def __init__(self, config: ElasticConfig, slo: SLO, drain_s: float, client: InstanceClient,
                 registry: Registry, ledger: Ledger, decode_model: Callable[[], DecodeStepModel | None],
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task],
                 decider: DeciderLease | None = None) -> None:
        """``decode_model``: the calibrated decode step model the Conductor places with now
        (None while no instance has one); ``spawn``: runs a switch as a task of the Conductor's;
        ``decider``: whether this Conductor decides (None: alone, it always does)."""
        if not drain_s > 0:
            raise ValueError(f"drain_s must be positive, got {drain_s}")
        self.config, self.slo, self.drain_s = config, slo, drain_s
        self._client, self._registry, self._ledger = client, registry, ledger
        self._decode_model, self._spawn = decode_model, spawn
        self.decider = decider
        self._step: DecodeStepModel | None = None  # the last model seen: a role left empty may have taken it
        self.log = PredictionLog(config.horizon_s)
        self.switches = 0
        self.given_up = 0
        self._switching: InstanceRecord | None = None
        self._numbers: dict[InstanceRecord, int] = {}
        self._next_number = itertools.count()
        self._changed_at: dict[int, float] = {}  # number -> when it took its role, or was first seen up
        self.slowdown = StepSlowdown()

    def _number(self, rec: InstanceRecord) -> int:
        number = self._numbers.get(rec)
        if number is None:
            number = self._numbers[rec] = next(self._next_number)
            self._changed_at[number] = time.monotonic()  # as started: a dwell before its first move
        return number

    # -- what the Conductor predicted ------------------------------------------------------------------
    def on_placed(self, now: float, n: int, plan: PrefillPlan | None, cost: PrefillTime,
                  prefills: Sequence[InstanceRecord], decode: DecodeInstanceState | None, n_decodes: int) -> None:
        """Note one arrival's predictions: ``plan`` on ``prefills`` (None: refused before any
        plan), and ``decode``, the planned decode instance's state before this request joins it
        (None: refused, or colocated)."""
        if plan is not None:
            cached_s = cost.seconds(n, 0) - cost.seconds(n, plan.local_prefix_tokens)
            self.log.add_ttft(now, TTFTPrediction(self._number(prefills[plan.instance]), len(prefills), plan.queue_s,
                                                  plan.transfer_s + plan.prefill_s, max(cached_s, 0.0)))
        if decode is not None:
            self.log.add_tbt(now, TBTPrediction(n_decodes, decode.batch_size + 1, decode.context_tokens + n))

    # -- deciding ------------------------------------------------------------------------------------
    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.decide_once()
            except Exception:  # noqa: BLE001 -- one bad round must not end elastic roles
                log.exception("elastic roles: the decision failed")

    def decide_once(self) -> None:
        """Ask the policy once, if this Conductor decides; start the switch it answers, if any."""
        if self.decider is not None and not self.decider.decides():
            return
        step = self._step = self._decode_model() or self._step
        prefills, decodes = self._registry.up("prefill"), self._registry.up("decode")
        if not prefills + decodes:
            return
        now = time.monotonic()
        ttft, tbt = self.log.window(now)
        by_number = {self._number(r): r for r in prefills + decodes}
        view = RoleView(
            now=now,
            prefill=[self._ledger.prefill_state(r, self._number(r), now) for r in prefills],
            decode=[self._ledger.decode_state(r, self._number(r), now) for r in decodes],
            ttft=ttft, tbt=tbt, switching=self._switching is not None, changed_at=self._changed_at)
        if step is None:  # no instance has a decode model yet (all started as prefill): refill only
            switch = refill(self.config, view)
        else:
            live = step.scaled(self.slowdown.update(step, decodes))
            switch = ElasticRolePolicy(self.config, self.slo, live).decide(view)
        if switch is not None:
            rec = by_number[switch.instance]
            log.info("elastic roles: moving %s from %s to %s (predicted gain %.3f of the requests, transit %.1f s)",
                     rec.url, rec.role, switch.to_role.value, switch.gain, switch.transit_s)
            self._switching = rec
            rec.moving_to = switch.to_role.value  # out of placement from now on
            self._spawn(self._switch(rec, switch.to_role))

    # -- switching -----------------------------------------------------------------------------------
    async def _switch(self, rec: InstanceRecord, to: Role) -> None:
        deadline = time.monotonic() + self.drain_s
        switched = False
        try:
            # A prefill this Conductor placed there before the decision, and has not sent yet,
            # would be refused by the draining instance: those are done there first. Leaving decode
            # needs no wait: a reservation the instance refuses goes to the next decode instance.
            while to is Role.DECODE and self._ledger.load(rec).prefilling and time.monotonic() < deadline:
                await asyncio.sleep(_SETTLE_POLL_S)
            given_up = _given_up(rec)
            left = deadline - time.monotonic()
            if left > 0 and rec.up:
                reply = await self._client.switch_role(rec.url, to.value, left)
                # Its polls show the switch through: the new role, or the drain given up.
                while (rec.role != to.value and _given_up(rec) == given_up and rec.up
                       and time.monotonic() < deadline + self._registry.poll_timeout_s):
                    await asyncio.sleep(_SETTLE_POLL_S)
                switched = rec.role == to.value
                log.log(logging.INFO if switched else logging.WARNING, "elastic roles: %s %s %s (it answered %s)",
                        rec.url, "serves" if switched else "did not switch to", to.value, reply.to_dict())
        except ProtocolError as e:
            log.warning("elastic roles: switching %s to %s failed: %s", rec.url, to.value, e)
        finally:
            rec.moving_to = None
            self._switching = None
            if switched:
                self.switches += 1
                self._changed_at[self._number(rec)] = time.monotonic()
            else:
                self.given_up += 1

    def describe(self) -> dict[str, Any]:
        return {"role_switches": self.switches, "role_switches_given_up": self.given_up,
                "role_switching": None if self._switching is None else self._switching.url,
                "decode_step_slowdown": round(self.slowdown.factor, 3),
                **({} if self.decider is None else {
                    "role_decider": self.decider.holder(), "role_deciding": self.decider.decides(),
                    **({"role_decider_error": self.decider.error} if self.decider.error else {})})}


def _given_up(rec: InstanceRecord) -> int:
    """The drains the instance gave up on, as its last poll reported."""
    return (rec.state.stats.get("role_switches_given_up", 0) if rec.state is not None else 0) or 0
