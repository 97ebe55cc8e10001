"""Admission control under overload (arXiv 2407.00079 §7): accept a request or reject it (HTTP 429).

Loads are SLO-relative: prefill load = predicted TTFT / TTFT SLO, decode load = predicted TBT /
TBT SLO; a stage is overloaded at load >= 1. Every policy answers two questions: on arrival
(``on_arrival``), and when the request's KV reaches its decode instance (``on_decode``, the decode
node's own double check, since its load may have changed during prefill).

* ``AcceptAll`` — no control (the scheduling experiments).
* ``PerStageRejection`` — the baseline: each stage judges only its own load when the request
  reaches it, so a request refused by decode has already spent its prefill.
* ``EarlyRejection`` — also refuse on arrival when the decode pool is loaded *now*. It reacts
  one prefill time late, which makes prefill and decode loads swing in anti-phase.
* ``PredictiveEarlyRejection`` — judge the decode pool as it will be when the request gets
  there: requests finishing prefill by then have joined, and every running request is assumed to
  decode for a uniform ``t_d`` seconds (the paper's system-level prediction).
* ``SurvivalPredictiveRejection`` — ours, see its docstring.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from cluster.cost_model import DecodeStepModel
from cluster.instance_state import DecodeInstanceState, RequestInfo
from cluster.scheduling import DecodePlan, PrefillPlan


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tbt_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tbt_s <= 0:
            raise ValueError(f"SLOs must be positive: {self}")


@dataclass(frozen=True)
class Decision:
    accept: bool
    prefill_load: float
    decode_load: float


def current_decode_load(step: DecodeStepModel, slo: SLO, pool: Sequence[DecodeInstanceState]) -> float:
    """Mean over decode instances of (step time of the batch running now) / TBT SLO."""
    return sum(step.step_s(s.batch_size, s.context_tokens) for s in pool) / (len(pool) * slo.tbt_s)


class AdmissionPolicy(ABC):
    def __init__(self, slo: SLO, step: DecodeStepModel) -> None:
        self.slo = slo
        self.step = step

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

    def on_decode(self, request: RequestInfo, state: DecodeInstanceState) -> bool:
        """Decode-side check: the instance's TBT with this request added stays within the SLO."""
        tbt = self.step.step_s(state.batch_size + 1, state.context_tokens + request.input_length)
        return tbt <= self.slo.tbt_s

    def observe_decode(self, duration_s: float) -> None:
        """Told the decode duration of every finished request; only learning policies use it."""


class AcceptAll(AdmissionPolicy):
    def on_arrival(self, now, request, prefill, decode, decode_pool) -> Decision:  # type: ignore[override]
        return Decision(True, prefill.ttft_s / self.slo.ttft_s, decode.predicted_tbt_s / self.slo.tbt_s)

    def on_decode(self, request: RequestInfo, state: DecodeInstanceState) -> bool:
        return True


class PerStageRejection(AdmissionPolicy):
    def on_arrival(self, now, request, prefill, decode, decode_pool) -> Decision:  # type: ignore[override]
        load = prefill.ttft_s / self.slo.ttft_s
        return Decision(load < 1.0, load, current_decode_load(self.step, self.slo, decode_pool))


class EarlyRejection(AdmissionPolicy):
    def on_arrival(self, now, request, prefill, decode, decode_pool) -> Decision:  # type: ignore[override]
        p_load = prefill.ttft_s / self.slo.ttft_s
        d_load = current_decode_load(self.step, self.slo, decode_pool)
        return Decision(max(p_load, d_load) < 1.0, p_load, d_load)


