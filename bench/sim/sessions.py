"""Sessions in the simulator (issue 42): an agentic multi-turn trace, and what session hints buy.

``agentic_trace`` makes a repeatable workload (a seed) of *sessions*: each starts from one of a
few shared system prompts, then runs turns; a turn appends a tool's output (most turns, short
think times) or a user's message (long think times), and the model answers. The next turn
arrives ``think_s`` after the answer ends and resends everything before it. Beside them runs
*one-shot* traffic: long prompts nobody sends again (documents, batch jobs), which is what
pushes an idle session's KV out of an LRU cache just before its next turn.

``simulate_sessions`` replays it closed-loop (a turn's arrival depends on when the last one
ended) on prefill instances with a prefix cache each and a shared KVCache pool, with the live
Conductor's code: its scheduler (``Placer``: Algorithm 1, or least-loaded), its sticky rule
(``cluster/policies/sessions.py``) and the instances' own block pool (``paged_kv.BlockPool``,
LRU with soft retention) as both the instance caches and the pool's tier. ``Belady`` replaces
them with the optimum that knows every block's next use (the ceiling). Decode is not modelled:
a turn's answer takes ``output * tbt_s``, and goodput counts requests whose TTFT met the SLO.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.sim.config import SimConfig
from bench.sim.simulator import make_scheduler
from cluster.conductor.placement import PlacementConfig
from cluster.policies.prefix_index import match_len
from cluster.policies.sessions import sticky_prefill
from cluster.policies.snapshot import PrefillInstanceState, RequestInfo
from paged_kv.block_pool import BlockPool, Retention

Key = Hashable


# -- the workload ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    appended: int  # tokens the turn adds before the model answers (a tool's output, a user's message)
    output: int  # tokens the model answers
    think_s: float  # from the end of the answer to the next turn (unused after the last)
    kind: str  # "tool" or "user"


@dataclass(frozen=True)
class Session:
    id: int
    start_s: float
    system: int  # which shared system prompt it starts from
    first: int  # tokens of its first message
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class OneShot:
    id: int
    arrival_s: float
    tokens: int
    output: int


@dataclass(frozen=True)
class AgenticConfig:
    seed: int = 0
    duration_s: float = 600.0  # sessions and one-shots start within this
    session_rate: float = 0.25  # sessions started per second
    systems: int = 6  # shared system prompts, chosen with Zipf weights
    system_tokens: int = 2048  # a multiple of the block size
    first_tokens: tuple[int, int] = (100, 400)
    turns: tuple[int, int] = (3, 12)
    tool_share: float = 0.7  # of turns after the first, those that append a tool's output
    tool_tokens: tuple[int, int] = (300, 3000)
    user_tokens: tuple[int, int] = (30, 300)
    output_tokens: tuple[int, int] = (50, 400)
    tool_think_s: float = 2.0  # medians of log-normal think times
    user_think_s: float = 30.0
    think_sigma: float = 1.0
    one_shot_rate: float = 0.4  # per second
    one_shot_tokens: tuple[int, int] = (2000, 16000)
    one_shot_output: int = 100


@dataclass(frozen=True)
class AgenticTrace:
    config: AgenticConfig
    sessions: tuple[Session, ...]
    one_shots: tuple[OneShot, ...]


def agentic_trace(config: AgenticConfig) -> AgenticTrace:
    """The sessions and one-shots of ``config`` (the same seed gives the same trace)."""
    rng = random.Random(config.seed)
    weights = [1 / (k + 1) ** 1.2 for k in range(config.systems)]
    sessions, t = [], 0.0
    while True:
        t += rng.expovariate(config.session_rate)
        if t >= config.duration_s:
            break
        n = rng.randint(*config.turns)
        turns = []
        for k in range(n):
            tool = k > 0 and rng.random() < config.tool_share
            appended = 0 if k == 0 else rng.randint(*(config.tool_tokens if tool else config.user_tokens))
            median = config.tool_think_s if tool else config.user_think_s
            think = median * math.exp(rng.gauss(0, config.think_sigma))
            turns.append(Turn(appended, rng.randint(*config.output_tokens), think, "tool" if tool else "user"))
        system = rng.choices(range(config.systems), weights)[0]
        sessions.append(Session(len(sessions), t, system, rng.randint(*config.first_tokens), tuple(turns)))
    one_shots, t = [], 0.0
    while config.one_shot_rate > 0:
        t += rng.expovariate(config.one_shot_rate)
        if t >= config.duration_s:
            break
        one_shots.append(OneShot(len(one_shots), t, rng.randint(*config.one_shot_tokens), config.one_shot_output))
    return AgenticTrace(config, tuple(sessions), tuple(one_shots))


def turn_tokens(session: Session, k: int, system_tokens: int) -> int:
    """Prompt tokens of turn ``k``: the system prompt, then every message and answer before it."""
    before = sum(t.appended + t.output for t in session.turns[:k])
    return system_tokens + session.first + before + session.turns[k].appended


# -- caches ---------------------------------------------------------------------------------------------
class BlockCache:
    """The live block pool (``paged_kv.BlockPool``) as a cache of keys: a store takes blocks for
    the keys it lacks, registers them and releases them at once, with a ``Retention`` for a
    session's turn (retention on) or none (LRU)."""

    def __init__(self, capacity_blocks: int, retention_s: float | None, share: float = 0.5) -> None:
        self.now = 0.0
        self.pool = BlockPool(max(capacity_blocks, 1), share, clock=lambda: self.now)
        self.retention_s = retention_s  # None: plain LRU

    def match_len(self, keys: Sequence[Key]) -> int:
        return len(self.pool.lookup(keys))

    def store(self, keys: Sequence[Key], now: float, session: bool) -> None:
        self.now = now
        hits = self.pool.lookup(keys)
        self.pool.acquire(hits)
        rest = keys[len(hits):][: self.pool.num_free]
        new = self.pool.allocate(len(rest))
        for block, key in zip(new, rest):
            self.pool.register(block, key)
        retain = Retention(now + self.retention_s) if session and self.retention_s else None
        self.pool.release(hits + new, retain)


