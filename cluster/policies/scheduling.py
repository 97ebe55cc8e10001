"""Conductor scheduling: which prefill instance and which decode instance serve a request.

Prefill schedulers, from the FAST'25 §5.2 comparison (Fig. 5):

* ``RandomScheduler`` — any instance.
* ``LoadBalancingScheduler`` — the shortest queue; caches are ignored when choosing (the chosen
  instance still reuses whatever prefix it happens to hold).
* ``LocalCacheAwareScheduler`` — the least estimated TTFT = queue + prefill given the prefix the
  instance holds itself.
* ``GlobalCacheAwareScheduler`` — Mooncake's Algorithm 1: as above, but an instance's prefix is
  the longest of its own, the KVCache pool's (``RequestInfo.pool_blocks``: loaded at the
  transfer bandwidth) and, when more than ``kvcache_balancing_threshold`` times longer than its
  own, the longest one another instance holds (pulled from it). The chosen instance keeps what
  it loaded or pulled, which is how hot prefixes get replicated. With a pool
  (``pull_from_instances=False``) the pool is the only remote source: every prefill stores its
  prompt there, and the pool replicates hot objects itself.

``DecodeLoadBalancer`` picks the decode instance with the least predicted time between tokens
once the request (and everything already routed there) has joined its batch.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from cluster.policies.cost_model import DecodeStepModel, PrefillTime, TransferModel
from cluster.policies.snapshot import DecodeInstanceState, PrefillInstanceState, RequestInfo
from cluster.policies.prefix_index import prefix_tokens


@dataclass(frozen=True)
class PrefillPlan:
    """Where a request prefills, which prefix it reuses, and the TTFT the Conductor expects."""

    instance: int
    prefix_tokens: int  # prompt tokens whose KV is reused (local, loaded or pulled)
    local_prefix_tokens: int  # of which the instance already held
    source: int | None  # instance the rest of the prefix is pulled from; None = no pull
    queue_s: float
    transfer_s: float
    prefill_s: float
    from_pool: bool = False  # the rest of the prefix is loaded from the KVCache pool

    @property
    def transfer_tokens(self) -> int:
        return self.prefix_tokens - self.local_prefix_tokens

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s


@dataclass(frozen=True)
class PrefillEstimator:
    """The Conductor's predictions: fitted prefill time and KV transfer time."""

    cost: PrefillTime
    transfer: TransferModel
    block_size: int = 512

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def plan(
        self,
        request: RequestInfo,
        inst: PrefillInstanceState,
        local_blocks: int,
        used_blocks: int,
        source: int | None,
        from_pool: bool = False,
    ) -> PrefillPlan:
        local = prefix_tokens(local_blocks, request.input_length, self.block_size)
        used = prefix_tokens(used_blocks, request.input_length, self.block_size)
        moved = source is not None or from_pool
        return PrefillPlan(
            instance=inst.index,
            prefix_tokens=used,
            local_prefix_tokens=local,
            source=source,
            queue_s=inst.queue_s,
            transfer_s=self.transfer.seconds(used - local) if moved else 0.0,
            prefill_s=self.cost.seconds(request.input_length, used),
            from_pool=from_pool,
        )

    def local_plan(self, request: RequestInfo, inst: PrefillInstanceState) -> PrefillPlan:
        blocks = inst.cache.match_len(request.block_keys)
        return self.plan(request, inst, blocks, blocks, None)


class PrefillScheduler(ABC):
    """Chooses the prefill instance for a request."""

    def __init__(self, estimator: PrefillEstimator) -> None:
        self.estimator = estimator

    @abstractmethod
    def select(self, request: RequestInfo, instances: Sequence[PrefillInstanceState]) -> PrefillPlan:
        ...


class RandomScheduler(PrefillScheduler):
    def __init__(self, estimator: PrefillEstimator, seed: int = 0) -> None:
        super().__init__(estimator)
        self._rng = random.Random(seed)

    def select(self, request: RequestInfo, instances: Sequence[PrefillInstanceState]) -> PrefillPlan:
        return self.estimator.local_plan(request, self._rng.choice(instances))


class LoadBalancingScheduler(PrefillScheduler):
    def select(self, request: RequestInfo, instances: Sequence[PrefillInstanceState]) -> PrefillPlan:
        inst = min(instances, key=lambda s: s.queue_s)
        return self.estimator.local_plan(request, inst)


class LocalCacheAwareScheduler(PrefillScheduler):
    def select(self, request: RequestInfo, instances: Sequence[PrefillInstanceState]) -> PrefillPlan:
        return min((self.estimator.local_plan(request, s) for s in instances), key=lambda p: p.ttft_s)


class GlobalCacheAwareScheduler(PrefillScheduler):
    """Algorithm 1 (KVCache-centric prefill scheduling) with hot-spot replication."""

    def __init__(self, estimator: PrefillEstimator, kvcache_balancing_threshold: float,
                 pull_from_instances: bool = True) -> None:
        super().__init__(estimator)
        self.pull_from_instances = pull_from_instances
        if kvcache_balancing_threshold < 1:
            # Below 1 an instance would "pull" a prefix shorter than its own.
            raise ValueError(f"kvcache_balancing_threshold must be >= 1, got {kvcache_balancing_threshold}")
        self.threshold = kvcache_balancing_threshold

    def select(self, request: RequestInfo, instances: Sequence[PrefillInstanceState]) -> PrefillPlan:
        keys = request.block_keys
        local = [s.cache.match_len(keys) for s in instances]
        best_len = max(local, default=0)
        source = instances[local.index(best_len)].index if best_len else None
        pool = request.pool_blocks
        best: PrefillPlan | None = None
        for inst, own in zip(instances, local):
            options = [self.estimator.plan(request, inst, own, own, None)]
            if pool > own:
                # Before a pull of the same length: the pool spreads reads over replicas, an
                # instance serves them on top of its own prefills.
                options.append(self.estimator.plan(request, inst, own, pool, None, from_pool=True))
            # own == 0 means any remote prefix is infinitely better (the paper's ratio guard).
            if self.pull_from_instances and best_len > max(own, pool) and (own == 0 or best_len / own > self.threshold):
                options.append(self.estimator.plan(request, inst, own, best_len, source))
            plan = min(options, key=lambda p: p.ttft_s)
            if best is None or plan.ttft_s < best.ttft_s:
                best = plan
        if best is None:
            raise ValueError("no prefill instances")
        return best


@dataclass(frozen=True)
class DecodePlan:
    instance: int
    predicted_tbt_s: float


def predicted_tbt(step: DecodeStepModel, state: DecodeInstanceState, extra_prompt: int = 0) -> float:
    """Step time once everything routed to ``state`` (plus one ``extra_prompt`` request) runs."""
    batch = state.batch_size + len(state.incoming_ready_s) + (1 if extra_prompt else 0)
    context = state.context_tokens + sum(state.incoming_prompt) + extra_prompt
    return step.step_s(batch, context)


class DecodeLoadBalancer:
    """Least predicted TBT after the request joins (the paper's load-balancing decode scheduling)."""

    def __init__(self, step: DecodeStepModel) -> None:
        self.step = step

    def select(self, request: RequestInfo, instances: Sequence[DecodeInstanceState]) -> DecodePlan:
        if not instances:
            raise ValueError("no decode instances")
        best = min(instances, key=lambda s: predicted_tbt(self.step, s, request.input_length))
        return DecodePlan(best.index, predicted_tbt(self.step, best, request.input_length))
