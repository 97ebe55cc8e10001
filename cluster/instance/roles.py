"""An elastic instance's role, and its switch between prefill and decode.

A prefill or decode instance serves one role; a Conductor started with ``--elastic-roles`` may
move it to the other (``POST /instance/role``, ``SwitchRoleRequest``) without reloading anything:
the engine's role is a setting changed between two steps (``KVHandoff.switch_role``), its prefix
cache and pool segment stay as they are. ``RoleState`` is the state machine; the service drives
it (``InstanceService.switch_role``)::

    serving R --begin(S)--> draining R -> S --drained (finish(True))-------> serving S
                                            --past its deadline (finish(False))--> serving R

While it drains, **new work** of either role is refused with the refusals a Conductor already
places around: a reservation with ``NoKVRoom`` (the next decode instance is tried, a hot-prefix
pull is skipped), a prefill with ``InstanceBusy``. **What it holds goes on**: prefills in flight
finish (``work`` counts each call until it returns), reservations are written and taken over,
decode streams run to their end (the engine's sequences and the receiver's reservations count
those). Once nothing is left the engine changes role on its own thread, where nothing enters
between the check and the change. A drain that outlasts its deadline gives up and the old role
is served again: nothing is aborted to make a switch happen, so nothing is lost or duplicated.

Fenced per Conductor, as reservations are: the service refuses a switch from an epoch older
than its Conductor's newest (``WrongEpoch``, ``Receiver.check_current``); a switch toward another
role while one drains is refused (``InstanceBusy``, whoever asks), the same one again answers the
state (idempotent).

Invariants: at most one switch at a time; ``role`` changes only in ``finish(True)``; a call
counted by ``work`` is counted until it returns, whatever it raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

from cluster.protocol import SWITCHABLE_ROLES, BadRequest, InstanceBusy, NoKVRoom, SwitchRoleReply

_BUSY_RETRY_S = 1.0  # what a refused prefill is told to wait: a drain ends in seconds


class Work(str, Enum):
    """The calls that make an instance hold something."""

    RESERVE = "reserve"  # blocks and staging for KV another instance sends
    PREFILL = "prefill"  # a prompt computed and streamed out
    PUSH = "push"  # cached prefix blocks sent to another instance


class RoleState:
    """An instance's role and the switch in progress, if any (module doc). Event-loop only."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.switching_to: str | None = None
        self.deadline = 0.0  # monotonic: when the drain gives up
        self.switches = 0
        self.given_up = 0
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Calls counted by ``work`` that have not returned."""
        return self._in_flight

    def reply(self) -> SwitchRoleReply:
        return SwitchRoleReply(self.role, self.switching_to)

    def begin(self, to: str, now: float, drain_s: float) -> bool:
        """Start draining toward ``to``; False when there is nothing to start (it serves ``to``,
        or drains toward it already). Raises ``BadRequest`` (not a prefill or decode instance,
        or not a role to switch to) and ``InstanceBusy`` (draining toward the other role)."""
        if self.role not in SWITCHABLE_ROLES:
            raise BadRequest(f"a {self.role} instance does not switch roles (only prefill and decode ones do)")
        if to not in SWITCHABLE_ROLES:
            raise BadRequest(f"an instance switches to one of {', '.join(SWITCHABLE_ROLES)}, not {to!r}")
        if self.switching_to is not None:
            if to == self.switching_to:
                return False
            raise InstanceBusy(f"already switching from {self.role} to {self.switching_to}", _BUSY_RETRY_S)
        if to == self.role:
            return False
        self.switching_to, self.deadline = to, now + drain_s
        return True

    @contextmanager
    def work(self, kind: Work) -> Iterator[None]:
        """Count a call of ``kind`` until it returns; while draining, a new reservation or
        prefill is refused (a push only reads the cache, and its target holds the reservation)."""
        if self.switching_to is not None:
            why = f"switching from {self.role} to {self.switching_to}"
            if kind is Work.RESERVE:
                raise NoKVRoom(f"no new reservations: {why}")
            if kind is Work.PREFILL:
                raise InstanceBusy(f"no new prefills: {why}", _BUSY_RETRY_S)
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    def finish(self, switched: bool) -> None:
        """End the drain: the engine serves ``switching_to`` now (``switched``), or the drain gave
        up and it serves the old role again."""
        if self.switching_to is None:
            raise RuntimeError("no switch is in progress")
        if switched:
            self.role = self.switching_to
            self.switches += 1
        else:
            self.given_up += 1
        self.switching_to = None
