"""Where a prompt is prefilled, chosen per request: on a prefill instance, as Mooncake
does, or on the decode instance that will decode it.

Local prefill saves the queue behind other prompts on the prefill instance and the KV's trip
between the two; it costs the decode instance's running streams: it computes the prompt between
their tokens (chunked prefill, at most ``chunk_tokens`` a step), so while it does, each of their
steps is longer by a chunk. Mooncake's authors send only long prefills to a remote cluster
(PrfaaS); here the decision is the cost models', request by request.

With the decode instance's own calibrated models (its ``PrefillCostModel``, its
``DecodeStepModel``), the prefix it caches and the local prefills already placed on it::

    prefill_s = prefill.seconds(input, cached prefix)          the prompt's compute there
    chunks    = ceil((input - cached prefix) / chunk_tokens)   steps it spreads over
    step_s    = step.step_s(batch + 1, context + input)         a decode step once it joins
    stall_s   = step_s + prefill_s / chunks                    a step while a chunk computes
    ttft_s    = queued local prefill + prefill_s + chunks * step_s

Local when the prefill instance would add something beyond the compute (a queue, a pull, or a
shorter cached prefix than the decode instance's) and both SLOs hold that way sooner: ``stall_s``
within the TBT SLO (the running streams keep theirs), ``ttft_s`` within the TTFT SLO, and
``ttft_s`` at most ``margin`` (0.8) of the remote plan's. Without such a difference the two
plans are the same compute on the same kind of hardware, and only the noise of two calibrations
(tens of percent apart for a prompt of a few tokens, seen on a loaded 2-core machine) would
choose; the margin keeps that noise from sending a long prompt to stall a decode batch for nothing.

Pure code: the Conductor (``cluster/conductor/placement.py``) and the simulator
(``bench/sim/simulator.py``) both call ``LocalPrefill.choose``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cluster.policies.cost_model import DecodeStepModel, PrefillTime
from cluster.policies.early_rejection import SLO
from cluster.policies.prefix_index import prefix_tokens
from cluster.policies.scheduling import PrefillPlan
from cluster.policies.snapshot import DecodeInstanceState, RequestInfo


@dataclass(frozen=True)
class LocalPlan:
    """The prediction for prefilling on a decode instance, and whether to."""

    instance: int
    local: bool
    prefix_tokens: int  # cached there
    prefill_s: float
    ttft_s: float
    stall_s: float  # the running batch's step while a chunk of the prompt computes


@dataclass(frozen=True)
class LocalPrefill:
    prefill: PrefillTime  # the decode instance's prefill time
    step: DecodeStepModel  # its decode step
    slo: SLO
    chunk_tokens: int  # prompt tokens a step computes at most (the engine's step budget)
    block_size: int
    margin: float = 0.8  # local only at most this fraction of the remote plan's TTFT

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.block_size < 1:
            raise ValueError(f"chunk_tokens and block_size must be positive, got {self.chunk_tokens}, {self.block_size}")
        if not 0 < self.margin <= 1:
            raise ValueError(f"margin must be in (0, 1], got {self.margin}")

    def plan(self, request: RequestInfo, decode: DecodeInstanceState) -> LocalPlan:
        """The prediction for ``request`` on ``decode`` (``local`` False)."""
        n = request.input_length
        cached_blocks = 0 if decode.cache is None else decode.cache.match_len(request.block_keys)
        prefix = prefix_tokens(cached_blocks, n, self.block_size)
        prefill_s = self.prefill.seconds(n, prefix)
        chunks = max(1, math.ceil((n - prefix) / self.chunk_tokens))
        step_s = self.step.step_s(decode.batch_size + 1, decode.context_tokens + n)
        stall_s = step_s + prefill_s / chunks
        ttft_s = decode.local_prefill_s + prefill_s + chunks * step_s
        return LocalPlan(decode.index, False, prefix, prefill_s, ttft_s, stall_s)

    def choose(self, request: RequestInfo, remote: PrefillPlan, decode: DecodeInstanceState) -> LocalPlan:
        """``plan``, with ``local`` set where the prefill instance would add a queue, a pull or a
        shorter prefix, and local meets both SLOs clearly sooner than ``remote``."""
        p = self.plan(request, decode)
        differs = remote.queue_s > 0 or remote.transfer_s > 0 or p.prefix_tokens > remote.prefix_tokens
        local = (differs and p.stall_s <= self.slo.tbt_s and p.ttft_s <= self.slo.ttft_s
                 and p.ttft_s <= self.margin * remote.ttft_s)
        return dataclasses.replace(p, local=local)