class Belady:
    """Evicts the keys whose next use is farthest (``next_use(key, now)``; ``math.inf``: never):
    the optimum a cache of this size could reach, given the future. Every key's next use is
    looked up afresh at each eviction (they move as sessions run); the caches are small."""

    def __init__(self, capacity_blocks: int, next_use: Callable[[Key, float], float]) -> None:
        self.capacity = max(capacity_blocks, 1)
        self.next_use = next_use
        self._keys: set[Key] = set()

    def match_len(self, keys: Sequence[Key]) -> int:
        return match_len(keys, self._keys)

    def store(self, keys: Sequence[Key], now: float, session: bool) -> None:
        self._keys.update(keys)
        excess = len(self._keys) - self.capacity
        if excess > 0:
            # Of keys used next at the same time (one chain's), the tail goes first: without its
            # head a chain's other blocks are unreachable.
            ranked = sorted(self._keys, key=lambda k: (self.next_use(k, now), k[-1]), reverse=True)
            self._keys.difference_update(ranked[:excess])


# -- the cluster ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionPolicy:
    name: str
    routing: str = "global"  # the Conductor's scheduler: "global" (Algorithm 1) or "load_balancing"
    sticky: bool = False
    retention: bool = False
    belady: bool = False
    slack_s: float | None = None  # the sticky rule's TTFT slack; None: SessionSimConfig's (the shipped one)


POLICIES = (
    SessionPolicy("LRU, least-loaded routing, no pool (a plain balancer)", routing="load_balancing"),
    SessionPolicy("LRU, cache-aware routing (no hints)"),
    SessionPolicy("sticky routing, no retention", sticky=True),
    SessionPolicy("retention, not sticky", retention=True),
    SessionPolicy("sticky + retention (hints, shipped)", sticky=True, retention=True),
    SessionPolicy("sticky up to the SLO (no slack) + retention", sticky=True, retention=True, slack_s=math.inf),
    SessionPolicy("Belady's optimum, sticky (ceiling)", sticky=True, belady=True),
)


@dataclass(frozen=True)
class SessionSimConfig:
    instances: int = 4
    cache_tokens: int = 48_000  # per instance
    pool_tokens: int = 128_000
    block_size: int = 512
    retention_s: float = 600.0  # EngineConfig.session_retention_s
    sticky_slack_s: float = PlacementConfig.session_slack_s
    retained_share: float = 0.5
    ttft_slo_s: float = 2.0
    tbt_s: float = 0.03  # a turn's answer takes output * tbt_s


@dataclass
class SessionResult:
    policy: str
    ttft_s: list[float] = field(default_factory=list)  # next turns (turn > 0)
    first_ttft_s: list[float] = field(default_factory=list)  # first turns and one-shots
    hit_tokens: int = 0  # next turns' prompt tokens reused (instance cache or pool)
    prompt_tokens: int = 0
    met: int = 0  # requests whose TTFT met the SLO
    requests: int = 0
    span_s: float = 0.0
    kept: int = 0  # next turns placed where the last ran

    def row(self) -> list:
        p50, p90 = (np.percentile(self.ttft_s, [50, 90]) if self.ttft_s else (math.nan, math.nan))
        return [self.policy, self.hit_tokens / max(self.prompt_tokens, 1), p50, p90,
                self.met / self.span_s if self.span_s else math.nan, self.met / max(self.requests, 1)]


HEADERS = ["policy", "next-turn hit", "next-turn TTFT p50 (s)", "p90 (s)", "goodput (req/s)", "SLO met"]