class PredictiveEarlyRejection(AdmissionPolicy):
    """Early rejection on the decode load predicted for the moment the request reaches decode."""

    def __init__(self, slo: SLO, step: DecodeStepModel, decode_time_s: float) -> None:
        super().__init__(slo, step)
        if decode_time_s <= 0:
            raise ValueError(f"decode_time_s must be positive, got {decode_time_s}")
        self.t_d = decode_time_s

    def on_arrival(self, now, request, prefill, decode, decode_pool) -> Decision:  # type: ignore[override]
        p_load = prefill.ttft_s / self.slo.ttft_s
        at = now + prefill.ttft_s
        total = 0.0
        for s in decode_pool:
            batch, context = s.batch_size, s.context_tokens
            for start, prompt in zip(s.running_start_s, s.running_prompt):
                if start + self.t_d <= at:
                    batch -= 1
                    context -= prompt
            for ready, prompt in zip(s.incoming_ready_s, s.incoming_prompt):
                if ready <= at:
                    batch += 1
                    context += prompt
            if s.index == decode.instance:
                batch += 1
                context += request.input_length
            total += self.step.step_s(batch, max(context, 0))
        d_load = total / (len(decode_pool) * self.slo.tbt_s)
        return Decision(max(p_load, d_load) < 1.0, p_load, d_load)


class SurvivalPredictiveRejection(AdmissionPolicy):
    """Ours: predict the decode instance the request is routed to, with learned decode lifetimes.

    Prediction-based early rejection assumes every decode lasts exactly ``t_d`` and averages the
    load over the pool. Decode lengths are heavy-tailed, so a request that has decoded for a
    while is likely to go on; and the request joins *one* instance, whose own check decides
    whether it is rejected after prefill. This policy keeps the durations of recently finished
    decodes and, for each sequence running on the chosen instance, weights it by the probability
    of still running at the horizon given its age, ``S(age + h) / S(age)`` with ``S`` the
    empirical survival function; routed requests that land by the horizon count in full. It
    accepts iff the prefill load and that instance's predicted load are below 1. Until
    ``min_samples`` decodes have finished it falls back to the uniform ``t_d``.
    """

    def __init__(
        self,
        slo: SLO,
        step: DecodeStepModel,
        prior_decode_time_s: float,
        window: int = 2000,
        min_samples: int = 50,
    ) -> None:
        super().__init__(slo, step)
        if prior_decode_time_s <= 0 or window <= 0 or not 0 < min_samples <= window:
            raise ValueError("need prior_decode_time_s > 0 and 0 < min_samples <= window")
        self.prior = prior_decode_time_s
        self.min_samples = min_samples
        self._recent: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self._stale = False

    def observe_decode(self, duration_s: float) -> None:
        self._recent.append(duration_s)
        self._stale = True

    def _survival(self, x: float) -> float:
        """P(decode lasts > x), smoothed so that a sequence older than every sample still counts."""
        d = self._sorted
        return (len(d) - bisect.bisect_right(d, x) + 1) / (len(d) + 1)

    def _still_running(self, age: float, horizon: float) -> float:
        if len(self._recent) < self.min_samples:
            return 1.0 if age + horizon < self.prior else 0.0
        return self._survival(age + horizon) / self._survival(age)

    def on_arrival(self, now, request, prefill, decode, decode_pool) -> Decision:  # type: ignore[override]
        if self._stale:
            self._sorted = sorted(self._recent)
            self._stale = False
        p_load = prefill.ttft_s / self.slo.ttft_s
        horizon = prefill.ttft_s
        at = now + horizon
        state = next(s for s in decode_pool if s.index == decode.instance)
        batch = 1.0
        context = float(request.input_length + state.context_tokens - sum(state.running_prompt))
        for start, prompt in zip(state.running_start_s, state.running_prompt):
            alive = self._still_running(now - start, horizon)
            batch += alive
            context += alive * prompt
        for ready, prompt in zip(state.incoming_ready_s, state.incoming_prompt):
            if ready <= at:
                batch += 1
                context += prompt
        d_load = self.step.step_s(batch, context) / self.slo.tbt_s
        return Decision(max(p_load, d_load) < 1.0, p_load, d_load)
