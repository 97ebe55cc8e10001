"""Admission control under overload (arXiv 2407.00079 §7): accept a request or reject it (HTTP 429).

Loads are SLO-relative: prefill load = predicted TTFT / TTFT SLO, decode load = predicted TBT /
TBT limit (the SLO times ``tbt_target``); a stage is overloaded at load >= 1. Every policy answers two questions: on arrival
(``on_arrival``), and when the request's KV reaches its decode instance (``on_decode``, the decode
node's own double check, since its load may have changed during prefill).

* ``AcceptAll`` — no control (the scheduling experiments).
* ``EarlyRejection`` — also refuse on arrival when the decode pool is loaded *now*. It reacts
  one prefill time late, which makes prefill and decode loads swing in anti-phase.
* ``PredictiveEarlyRejection`` — judge the decode pool as it will be when the request gets
  there: requests finishing prefill by then have joined, and every running request is assumed to
  decode for a uniform ``t_d`` seconds (the paper's system-level prediction).

These three are what the live Conductor offers. The simulator's other baselines (per-stage
rejection, late decode binding) are in ``bench/sim/baselines.py``, on the same ``AdmissionPolicy``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from cluster.policies.cost_model import DecodeStepModel, PrefillTime
from cluster.policies.snapshot import DecodeInstanceState, RequestInfo
from cluster.policies.scheduling import DecodePlan, PrefillPlan


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tbt_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tbt_s <= 0:
            raise ValueError(f"SLOs must be positive: {self}")


# The SLOs a request is held to when the operator sets none: the arXiv paper's
# end-to-end ones, TTFT within 10x and TBT within 5x what the request would see run alone on an
# idle cluster (its prompt's prefill, one decode step at its context), as the calibrated cost
# models predict them; with floors, since a few-token prompt alone would get a TTFT bound a
# single scheduling hiccup breaks: a second for the first token, and FAST'25's tightest TBT
# threshold (100 ms), which no one reading a stream notices.
DEFAULT_TTFT_FACTOR, DEFAULT_TBT_FACTOR = 10.0, 5.0
DEFAULT_TTFT_FLOOR_S, DEFAULT_TBT_FLOOR_S = 1.0, 0.1


def request_tbt(gaps: Sequence[float]) -> float:
    """A request's TBT (FAST'25 §5.1): the mean of its longest 10% inter-token gaps (at least
    one); 0 without any gap."""
    if not gaps:
        return 0.0
    k = max(1, math.ceil(0.1 * len(gaps)))
    return sum(sorted(gaps, reverse=True)[:k]) / k


def default_slo(prefill: PrefillTime, step: DecodeStepModel, input_length: int) -> SLO:
    """The SLOs for a request of ``input_length`` prompt tokens when none are configured."""
    return SLO(max(DEFAULT_TTFT_FACTOR * prefill.seconds(input_length), DEFAULT_TTFT_FLOOR_S),
               max(DEFAULT_TBT_FACTOR * step.step_s(1, input_length), DEFAULT_TBT_FLOOR_S))


@dataclass(frozen=True)
class Decision:
    accept: bool
    prefill_load: float
    decode_load: float


def current_decode_load(step: DecodeStepModel, slo: SLO, pool: Sequence[DecodeInstanceState]) -> float:
    """Mean over decode instances of (step time of the batch running now) / TBT SLO."""
    return sum(step.step_s(s.batch_size, s.context_tokens) for s in pool) / (len(pool) * slo.tbt_s)


class AdmissionPolicy(ABC):
    def __init__(self, slo: SLO, step: DecodeStepModel, tbt_target: float = 1.0) -> None:
        """``tbt_target``: fraction of the TBT SLO a decode instance is filled up to. A request's
        TBT is its worst 10% of gaps, and contexts grow after admission, so an instance filled to
        exactly the SLO breaks it for about half its requests."""
        if not 0 < tbt_target <= 1:
            raise ValueError(f"tbt_target must be in (0, 1], got {tbt_target}")
        self.slo = slo
        self.step = step
        self.tbt_limit = slo.tbt_s * tbt_target

    @abstractmethod
    def on_arrival(
        self,
        now: float,
        request: RequestInfo,
        prefill: PrefillPlan,
        decode: DecodePlan,
        decode_pool: Sequence[DecodeInstanceState],
    ) -> Decision:
        ...

    def prefill_load(self, prefill: PrefillPlan) -> float:
        """Predicted TTFT relative to the TTFT SLO."""
        return prefill.ttft_s / self.slo.ttft_s

    def tbt_with(self, request: RequestInfo, state: DecodeInstanceState) -> float:
        """The instance's step time once this request has joined its batch."""
        return self.step.step_s(state.batch_size + 1, state.context_tokens + request.input_length)

    def fits(self, request: RequestInfo, state: DecodeInstanceState) -> bool:
        """The instance's TBT with this request added stays within the SLO."""
        return self.tbt_with(request, state) <= self.tbt_limit

    def on_decode(
        self, request: RequestInfo, decode_pool: Sequence[DecodeInstanceState], planned: int
    ) -> int | None:
        """When the KV reaches decode instance ``planned``: the instance to join, or None to reject.

        The paper's decode node checks only itself.
        """
        state = next(s for s in decode_pool if s.index == planned)
        return planned if self.fits(request, state) else None

    def observe_decode(self, duration_s: float) -> None:
        """Told the decode duration of every finished request; only learning policies use it."""


