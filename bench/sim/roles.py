"""Which role each simulated node serves, and the switches the elastic-roles policy orders (issue 32).

Every node has a prefill side (``PrefillInstance``: its FIFO and its DRAM prefix cache) and a
decode side (``DecodeInstance``); it serves one role at a time, and only its serving side is
shown to the schedulers and admission. With fixed roles (``SimConfig.elastic`` None) the first
``n_prefill`` nodes prefill and the rest decode, and nothing here ever changes.

With elastic roles, every ``ElasticConfig.interval_s`` the simulator's predictions of the last
interval go to ``cluster.policies.elastic_roles.ElasticRolePolicy`` (the code the live Conductor
will call), and a switch it orders runs as follows:

* the node stops taking new work of its old role at once (it leaves the serving list);
* prefill -> decode: its queued prefills run to their end (FIFO, so the drain's end is known);
* decode -> prefill: the requests routed to it whose KV has not landed are routed again by the
  simulator (``replan``: the decode balancer over the serving nodes), those whose KV is already
  being copied to it join it, and its running batch decodes to its end;
* once drained it serves neither role for ``switch_cost_s``, then joins the other role's
  serving list. Its prefix cache stays: a prefill node turned decode has it when it comes back.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from bench.sim.decode import DecodeInstance
from bench.sim.prefill import PrefillInstance
from cluster.policies.elastic_roles import ElasticRolePolicy, PredictionLog, Role, RoleSwitch, RoleView

Replan = Callable[[int, float], None]  # (draining decode node, now): route its unlanded requests elsewhere


class Roles:
    """The nodes' roles, the serving lists the simulator shows its policies, and the switch in flight."""

    def __init__(
        self,
        prefill: Sequence[PrefillInstance],
        decode: Sequence[DecodeInstance],
        n_prefill: int,
        policy: ElasticRolePolicy | None,
        replan: Replan,
    ) -> None:
        if len(prefill) != len(decode):
            raise ValueError("every node needs a prefill side and a decode side")
        self.prefill = prefill
        self.decode = decode
        self.role = [Role.PREFILL if i < n_prefill else Role.DECODE for i in range(len(prefill))]
        self.policy = policy
        self.replan = replan
        self.serving_prefill: list[PrefillInstance] = []
        self.serving_decode: list[DecodeInstance] = []
        self._leaving: int | None = None  # the node of the switch in flight
        self._ordered_at = 0.0  # when the policy ordered it
        self._draining_decode = False  # that node still has decode work to finish
        self._ready: tuple[float, int] | None = None  # (when, node): the switch's end, once known
        self.changed_at = {i: 0.0 for i in range(len(prefill))}  # every node took its role at the start
        self.next_tick = policy.config.interval_s if policy is not None else math.inf
        # What the simulator predicts per request, for the policy (elastic only).
        self.log = PredictionLog(policy.config.horizon_s) if policy is not None else None
        self.switches: list[tuple[float, int, Role]] = []  # (ordered at, node, new role)
        self._rebuild()

    @property
    def elastic(self) -> bool:
        return self.policy is not None

    def _rebuild(self) -> None:
        serving = [i for i in range(len(self.role)) if i != self._leaving]
        self.serving_prefill = [self.prefill[i] for i in serving if self.role[i] is Role.PREFILL]
        self.serving_decode = [self.decode[i] for i in serving if self.role[i] is Role.DECODE]

    def until(self, t: float) -> None:
        """Run the role events up to ``t`` in time order: a switch's end, the policy's decisions."""
        while True:
            self._check_drain(t)
            t_ready = self._ready[0] if self._ready is not None else math.inf
            if min(t_ready, self.next_tick) > t:
                return
            if t_ready <= self.next_tick:
                self._finish()
            else:
                self._decide(self.next_tick)
                self.next_tick += self.policy.config.interval_s

    def _check_drain(self, t: float) -> None:
        """A draining decode node is found empty lazily; its drain ended at its last step."""
        if not self._draining_decode:
            return
        d = self.decode[self._leaving]
        d.advance_to(t)
        if d.running or d.waiting or d.incoming:
            return
        self._draining_decode = False
        drained = max(self._ordered_at, d.step_end[-1] if d.step_end else 0.0)
        self._ready = (drained + self.policy.config.switch_cost_s, self._leaving)

    def _decide(self, now: float) -> None:
        for d in self.serving_decode:
            d.advance_to(now)
        ttft, tbt = self.log.window(now)
        view = RoleView(
            now=now,
            prefill=[p.state(now) for p in self.serving_prefill],
            decode=[d.state() for d in self.serving_decode],
            ttft=ttft,
            tbt=tbt,
            switching=self._leaving is not None,
            changed_at=self.changed_at,
        )
        switch = self.policy.decide(view)
        if switch is not None:
            self._start(now, switch)

    def _start(self, now: float, switch: RoleSwitch) -> None:
        node = switch.instance
        self._leaving, self._ordered_at = node, now
        self.switches.append((now, node, switch.to_role))
        self._rebuild()
        if switch.to_role is Role.DECODE:
            # Its FIFO ends when the last queued chunk leaves its last stage.
            drained = max(now, self.prefill[node].stage_free_at[-1])
            self._ready = (drained + self.policy.config.switch_cost_s, node)
        else:
            self.replan(node, now)
            self._draining_decode = True

    def _finish(self) -> None:
        when, node = self._ready
        self.role[node] = Role.DECODE if self.role[node] is Role.PREFILL else Role.PREFILL
        self.changed_at[node] = when
        self._ready, self._leaving = None, None
        if self.role[node] is Role.DECODE:
            self.decode[node].advance_to(when)  # idle since it last decoded: its clock catches up
        self._rebuild()
