"""Failpoints: named places on the cluster's real paths where a fault is injected on purpose.

``python -m bench.faults`` proves that no fault makes the cluster answer wrongly: it needs faults
that happen *inside* the processes, where they happen in the field (a bit flipped in a KV layer
after its checksum was taken, a write that lands late in a range reused since), not only the
ones a signal or a socket can make from outside. Each place below asks ``FAILPOINTS.fire(name)``
and, when that says so, does the damage itself; everything after it is the shipped code.

A process has failpoints only when it was started with ``MOONCAKE_FAILPOINTS=1`` in its
environment (the instances inherit the Conductor's); then ``POST /instance/failpoints`` (signed
like every control call) arms a point for its next ``times`` passes and every answer says how
often each fired. Without the variable the route does not exist and ``fire`` is one attribute
read: nothing to arm, nothing for a caller with the cluster secret to turn into a weapon.

The points (``NAMES``):

* ``kv.flip_bit``: a prefill flips one bit of a layer it streams, after the layer's checksum
  was taken (the decode instance must refuse the KV);
* ``kv.truncate``: a layer's last write carries half its bytes (the rest of the range is stale);
* ``kv.drop_layer``: a layer is never written, nor its checksum, yet the prefill says it is done;
* ``kv.stale_write``: besides its own write, the prefill writes the same bytes into the range of
  the last request it finished, naming that request's generation: a late write landing after the
  range was released and perhaps reused (the Messenger must refuse it);
* ``reserve.lapse``: a decode instance's reservation lapses ``LAPSE_AFTER_S`` after it was made,
  through the same release as a lease nobody renewed, while its KV is being streamed;
* ``pool.flip_bit``: a pool segment flips one bit of an object it has just stored in DRAM,
  after the writer's checksums were checked (a copy demoted to SSD later carries the flip);
* ``pool.evict_on_lease``: a pool segment evicts an object the moment a reader asks to lease it,
  after the reader's lookup found it (evicted between lookup and read);
* ``pool.fail_read``: an instance's read of a pool object fails mid-way (a transfer error).
"""

from __future__ import annotations

import os
import threading

ENV = "MOONCAKE_FAILPOINTS"
NAMES = frozenset({"kv.flip_bit", "kv.truncate", "kv.drop_layer", "kv.stale_write", "reserve.lapse",
                   "pool.flip_bit", "pool.evict_on_lease", "pool.fail_read"})
# After this long a reservation armed with ``reserve.lapse`` is released: well inside the
# prefill of the bench's prompts, so that the stream is cut mid-way.
LAPSE_AFTER_S = 0.05


class Failpoints:
    """The process's armed points: ``arm`` from the control route, ``fire`` on the paths
    (engine thread, event loop and pool threads alike: one lock). Invariant: a point fires at
    most as many times as it was armed for, and ``fired`` counts every time it did."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._armed: dict[str, int] = {}
        self._fired: dict[str, int] = {}
        self._outcomes: dict[str, int] = {}

    def arm(self, counts: dict[str, int]) -> None:
        """Fire each named point on its next ``times`` passes (0 disarms it): all or none, raising
        ValueError for an unknown name or a count that is not a non-negative integer, and
        RuntimeError where failpoints are off."""
        if not self.enabled:
            raise RuntimeError(f"failpoints are off (start the process with {ENV}=1)")
        for name, times in counts.items():
            if name not in NAMES:
                raise ValueError(f"unknown failpoint {name!r} (known: {', '.join(sorted(NAMES))})")
            if isinstance(times, bool) or not isinstance(times, int) or not 0 <= times <= 1_000_000:
                raise ValueError(f"failpoint {name!r}: times must be an integer from 0 to 1000000, not {times!r}")
        with self._lock:
            self._armed.update(counts)

    def fire(self, name: str) -> bool:
        """Whether the fault at ``name`` happens on this pass (and, if so, one fewer is armed)."""
        if not self._armed:  # the common case, without the lock: nothing armed anywhere
            return False
        with self._lock:
            left = self._armed.get(name, 0)
            if left <= 0:
                return False
            self._armed[name] = left - 1
            self._fired[name] = self._fired.get(name, 0) + 1
            return True

    def note(self, name: str, outcome: str) -> None:
        """Count what became of a fault that fired, where the point can see it (``kv.stale_write``:
        whether the late write was refused)."""
        with self._lock:
            key = f"{name}:{outcome}"
            self._outcomes[key] = self._outcomes.get(key, 0) + 1

    def state(self) -> dict[str, dict[str, int]]:
        """``{"armed": {name: passes left}, "fired": {name: times fired}, "outcomes": {"name:what": n}}``."""
        with self._lock:
            return {"armed": {k: v for k, v in self._armed.items() if v}, "fired": dict(self._fired),
                    "outcomes": dict(self._outcomes)}


FAILPOINTS = Failpoints(os.environ.get(ENV) == "1")
