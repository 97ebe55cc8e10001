"""A simulated prefill instance: a FIFO of prefills, a local LRU DRAM cache, and one NIC.

Requests run one after another in arrival order, so a prefill's start and end are known the
moment it is assigned and no events are needed. Chunking a prompt on one node does not change
when it ends (the FLOP model telescopes over chunks); it only lets KV stream to the decode node
per chunk, which the simulator accounts for as the last chunk's transfer. A CPP group is one
instance whose chunks flow through its stages (``cluster.policies.cost_model.PipelinedPrefillCost``).

Keys enter the cache at assignment, as the Conductor updates its view immediately; a later
request queued behind can count on them because the queue is FIFO. Blocks of queued requests
are never evicted before they run (FAST'25: blocks in use are not evicted) - the simulator
simply fixes a request's prefix hit when it is assigned.
"""

from __future__ import annotations

from cluster.policies.snapshot import PrefillInstanceState
from cluster.policies.prefix_index import LRUBlockCache


class PrefillInstance:
    """One prefill node, or a CPP group of ``stages`` nodes (one cache, stage 0 deciding)."""

    def __init__(self, index: int, cache: LRUBlockCache, stages: int = 1) -> None:
        self.index = index
        self.cache = cache
        self.stage_free_at = [0.0] * stages  # when each stage ends the chunks queued on it
        self.nic_free_at = 0.0  # outgoing KV pulls from this instance are served one at a time

    def queue_s(self, now: float) -> float:
        """Until the first stage can take a new prompt (the Conductor's view of the queue)."""
        return max(0.0, self.stage_free_at[0] - now)

    def state(self, now: float) -> PrefillInstanceState:
        return PrefillInstanceState(index=self.index, queue_s=self.queue_s(now), cache=self.cache)

    def send(self, now: float, seconds: float) -> float:
        """Serve one pull of cached KV from this instance; returns when it completes."""
        start = max(now, self.nic_free_at)
        self.nic_free_at = start + seconds
        return self.nic_free_at

    def run(self, now: float, chunks: list[float], inputs_ready: float, overhead_s: float = 0.0) -> float:
        """Queue a prefill that cannot start before ``inputs_ready``, whose chunks take
        ``chunks[j]`` seconds on each stage (``overhead_s`` more once, before the first): every
        chunk goes through the stages in order, a stage taking chunks (of this prompt and the
        ones queued before it) first come, first served. Returns when the last chunk leaves the
        last stage."""
        earliest = max(now, inputs_ready)
        left = earliest
        for j, seconds in enumerate(chunks or [0.0]):
            arrives = earliest  # at stage 0; at stage i once it has left stage i - 1
            for i, free in enumerate(self.stage_free_at):
                took = seconds + (overhead_s if i == 0 and j == 0 else 0.0)
                arrives = self.stage_free_at[i] = max(free, arrives) + took
            left = arrives
        return left
