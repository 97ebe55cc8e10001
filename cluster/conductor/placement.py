"""Placement: the policies in, a placement or a refusal out. Pure code, no I/O.

From the ledger's snapshots of the instances that are up, the Conductor's prefill scheduler
(``cluster/policies/scheduling.py``: Algorithm 1 for ``global``) picks the prefill instance and maybe a
holder to pull a hot prefix from, ``DecodeLoadBalancer`` orders the decode instances by
predicted TBT, the admission policy (``cluster/policies/early_rejection.py``) accepts or refuses,
and with ``local_prefill`` (``cluster/policies/local_prefill.py``) the request may prefill on its
decode instance instead: the same functions the simulator calls. On top of them one bound the paper leaves implicit: at most
``max_queued_prefills`` requests wait on one prefill instance; beyond it a request is refused
(it would only hold decode KV idle while it waits).

Admission is on by default: prediction-based early rejection against the operator's
SLOs, or, where none are set, against each request's default ones (``default_slo``: 10x its
TTFT and 5x its TBT alone on an idle cluster, with floors), so an overloaded cluster refuses early
what it could not serve in reasonable time instead of letting every TTFT grow. The queue bound
stays as a backstop.

The prefill cost model was calibrated on an idle instance; live, instances share cores with each
other and with the Conductors, and first tokens take longer than it predicts (admitted
requests met the TTFT SLO 4% of the time at 4x overload). ``TTFTCorrection`` learns how much
longer from every request's predicted and actual TTFT, and placement predicts with the model
scaled by it (``ScaledPrefill``); default SLOs stay those of the calibrated, idle model.

How often is a refusal wrong? Only admitting the request tells: a refusal by
the admission policy carries the placement it refused (``Refusal.placement``), and the Conductor
admits a ``probe_share`` of them all the same (``AdmissionProbes``), timing each against the SLOs
it was judged by. The queue bound's refusals are never probed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cluster.policies.early_rejection import (SLO, AcceptAll, AdmissionPolicy, EarlyRejection, PredictiveEarlyRejection,
                                              default_slo)
from cluster.policies.cost_model import DecodeStepModel, PrefillTime, ScaledPrefill, TransferModel
from cluster.policies.local_prefill import LocalPlan, LocalPrefill
from cluster.policies.sessions import Affinity, sticky_decode, sticky_prefill
from cluster.policies.snapshot import DecodeInstanceState, PrefillInstanceState, RequestInfo
from cluster.policies.scheduling import (
    DecodeLoadBalancer,
    GlobalCacheAwareScheduler,
    LoadBalancingScheduler,
    LocalCacheAwareScheduler,
    PrefillEstimator,
    PrefillPlan,
    PrefillScheduler,
    RandomScheduler,
)

SCHEDULERS = ("random", "load", "local", "global")
ADMISSIONS = ("none", "early", "predictive")


@dataclass(frozen=True)
class PlacementConfig:
    scheduler: str = "global"
    kvcache_balancing_threshold: float = 2.0
    admission: str = "predictive"
    # Both or neither: None, each request's ``default_slo`` (what the admission policy holds it to).
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    predicted_decode_s: float = 5.0  # t_d of prediction-based early rejection
    transfer_bytes_per_s: float = 4e9  # what the TTFT estimate assumes for pulled prefixes
    max_queued_prefills: int = 32  # per prefill instance; beyond it: refused (429)
    # Prefill a request on its decode instance where that meets both SLOs sooner (needs them);
    # the decode instances' step budget, which spreads a prompt over their steps.
    local_prefill: bool = False
    local_prefill_chunk_tokens: int = 512
    # Of the requests admission refuses, this share is admitted all the same and timed: the
    # live false-reject rate (``AdmissionProbes``). 0: none, and no rate.
    probe_share: float = 0.02
    # Sticky sessions: a session's next turn stays on the instance its last ran on
    # while that costs at most this much predicted TTFT over the scheduler's choice (and meets
    # the SLO). Bounded by the SLO alone, the simulator's agentic trace took 35-79% more TTFT p50
    # for at most 1% more goodput (bench/README.md); None: sessions are not sticky.
    session_slack_s: float | None = 0.1

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if (self.slo_ttft_s is None) != (self.slo_tbt_s is None):
            raise ValueError("give both SLOs (TTFT and TBT seconds) or neither (each request's default SLOs)")
        if self.kvcache_balancing_threshold < 1:
            raise ValueError("kvcache_balancing_threshold must be >= 1")
        for name in ("predicted_decode_s", "transfer_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.max_queued_prefills < 1:
            raise ValueError("max_queued_prefills must be >= 1")
        if self.local_prefill and (self.slo_ttft_s is None or self.slo_tbt_s is None):
            raise ValueError("local prefill needs both SLOs (TTFT and TBT seconds): it prefills on a decode "
                             "instance only where both hold")
        if self.local_prefill_chunk_tokens < 1:
            raise ValueError("local_prefill_chunk_tokens must be >= 1")
        if self.session_slack_s is not None and not self.session_slack_s >= 0:
            raise ValueError(f"session_slack_s must be >= 0 (or None), got {self.session_slack_s}")
        if not 0 <= self.probe_share <= 1:
            raise ValueError(f"probe_share must be in [0, 1], got {self.probe_share}")


class TTFTCorrection:
    """How many times longer first tokens take live than the calibrated model predicts
    (``factor``, starting at 1). ``observe`` takes one request's predicted TTFT (made with the
    factor then, ``factor_then``) and the TTFT it had; the factor moves a ``weight`` of the way
    (in log space) toward what that request says, within ``BOUNDS``. Requests predicted under
    ``MIN_PREDICTED_S`` say nothing: their TTFT is the fixed costs around the prefill (HTTP,
    the KV transfer), which the ratio would blow up."""

    MIN_PREDICTED_S = 0.05
    BOUNDS = (0.5, 4.0)

    def __init__(self, weight: float = 0.1) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.factor = 1.0

    def observe(self, predicted_s: float, actual_s: float, factor_then: float) -> None:
        if predicted_s < self.MIN_PREDICTED_S or actual_s <= 0:
            return
        told = factor_then * actual_s / predicted_s
        moved = math.exp((1 - self.weight) * math.log(self.factor) + self.weight * math.log(told))
        self.factor = min(max(moved, self.BOUNDS[0]), self.BOUNDS[1])


class AdmissionProbes:
    """The live false-reject rate: which refusals to admit all the same (every ``1/share``-th,
    evenly, not at random: reproducible), and how many of those met both SLOs."""

    def __init__(self, share: float) -> None:
        self.share = share
        self._refusals = 0
        self.probed = 0
        self.met = 0

    def take(self) -> bool:
        """One more refusal by the admission policy: whether to admit it as a probe."""
        self._refusals += 1
        return math.floor(self._refusals * self.share) > math.floor((self._refusals - 1) * self.share)

    def done(self, met: bool) -> None:
        """A probe ran to its end: it met both its SLOs, or not."""
        self.probed += 1
        self.met += met

    @property
    def false_reject_rate(self) -> float | None:
        """Of the refused requests admitted as probes, the share that met both SLOs."""
        return self.met / self.probed if self.probed else None


@dataclass(frozen=True)
class Placement:
    plan: PrefillPlan  # the prefill instance, the prefix it reuses (maybe pulled), predicted times
    decode_order: list[int]  # decode instances, most preferred first (empty for colocated)
    local: LocalPlan | None = None  # set: prefill on decode instance local.instance (the first of the order)
    slo: SLO | None = None  # the SLOs admission judged it by (None: no admission policy)


@dataclass(frozen=True)
class Refusal:
    reason: str
    retry_after_s: float
    placement: Placement | None = None  # what admission refused (None: refused before any plan)

    @property
    def plan(self) -> PrefillPlan | None:
        return None if self.placement is None else self.placement.plan


class Placer:
    """The Conductor's policies, built from the instances' calibrated models."""

    def __init__(self, config: PlacementConfig, prefill_cost: PrefillTime, decode_step: DecodeStepModel | None,
                 block_size: int, kv_bytes_per_token: int, seed: int = 0, pool: bool = False,
                 decode_prefill: PrefillTime | None = None, prefill_factor: float = 1.0) -> None:
        """``pool``: a KVCache pool serves remote prefixes (no pulls between instances);
        ``decode_prefill``: the decode instances' prefill time (local prefill needs it);
        ``prefill_factor``: how much longer prefills take live (``TTFTCorrection``)."""
        self.config = config
        live = prefill_cost if prefill_factor == 1.0 else ScaledPrefill(prefill_cost, prefill_factor)
        estimator = PrefillEstimator(live, TransferModel(config.transfer_bytes_per_s, kv_bytes_per_token),
                                     block_size=block_size)
        self.scheduler = _scheduler(config, estimator, seed, pool)
        self._prefill_cost = prefill_cost
        self._decode_step = decode_step
        self.local: LocalPrefill | None = None
        if decode_step is not None:
            if config.local_prefill and decode_prefill is not None:
                self.local = LocalPrefill(decode_prefill, decode_step, SLO(config.slo_ttft_s, config.slo_tbt_s),
                                          config.local_prefill_chunk_tokens, block_size)

    def place(self, now: float, request: RequestInfo, prefills: Sequence[PrefillInstanceState],
              queued: Sequence[int], decodes: Sequence[DecodeInstanceState] = (), admit: bool = True,
              affinity: Affinity = Affinity()) -> Placement | Refusal:
        """Choose for ``request``. ``queued[i]``: requests waiting on prefill instance ``i``;
        ``decodes`` empty: colocated instances (the prefill choice serves the whole request).
        ``admit`` False: the request was admitted before (it is being moved) and is never refused.
        ``affinity``: where its session's last turn ran (``cluster/policies/sessions.py``)."""
        open_ = [s for s, n in zip(prefills, queued) if n < self.config.max_queued_prefills] if admit else list(prefills)
        if not open_:
            return Refusal(f"overloaded: every prefill instance has {self.config.max_queued_prefills} "
                           f"requests waiting", min(s.queue_s for s in prefills))
        plan = self.scheduler.select(request, open_)
        slo = self.slo(request)
        held = [s for s in open_ if s.index == affinity.prefill]
        sticky = self.config.session_slack_s is not None
        if held and sticky:
            plan = sticky_prefill(plan, self.scheduler.select(request, held), None if slo is None else slo.ttft_s,
                                  self.config.session_slack_s)
        if not decodes:
            return Placement(plan, [])
        admission = _admission(self.config, slo, self._decode_step)
        balanced = DecodeLoadBalancer(admission.step).select(request, decodes)
        decision = admission.on_arrival(now, request, plan, balanced, decodes)
        order = sorted(range(len(decodes)),
                       key=lambda i: (decodes[i].index != balanced.instance, admission.tbt_with(request, decodes[i])))
        positions = {decodes[i].index: i for i in range(len(decodes))}
        order = sticky_decode(order, positions.get(affinity.decode) if sticky else None,
                              lambda i: admission.tbt_with(request, decodes[i]), None if slo is None else slo.tbt_s)
        local = None
        if self.local is not None:
            chosen = self.local.choose(request, plan, decodes[order[0]])
            local = chosen if chosen.local else None
        judged_by = None if isinstance(admission, AcceptAll) else slo
        placement = Placement(plan, [decodes[i].index for i in order], local, judged_by)
        if admit and not decision.accept:
            return Refusal(f"overloaded: predicted prefill load {decision.prefill_load:.2f}, decode load "
                           f"{decision.decode_load:.2f} (1.0 = at the SLO)", plan.queue_s, placement)
        return placement

    def slo(self, request: RequestInfo) -> SLO | None:
        """The SLOs ``request`` is held to: the operator's, else its default ones where a decode
        model is known (None: neither)."""
        if self.config.slo_ttft_s is not None:
            return SLO(self.config.slo_ttft_s, self.config.slo_tbt_s)
        if self._decode_step is None:
            return None
        return default_slo(self._prefill_cost, self._decode_step, request.input_length)


def _scheduler(config: PlacementConfig, estimator: PrefillEstimator, seed: int, pool: bool) -> PrefillScheduler:
    if config.scheduler == "random":
        return RandomScheduler(estimator, seed=seed)
    if config.scheduler == "load":
        return LoadBalancingScheduler(estimator)
    if config.scheduler == "local":
        return LocalCacheAwareScheduler(estimator)
    return GlobalCacheAwareScheduler(estimator, config.kvcache_balancing_threshold, pull_from_instances=not pool)


def _admission(config: PlacementConfig, slo: SLO, step: DecodeStepModel) -> AdmissionPolicy:
    if config.admission == "none":
        return AcceptAll(SLO(1.0, 1.0), step)
    if config.admission == "early":
        return EarlyRejection(slo, step)
    return PredictiveEarlyRejection(slo, step, config.predicted_decode_s)
