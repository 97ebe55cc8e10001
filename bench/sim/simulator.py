"""Discrete-event replay of a Mooncake trace on a simulated disaggregated cluster.

Events are request arrivals (trace order), KV arrivals at decode instances, and load samples.
On arrival the Conductor's policies from ``cluster/`` run on plain state snapshots: the prefill
scheduler picks an instance and prefix, the decode balancer a decode instance, the admission
policy accepts or rejects. An accepted request is queued FIFO on its prefill instance (after
pulling a remote prefix through the source's NIC if the plan says so); its KV reaches the decode
instance when prefill ends plus the transfer of the last chunk, where the decode node checks
its own load again and the request joins the continuous batch.

With a KVCache pool (``SimConfig.pool_capacity_tokens`` != 0) the cluster also keeps one LRU of
block keys shared by all prefill instances. On arrival the request's ``pool_blocks`` is the
longest run of its leading keys the pool holds; the scheduler is the live Conductor's in pool
mode (Algorithm 1 with ``pull_from_instances=False``), so a remote prefix is loaded from the pool
at the transfer bandwidth instead of pulled from another instance (no NIC queue: the pool spreads
reads over its replicas). When a prefill ends, its prompt's keys are stored in the pool (keys it
already holds are touched); a load from the pool touches the loaded keys at arrival.

Every node has a prefill side and a decode side and serves one role (``bench/sim/roles.py``):
fixed with ``SimConfig.elastic`` None, moved by the elastic-roles policy otherwise (issue 32).

With ``SimConfig.local_prefill`` the live Conductor's ``LocalPrefill`` policy may send an
accepted request's prefill to its decode instance instead, which computes it in chunks between
its steps (``bench/sim/decode.py``; a decode node keeps no prefix cache here).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from bench.sim.baselines import LateBindingRejection, PerStageRejection
from bench.sim.config import SimConfig
from bench.sim.decode import DecodeInstance
from bench.sim.prefill import PrefillInstance
from bench.sim.roles import Roles
from bench.sim.profiling import fit_prefill_predictor
from bench.trace import TraceEntry
from cluster.policies.early_rejection import (
    SLO,
    AcceptAll,
    AdmissionPolicy,
    EarlyRejection,
    PredictiveEarlyRejection,
    current_decode_load,
)
from cluster.conductor.placement import PlacementConfig, Placer
from cluster.policies.cost_model import PrefillCostModel
from cluster.policies.elastic_roles import ElasticRolePolicy, TBTPrediction, TTFTPrediction
from cluster.policies.local_prefill import LocalPrefill
from cluster.policies.snapshot import RequestInfo
from cluster.policies.prefix_index import LRUBlockCache
from cluster.policies.scheduling import DecodeLoadBalancer, PrefillScheduler

COMPLETED, REJECTED_ON_ARRIVAL, REJECTED_AT_DECODE = 0, 1, 2


@dataclass
class SimResult:
    """Per-request outcomes (arrays indexed by trace order) and sampled pool loads."""

    config: SimConfig
    arrival_s: np.ndarray
    input_length: np.ndarray
    output_length: np.ndarray
    status: np.ndarray
    ttft_s: np.ndarray  # NaN if rejected on arrival
    tbt_s: np.ndarray  # mean of the longest 10% inter-token gaps (FAST'25); NaN if no decode step
    finish_s: np.ndarray
    prefix_tokens: np.ndarray
    pulled_tokens: np.ndarray  # pulled from another prefill instance
    prefill_s: np.ndarray
    pool_tokens: np.ndarray  # loaded from the KVCache pool
    local_prefill: np.ndarray  # prefilled on its decode instance (SimConfig.local_prefill)
    sample_t: list[float] = field(default_factory=list)
    prefill_load: list[float] = field(default_factory=list)
    decode_load: list[float] = field(default_factory=list)
    prefill_instances: list[int] = field(default_factory=list)  # serving prefill, at each sample
    decode_instances: list[int] = field(default_factory=list)
    switches: list[tuple[float, int, str]] = field(default_factory=list)  # (ordered at, node, new role)
    replica_t: list[float] = field(default_factory=list)
    hot_key_replicas: list[float] = field(default_factory=list)  # mean instances holding a hot key
    pool_evictions: int = 0
    pool_blocks_held: int = 0  # at the end of the run
    wall_s: float = 0.0


# The simulator's scheduler names -> the live Conductor's (``PlacementConfig.scheduler``).
_LIVE_SCHEDULER = {"random": "random", "load_balancing": "load", "local": "local", "global": "global"}


def make_scheduler(config: SimConfig, predictor: PrefillCostModel) -> PrefillScheduler:
    """The prefill scheduler, built by the live Conductor's own ``Placer`` (as
    ``Conductor._place`` does, with ``pool`` when the cluster has a KVCache pool) from the fitted
    prefill predictor and the NIC-bandwidth transfer model."""
    placement = PlacementConfig(
        scheduler=_LIVE_SCHEDULER[config.scheduler],
        kvcache_balancing_threshold=config.kvcache_balancing_threshold,
        transfer_bytes_per_s=config.hardware.nic_bytes_per_s,
    )
    placer = Placer(placement, predictor, None, config.block_size, config.model.kv_bytes_per_token,
                    seed=config.seed, pool=config.pool_enabled)
    return placer.scheduler


def make_admission(config: SimConfig) -> AdmissionPolicy:
    slo = SLO(config.ttft_slo_s, config.tbt_slo_s)
    step = config.decode_model()
    target = config.tbt_target
    if config.admission == "none":
        return AcceptAll(slo, step)
    if config.admission == "per_stage":
        return PerStageRejection(slo, step, target)
    if config.admission == "early":
        return EarlyRejection(slo, step, target)
    if config.admission == "predictive":
        return PredictiveEarlyRejection(slo, step, config.decode_time_s, target)
    return LateBindingRejection(slo, step, target)


class Simulator:
    def __init__(self, config: SimConfig, entries: Sequence[TraceEntry], admit: frozenset[int] = frozenset()) -> None:
        """``admit``: requests (by index in time order) the admission policy is overruled for,
        on arrival and at decode: a counterfactual replay (``bench/sim/false_rejects.py``)."""
        if not entries:
            raise ValueError("empty trace")
        self.config = config
        self._admit = admit
        self.entries = sorted(entries, key=lambda e: e.timestamp_ms)
        t0 = self.entries[0].timestamp_ms
        n = len(self.entries)
        self.arrival = np.array([(e.timestamp_ms - t0) / 1000.0 / config.speed for e in self.entries])
        self.input_length = np.array([e.input_length for e in self.entries], dtype=np.int64)
        outs = [config.output_tokens or max(e.output_length, 1) for e in self.entries]
        self.output_length = np.array(outs, dtype=np.int64)
        self.status = np.full(n, COMPLETED, dtype=np.int8)
        self.ttft = np.full(n, np.nan)
        self.first_token_at = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.prefix = np.zeros(n, dtype=np.int64)
        self.pulled = np.zeros(n, dtype=np.int64)
        self.pool_loaded = np.zeros(n, dtype=np.int64)
        self.prefill_s = np.zeros(n)
        self.decode_of = np.full(n, -1, dtype=np.int64)

        node = config.prefill_model()
        self.true_prefill = config.pipelined(node)
        self.transfer = config.transfer_model()
        step = config.decode_model()
        # The Conductor predicts a group's time with the same pipeline over the fitted node profile.
        fitted = fit_prefill_predictor(node, config.profile_noise, config.seed)
        predictor = config.pipelined(fitted)
        self.scheduler = make_scheduler(config, predictor)
        self.node_prefill = node
        # One cluster-wide LRU of block keys; None: no pool.
        self.pool = LRUBlockCache(config.pool_capacity_blocks) if config.pool_enabled else None
        self.balancer = DecodeLoadBalancer(step)
        self.admission = make_admission(config)
        self.slo = self.admission.slo
        self.step_model = step
        self.local = None
        if config.local_prefill:
            # A decode node prefills alone, every layer itself: the fitted one-node model.
            self.local = LocalPrefill(fitted, step, self.slo, config.local_prefill_chunk, config.block_size)
        self.local_prefilled = np.zeros(n, dtype=bool)
        # A group's stages each hold their layers' share of a token's KV: together as many tokens
        # as each node's DRAM holds whole.
        group_blocks = None if config.cache_capacity_blocks is None else config.cache_capacity_blocks * config.cpp_stages
        # Node i is self.prefill[i] and self.decode[i]; self.roles says which side serves.
        nodes = config.n_prefill_groups + config.n_decode
        self.prefill = [PrefillInstance(i, LRUBlockCache(group_blocks), config.cpp_stages) for i in range(nodes)]
        self.decode = [DecodeInstance(i, step, self._on_finish, self._on_first_token) for i in range(nodes)]
        policy = None
        if config.elastic is not None:
            policy = ElasticRolePolicy(config.elastic, self.slo, step, config.tbt_target)
        self.roles = Roles(self.prefill, self.decode, config.n_prefill_groups, policy, self._replan)
        self._moving: set[int] = set()  # requests whose KV is being copied to the decode node they joined
        counts = Counter(k for e in self.entries for k in e.hash_ids)
        self.hot_keys = [k for k, _ in counts.most_common(config.hot_keys)]
        self.result = SimResult(
            config=config,
            arrival_s=self.arrival,
            input_length=self.input_length,
            output_length=self.output_length,
            status=self.status,
            ttft_s=self.ttft,
            tbt_s=np.full(n, np.nan),
            finish_s=self.finish,
            prefix_tokens=self.prefix,
            pulled_tokens=self.pulled,
            prefill_s=self.prefill_s,
            pool_tokens=self.pool_loaded,
            local_prefill=self.local_prefilled,
        )

    def _on_first_token(self, request: int, t: float) -> None:
        """A local prefill's last chunk ended."""
        self.first_token_at[request] = t
        self.ttft[request] = t - self.arrival[request]

    def _on_finish(self, request: int, t: float) -> None:
        self.finish[request] = t
        self.admission.observe_decode(t - self.first_token_at[request])

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        cfg = self.config
        # (time, request, moved): KV reaching its planned decode node, or a node it was moved to.
        joins: list[tuple[float, int, bool]] = []
        # (time, request): a prefill ending, its prompt's keys going to the pool (pool only).
        stores: list[tuple[float, int]] = []
        next_sample, next_replica = 0.0, 0.0
        i, n = 0, len(self.entries)
        while i < n or joins or stores:
            t_arrival = self.arrival[i] if i < n else math.inf
            t_join = joins[0][0] if joins else math.inf
            t_store = stores[0][0] if stores else math.inf
            if t_store <= min(t_arrival, t_join):
                # The pool takes a prefill's keys before anything at the same instant looks.
                _, request = heapq.heappop(stores)
                self.pool.insert(self.entries[request].hash_ids)
                continue
            t = min(t_arrival, t_join)
            while next_sample <= t:
                self.roles.until(next_sample)
                self._sample_load(next_sample)
                next_sample += cfg.sample_interval_s
            while next_replica <= t:
                self._sample_replicas(next_replica)
                next_replica += cfg.replica_interval_s
            self.roles.until(t)
            if t_join <= t_arrival:
                _, request, moved = heapq.heappop(joins)
                if moved:
                    self._kv_moved(t, request)
                else:
                    landed = self._kv_arrives(t, request)
                    if landed is not None:
                        heapq.heappush(joins, (landed, request, True))
            else:
                ready = self._arrive(t, i)
                if ready is not None:
                    heapq.heappush(joins, (ready, i, False))
                    if self.pool is not None:
                        heapq.heappush(stores, (self.first_token_at[i], i))
                i += 1
        while any(d.running or d.local for d in self.decode):
            self._sample_load(next_sample)
            next_sample += cfg.sample_interval_s
        for d in self.decode:
            d.drain()
        self._fill_tbt()
        self.result.switches = [(t, node, role.value) for t, node, role in self.roles.switches]
        if self.pool is not None:
            self.result.pool_evictions = self.pool.evictions
            self.result.pool_blocks_held = len(self.pool)
        self.result.wall_s = time.perf_counter() - wall0
        return self.result

    def _arrive(self, now: float, i: int) -> float | None:
        """Route or reject request ``i``; returns when its KV reaches decode, None if rejected."""
        entry = self.entries[i]
        n = entry.input_length
        pool_blocks = self.pool.match_len(entry.hash_ids) if self.pool is not None else 0
        request = RequestInfo(request_id=i, input_length=n, block_keys=entry.hash_ids, pool_blocks=pool_blocks)
        plan = self.scheduler.select(request, [p.state(now) for p in self.roles.serving_prefill])
        if self.roles.elastic:
            cost = self.scheduler.estimator.cost
            cached_s = cost.seconds(n, 0) - cost.seconds(n, plan.local_prefix_tokens)
            prediction = TTFTPrediction(plan.instance, len(self.roles.serving_prefill), plan.queue_s,
                                        plan.transfer_s + plan.prefill_s, cached_s)
            self.roles.log.add_ttft(now, prediction)
        for d in self.roles.serving_decode:
            d.advance_to(now)
        decode_pool = [d.state() for d in self.roles.serving_decode]
        dplan = self.balancer.select(request, decode_pool)
        if i not in self._admit and not self.admission.on_arrival(now, request, plan, dplan, decode_pool).accept:
            self.status[i] = REJECTED_ON_ARRIVAL
            return None
        if self.local is not None:
            choice = self.local.choose(request, plan, next(s for s in decode_pool if s.index == dplan.instance))
            if choice.local:
                seconds = self.node_prefill.seconds(n, choice.prefix_tokens)
                chunks = max(1, math.ceil((n - choice.prefix_tokens) / self.config.local_prefill_chunk))
                self.decode[dplan.instance].prefill_locally(i, n, [seconds / chunks] * chunks,
                                                            int(self.output_length[i]) - 1)
                self.decode_of[i] = dplan.instance
                self.prefix[i] = choice.prefix_tokens
                self.prefill_s[i] = seconds
                self.local_prefilled[i] = True
                return None  # no KV to move: its first token comes from the decode node
        inst = self.prefill[plan.instance]
        inputs_ready = now
        if plan.source is not None:
            inputs_ready = self.prefill[plan.source].send(now, self.transfer.seconds(plan.transfer_tokens))
            self.pulled[i] = plan.transfer_tokens
        elif plan.from_pool:
            # The loaded blocks cross the NIC at the transfer bandwidth, as the estimator planned.
            inputs_ready = now + self.transfer.seconds(plan.transfer_tokens)
            self.pool.insert(entry.hash_ids[:pool_blocks])  # a read is a use
            self.pool_loaded[i] = plan.transfer_tokens
        seconds = self.true_prefill.seconds(n, plan.prefix_tokens)
        chunks = self.true_prefill.chunk_stage_seconds(n, plan.prefix_tokens)
        end = inst.run(now, chunks, inputs_ready, self.true_prefill.base.c_0)
        inst.cache.insert(entry.hash_ids)
        self.prefix[i] = plan.prefix_tokens
        self.prefill_s[i] = seconds
        self.ttft[i] = end - now
        self.first_token_at[i] = end
        self.decode_of[i] = dplan.instance
        # The Conductor's own prediction of when the KV lands, as the decode state reports it.
        self.decode[dplan.instance].incoming[i] = (now + plan.ttft_s, n)
        computed = n - plan.prefix_tokens
        last_chunk = computed - (max(computed - 1, 0) // self.config.prefill_chunk) * self.config.prefill_chunk
        # Each stage streams its own layers' share: the last stage's share of the last chunk trails.
        return end + self.transfer.seconds(last_chunk) / self.config.cpp_stages

    def _kv_arrives(self, now: float, i: int) -> float | None:
        """The decode side decides; returns when the KV lands elsewhere if it must move first."""
        planned = int(self.decode_of[i])
        for d in self.roles.serving_decode:
            d.advance_to(now)
        del self.decode[planned].incoming[i]
        n = int(self.input_length[i])
        request = RequestInfo(request_id=i, input_length=n, block_keys=self.entries[i].hash_ids)
        pool = [d.state() for d in self.roles.serving_decode]
        if self.roles.elastic:
            # The planned instance's batch with this request: one it cannot take is refused, or
            # moved at the cost of a KV copy in its first gap. (The least loaded instance's
            # batch, i.e. refusals only, saw too few misses: bench/README.md, issue 32.)
            own = next(s for s in pool if s.index == planned)
            self.roles.log.add_tbt(now, TBTPrediction(len(pool), own.batch_size + 1, own.context_tokens + n))
        chosen = planned if i in self._admit else self.admission.on_decode(request, pool, planned)
        if chosen is None:
            self.status[i] = REJECTED_AT_DECODE
            return None
        if chosen != planned:
            # The KV sits in the planned node's DRAM; copy it over, holding the place on the target.
            self.decode_of[i] = chosen
            landed = now + self.transfer.seconds(n)
            self.decode[chosen].incoming[i] = (landed, n)
            self._moving.add(i)
            return landed
        self.decode[planned].join(i, n, int(self.output_length[i]) - 1)
        return None

    def _kv_moved(self, now: float, i: int) -> None:
        inst = self.decode[self.decode_of[i]]
        inst.advance_to(now)
        del inst.incoming[i]
        self._moving.discard(i)
        inst.join(i, int(self.input_length[i]), int(self.output_length[i]) - 1)

    def _replan(self, node: int, now: float) -> None:
        """A decode node starts draining: the requests routed to it whose KV has not landed are
        routed again over the serving decode nodes, as on arrival (the KV being copied to it
        already, ``_moving``, joins it)."""
        draining = self.decode[node]
        for d in self.roles.serving_decode:
            d.advance_to(now)
        for i in [r for r in draining.incoming if r not in self._moving]:
            ready, n = draining.incoming.pop(i)
            request = RequestInfo(request_id=i, input_length=n, block_keys=self.entries[i].hash_ids)
            dplan = self.balancer.select(request, [d.state() for d in self.roles.serving_decode])
            self.decode_of[i] = dplan.instance
            self.decode[dplan.instance].incoming[i] = (ready, n)

    def _sample_load(self, t: float) -> None:
        for d in self.decode:
            d.advance_to(t)
        prefill, decode = self.roles.serving_prefill, self.roles.serving_decode
        r = self.result
        r.sample_t.append(t)
        r.prefill_load.append(sum(p.queue_s(t) for p in prefill) / (len(prefill) * self.slo.ttft_s))
        r.decode_load.append(current_decode_load(self.step_model, self.slo, [d.state() for d in decode]))
        r.prefill_instances.append(len(prefill))
        r.decode_instances.append(len(decode))

    def _sample_replicas(self, t: float) -> None:
        if not self.hot_keys:
            return
        held = sum(1 for k in self.hot_keys for p in self.roles.serving_prefill if k in p.cache)
        self.result.replica_t.append(t)
        self.result.hot_key_replicas.append(held / len(self.hot_keys))

    def _fill_tbt(self) -> None:
        """TBT of each request: the mean of its longest 10% inter-token gaps (FAST'25 §5.1)."""
        step_end = [np.asarray(d.step_end) for d in self.decode]
        tbt = self.result.tbt_s
        for i in np.flatnonzero(~np.isnan(self.finish)):
            steps = int(self.output_length[i]) - 1
            if steps <= 0:
                continue
            d = self.decode_of[i]
            s0 = self.decode[d].join_step[i]
            ends = step_end[d][s0 : s0 + steps]
            gaps = np.empty(steps)
            gaps[0] = ends[0] - self.first_token_at[i]
            gaps[1:] = np.diff(ends)
            k = max(1, math.ceil(0.1 * steps))
            tbt[i] = np.partition(gaps, steps - k)[steps - k :].mean()


def simulate(config: SimConfig, entries: Sequence[TraceEntry], admit: frozenset[int] = frozenset()) -> SimResult:
    return Simulator(config, entries, admit).run()