def simulate_sessions(trace: AgenticTrace, policy: SessionPolicy,
                      config: SessionSimConfig = SessionSimConfig()) -> SessionResult:
    bs = config.block_size
    if trace.config.system_tokens % bs:
        raise ValueError("the system prompt must be a whole number of blocks")
    pooled = policy.routing == "global" and config.pool_tokens > 0  # a pool needs Algorithm 1 (SimConfig)
    sim = SimConfig(n_prefill=config.instances, n_decode=1, block_size=bs, scheduler=policy.routing,
                    pool_capacity_tokens=config.pool_tokens if pooled else 0, cache_capacity_tokens=config.cache_tokens)
    node = sim.prefill_model()
    scheduler = make_scheduler(sim, node)
    sessions = trace.sessions
    next_arrival = {s.id: s.start_s for s in sessions}  # of a session's next turn (math.inf: none)
    starts: dict[int, list[float]] = {}
    for s in sessions:
        starts.setdefault(s.system, []).append(s.start_s)
    running: dict[int, set[int]] = {}  # system -> its sessions started and not over

    def next_use(key: Key, now: float) -> float:
        kind, owner = key[0], key[1]
        if kind == "o":
            return math.inf
        if kind == "s":
            return next_arrival[owner]
        later = starts[owner]
        i = bisect.bisect_right(later, now)
        soonest = later[i] if i < len(later) else math.inf
        return min([soonest, *(next_arrival[s] for s in running.get(owner, ()))])

    def cache(blocks: int) -> BlockCache | Belady:
        if policy.belady:
            return Belady(blocks, next_use)
        return BlockCache(blocks, config.retention_s if policy.retention else None, config.retained_share)

    caches = [cache(config.cache_tokens // bs) for _ in range(config.instances)]
    pool = cache(config.pool_tokens // bs) if pooled else None
    busy = [0.0] * config.instances
    last_on: dict[int, int] = {}
    result = SessionResult(policy.name)
    system_blocks = trace.config.system_tokens // bs

    def keys_of(owner: tuple, tokens: int, system: int | None) -> list[Key]:
        n = tokens // bs
        head = [] if system is None else [("y", system, j) for j in range(min(n, system_blocks))]
        return head + [(*owner, j) for j in range(n - len(head))]

    events: list[tuple[float, int, str, int, int]] = []
    order = itertools.count()
    for s in sessions:
        heapq.heappush(events, (s.start_s, next(order), "turn", s.id, 0))
    for o in trace.one_shots:
        heapq.heappush(events, (o.arrival_s, next(order), "once", o.id, 0))
    end_of_run = 0.0
    while events:
        now, _, kind, ident, k = heapq.heappop(events)
        if kind == "done":  # a turn's answer ended: its KV is stored, its next turn is due
            s = sessions[ident]
            tokens = turn_tokens(s, k, trace.config.system_tokens) + s.turns[k].output - 1
            keys = keys_of(("s", s.id), tokens, s.system)
            if k + 1 < len(s.turns):
                heapq.heappush(events, (next_arrival[s.id], next(order), "turn", s.id, k + 1))
            else:
                running[s.system].discard(s.id)
            caches[last_on[s.id]].store(keys, now, session=True)
            if pool is not None:
                pool.store(keys, now, session=True)  # the decode side's output joins the pool
            continue
        if kind == "turn":
            s = sessions[ident]
            running.setdefault(s.system, set()).add(s.id)
            length = turn_tokens(s, k, trace.config.system_tokens)
            keys = keys_of(("s", s.id), length - 1, s.system)  # the last token is always computed
            output = s.turns[k].output
        else:
            o = trace.one_shots[ident]
            length, output, s = o.tokens, o.output, None
            keys = keys_of(("o", o.id), length - 1, None)
        states = [PrefillInstanceState(i, max(busy[i] - now, 0.0), caches[i]) for i in range(config.instances)]
        info = RequestInfo(ident, length, keys, 0 if pool is None else pool.match_len(keys))
        plan = scheduler.select(info, states)
        sticky_on = last_on.get(ident) if s is not None and policy.sticky and k > 0 else None
        if sticky_on is not None:
            slack = config.sticky_slack_s if policy.slack_s is None else policy.slack_s
            plan = sticky_prefill(plan, scheduler.select(info, [states[sticky_on]]), config.ttft_slo_s, slack)
        i = plan.instance
        first = now + plan.ttft_s  # the scheduler predicts with the true model here

        busy[i] = first
        ttft = first - now
        caches[i].store(keys, first, session=False)  # the prompt, cached as it is computed
        if pool is not None:
            pool.store(keys, first, session=False)  # and stored in the pool by its prefill
        result.requests += 1
        result.met += ttft <= config.ttft_slo_s
        end = first + output * config.tbt_s
        end_of_run = max(end_of_run, end)
        if s is not None and k > 0:
            result.ttft_s.append(ttft)
            result.hit_tokens += plan.prefix_tokens
            result.prompt_tokens += length
            result.kept += last_on.get(s.id) == i
        else:
            result.first_ttft_s.append(ttft)
        if s is not None:
            last_on[s.id] = i
            # Its prompt was looked up just now: its blocks are next used by its next turn.
            next_arrival[s.id] = end + s.turns[k].think_s if k + 1 < len(s.turns) else math.inf
            heapq.heappush(events, (end, next(order), "done", s.id, k))
    result.span_s = end_of_run
    return result

