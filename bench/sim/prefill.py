"""A simulated prefill instance: a FIFO of prefills, a local LRU DRAM cache, and one NIC.

Requests run one after another in arrival order, so a prefill's start and end are known the
moment it is assigned and no events are needed. Chunking a prompt on one instance does not
change when it ends (the FLOP model telescopes over chunks); it only lets KV stream to the
decode node per chunk, which the simulator accounts for as the last chunk's transfer.

Keys enter the cache at assignment, as the Conductor updates its view immediately; a later
request queued behind can count on them because the queue is FIFO. Blocks of queued requests
are never evicted before they run (FAST'25: blocks in use are not evicted) - the simulator
simply fixes a request's prefix hit when it is assigned.
"""

from __future__ import annotations

from cluster.instance_state import PrefillInstanceState
from cluster.prefix_index import LRUBlockCache


class PrefillInstance:
    def __init__(self, index: int, cache: LRUBlockCache) -> None:
        self.index = index
        self.cache = cache
        self.free_at = 0.0  # when the last queued prefill ends
        self.nic_free_at = 0.0  # outgoing KV pulls from this instance are served one at a time

    def queue_s(self, now: float) -> float:
        return max(0.0, self.free_at - now)

    def state(self, now: float) -> PrefillInstanceState:
        return PrefillInstanceState(index=self.index, queue_s=self.queue_s(now), cache=self.cache)

    def send(self, now: float, seconds: float) -> float:
        """Serve one pull of cached KV from this instance; returns when it completes."""
        start = max(now, self.nic_free_at)
        self.nic_free_at = start + seconds
        return self.nic_free_at

    def run(self, now: float, seconds: float, inputs_ready: float) -> float:
        """Queue a prefill of ``seconds`` that cannot start before ``inputs_ready``; returns its end."""
        start = max(now, self.free_at, inputs_ready)
        self.free_at = start + seconds
        return self.free_at