class AcceptAll(AdmissionPolicy):
    def on_arrival(
        self,
        now: float,
        request: RequestInfo,
        prefill: PrefillPlan,
        decode: DecodePlan,
        decode_pool: Sequence[DecodeInstanceState],
    ) -> Decision:
        return Decision(True, self.prefill_load(prefill), decode.predicted_tbt_s / self.tbt_limit)

    def on_decode(
        self, request: RequestInfo, decode_pool: Sequence[DecodeInstanceState], planned: int
    ) -> int | None:
        return planned


class EarlyRejection(AdmissionPolicy):
    """The decode node's check, moved before prefill: the chosen instance's TBT now, with the request."""

    def on_arrival(
        self,
        now: float,
        request: RequestInfo,
        prefill: PrefillPlan,
        decode: DecodePlan,
        decode_pool: Sequence[DecodeInstanceState],
    ) -> Decision:
        p_load = self.prefill_load(prefill)
        state = next(s for s in decode_pool if s.index == decode.instance)
        d_load = self.tbt_with(request, state) / self.tbt_limit
        return Decision(max(p_load, d_load) < 1.0, p_load, d_load)


class PredictiveEarlyRejection(AdmissionPolicy):
    """Early rejection on the decode load predicted for the moment the request reaches decode.

    At ``at = now + predicted TTFT`` each decode instance holds the requests (running, or routed
    to it with KV landing by ``at``; this one included, on its chosen instance) whose decode,
    assumed to last a uniform ``t_d`` from when it starts, has not ended by ``at``; the decode
    load is the mean over the pool of that batch's step time relative to the TBT limit (arXiv
    §7.3). A departing request takes its generated tokens with it (estimated from its age).
    The contexts of the remaining ones are taken as they are now.
    """

    def __init__(
        self, slo: SLO, step: DecodeStepModel, decode_time_s: float, tbt_target: float = 1.0
    ) -> None:
        super().__init__(slo, step, tbt_target)
        if decode_time_s <= 0:
            raise ValueError(f"decode_time_s must be positive, got {decode_time_s}")
        self.t_d = decode_time_s

    def on_arrival(
        self,
        now: float,
        request: RequestInfo,
        prefill: PrefillPlan,
        decode: DecodePlan,
        decode_pool: Sequence[DecodeInstanceState],
    ) -> Decision:
        p_load = self.prefill_load(prefill)
        at = now + prefill.ttft_s
        total = 0.0
        for s in decode_pool:
            batch, context = s.batch_size, s.context_tokens
            # A departing sequence takes its whole context with it, the tokens it generated
            # included. Every running sequence gains one token per step, so its generated
            # tokens are the batch's generated total shared in proportion to its age.
            generated = max(context - sum(s.running_prompt), 0)
            if s.index == decode.instance:
                batch += 1
                context += request.input_length
            ages = [max(now - start, 0.0) for start in s.running_start_s]
            age_sum = sum(ages)
            for start, prompt, age in zip(s.running_start_s, s.running_prompt, ages):
                if start + self.t_d <= at:
                    batch -= 1
                    context -= prompt + (generated * age / age_sum if age_sum > 0 else 0.0)
            # Routed requests count if their KV has landed by ``at`` and, like running ones,
            # their decode (``t_d`` from landing) has not ended by then.
            for ready, prompt in zip(s.incoming_ready_s, s.incoming_prompt):
                if ready <= at < ready + self.t_d:
                    batch += 1
                    context += prompt
            total += self.step.step_s(batch, max(context, 0))
        d_load = total / (len(decode_pool) * self.tbt_limit)
        return Decision(max(p_load, d_load) < 1.0, p_load, d_load)
