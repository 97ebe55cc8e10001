"""The admission baselines of the simulator's overload experiments (arXiv 2407.00079 §7).

They live here, not in ``cluster/policies/early_rejection.py``, because the live Conductor does
not offer them: it admits with ``AcceptAll``, ``EarlyRejection`` or ``PredictiveEarlyRejection``.
These two are what the simulator compares those against (``SimConfig.admission`` ``per_stage``
and ``late_binding``), on the same ``AdmissionPolicy`` contract and state snapshots.

* ``PerStageRejection``: the paper's baseline: each stage judges only its own load when the
  request reaches it, so a request refused by decode has already spent its prefill.
* ``LateBindingRejection``: ours: the decode instance is chosen when the KV is ready, so a
  request is refused after prefill only when no decode instance has room.
"""

from __future__ import annotations

from typing import Sequence

from cluster.policies.early_rejection import AdmissionPolicy, Decision, current_decode_load
from cluster.policies.scheduling import DecodePlan, PrefillPlan
from cluster.policies.snapshot import DecodeInstanceState, RequestInfo


class PerStageRejection(AdmissionPolicy):
    """Judge only the TTFT on arrival; the decode node checks itself when the KV arrives
    (``AdmissionPolicy.on_decode``)."""

    def on_arrival(
        self,
        now: float,
        request: RequestInfo,
        prefill: PrefillPlan,
        decode: DecodePlan,
        decode_pool: Sequence[DecodeInstanceState],
    ) -> Decision:
        load = self.prefill_load(prefill)
        return Decision(load < 1.0, load, current_decode_load(self.step, self.slo, decode_pool))


class LateBindingRejection(PerStageRejection):
    """Ours: bind the decode instance when the KV is ready; refuse after prefill only if none fits.

    The paper fixes the decode instance at arrival, so a request is refused after its prefill
    whenever that one instance is full, even if another has room. Here the decode side takes,
    when the KV arrives, the planned instance if it fits, else the least loaded one that fits
    (the KV, already in the planned node's DRAM, is copied over at the transfer bandwidth).
    On arrival only the TTFT is judged: a decode check then, on the pool as it is *now*,
    refused many requests for which an instance had room by the time their KV was ready.
    """

    def on_decode(
        self, request: RequestInfo, decode_pool: Sequence[DecodeInstanceState], planned: int
    ) -> int | None:
        fitting = [s for s in decode_pool if self.fits(request, s)]
        if not fitting:
            return None
        if any(s.index == planned for s in fitting):
            return planned
        return min(fitting, key=lambda s: self.step.step_s(s.batch_size, s.context_tokens)).index
