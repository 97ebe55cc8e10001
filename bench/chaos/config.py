"""bench.chaos: the run's settings, the fixed prompts and the names of what must be zero."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SECRET_ENV = "MOONCAKE_CLUSTER_SECRET"
HOST = "127.0.0.1"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# The fixed prompt set: (endpoint, prompt). Few prompts, so every one is answered many times.
PROMPTS: tuple[tuple[str, str], ...] = (
    (COMPLETIONS, "The capital of France is"),
    (COMPLETIONS, "def fibonacci(n):"),
    (COMPLETIONS, "List three colors of the rainbow:"),
    (COMPLETIONS, "Once upon a time, in a small village by the sea,"),
    (CHAT, "Name a fruit."),
    (CHAT, "What is the boiling point of water?"),
)

LOST = "requests lost while a healthy instance of their role was up"
MARKED_DOWN = "healthy instances marked down"
STALE = "stale, replayed or altered control calls accepted"
HUGE = "unsigned huge control body not refused"
RESTART_GROWTH = "survivor figures grown beyond tolerance over the restarts"
DISCONNECT_HELD = "held a few seconds after a mass client disconnect"
DISCONNECT_TOKENS = "prompt tokens computed once the departed clients' held was free"
SSD_WRONG = "corrupt SSD object: its prompt served wrong"
SSD_UNCOUNTED = "corrupt SSD object read but not counted"
FROZEN_SLOW = "prompts slowed by a frozen pool node past its bound"
FROZEN_UNASKED = "pool node frozen but no pool call ran into it"
OVERLOAD_MEMORY = "processes whose private memory rose past its bound under 10x overload"
OVERLOAD_UNCLEAR = "answers under 10x overload neither 200 nor 429 with Retry-After"

# The Conductor's own books about each instance.
CONDUCTOR_HELD = ("prefilling", "running", "incoming", "reserved")

COMPLETED, HTTP_ERROR, STREAM_ERROR, UNCLEAR, HUNG = "completed", "http_error", "stream_error", "unclear", "hung"
# The server's 500 for a request it accepted and its engine then failed (server/app.py): such a
# body passed validation, so it was not malformed input.
ENGINE_FAILED = "the engine failed while serving the request"


# --------------------------------------------------------------------------- configuration

# The fault families, in the order a run takes them (``--only`` picks some). The four whose
# scenario is long or needs a cluster of its own (a bench-owned instance restarted ten times, a
# storm of clients with the traffic paused, a cluster with an SSD tier, a minute at ten times the
# sustainable load) are the full run's only.
FAMILIES = ("kill", "sigstop", "etcd", "pool-node", "second-conductor", "connections", "disconnect",
            "corrupt-ssd", "restarts", "overload", "stale-epoch", "huge-body", "burst", "fuzz", "framing",
            "slow-clients")
FULL_ONLY = ("disconnect", "corrupt-ssd", "restarts", "overload")
QUICK_SKIPS = ("etcd", "pool-node", "second-conductor", "connections")  # see ``ChaosConfig.quick``


@dataclass
class ChaosConfig:
    server_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    rate: float = 2.0  # steady stream, req/s
    max_tokens: int = 16
    deadline_s: float = 120.0
    pause_s: float = 5.0
    # Two instances of each role: one is faulted at a time, and the other must take its requests.
    prefill_instances: int = 2
    decode_instances: int = 2
    kill_roles: tuple[str, ...] = ("decode", "prefill")  # kill -9 one instance of each, in turn
    stop_role: str = "both"  # SIGSTOP one instance of this role ("both": one of each, in turn)
    stop_s: float = 20.0
    # The long-prompt load (load.py) under every fault.
    long_clients: int = 4
    long_words: int = 500
    long_max_tokens: int = 16
    etcd: bool = True  # run on an etcd of the bench's own, and stop it (when there is an etcd binary)
    etcd_stop_s: float = 10.0
    pool_node: bool = True  # a pool node of its own, stopped and then killed
    pool_stop_s: float = 10.0
    huge_body_bytes: int = 1 << 30
    burst: int = 200
    fuzz_examples: int = 150
    fuzz_concurrency: int = 4
    slow_request_s: float = 3.0  # how long one byte-by-byte request takes to send
    stall_connections: int = 50
    idle_connections: int = 1000  # beside the traffic, closed by the header deadline (connections.py)
    header_timeout_s: float | None = None  # the servers' --header-timeout-s (None: the shipped 10 s)
    slow_header_connections: int = 300
    second_conductor: bool = True  # one of two Conductors killed (conductors.py; needs etcd)
    families: tuple[str, ...] = FAMILIES
    # Fresh long prompts sent before and while the pool node is frozen (pool_node.py); 0: only
    # the probe of short prompts, which never reach the pool.
    frozen_prompts: int = 4
    restarts: int = 10  # kill -9 restarts of one instance (restarts.py)
    disconnect_streams: int = 32  # streams dropped mid-decode at once (disconnect.py) ...
    disconnect_prompts: int = 6  # ... beside prompts of ``disconnect_words`` abandoned before their first token
    disconnect_words: int = 2300
    overload_s: float = 60.0  # ten times the sustainable load for this long (overload.py)
    stall_s: float = 5.0
    restart_timeout_s: float = 240.0
    probe_timeout_s: float = 90.0
    # How long the quiet cluster may take to release everything. A receive staging range whose
    # reservation ended unsettled (its writer may still be late) is reused only after twice the
    # transfer timeout: 60 s at the shipped 30 s. The wait ends as soon as nothing is held.
    drain_s: float = 75.0
    health_timeout_s: float = 300.0
    seed: int = 0
    log_path: Path = Path("out") / "chaos" / "server.log"

    @classmethod
    def quick(cls, **overrides: Any) -> ChaosConfig:
        """The same scenarios, smaller: what tests/test_chaos.py runs."""
        # Two long-prompt clients, not four: on CI's two cores four keep the CPU so busy that
        # each restart after a kill takes half a minute longer.
        base = cls(rate=1.0, pause_s=0.5, stop_s=3.0, burst=40, fuzz_examples=40, slow_request_s=2.0,
                   stall_connections=16, stall_s=2.0, restart_timeout_s=180.0, probe_timeout_s=60.0,
                   long_clients=2, long_words=150, long_max_tokens=8, etcd_stop_s=2.0, pool_stop_s=2.0,
                   idle_connections=100, slow_header_connections=30, header_timeout_s=3.0,
                   # A shorter transfer timeout: the receive staging of a reservation that ended
                   # with writes possibly in flight comes back after twice this. The test
                   # clusters' KV cache (tests/clusters.py): the instances' engine settings then
                   # equal theirs, so they load the calibration those measured (CI's time).
                   server_args=["--transfer-timeout-s", "5", "--kv-cache-gib", "0.25"],
                   # One kill and one SIGSTOP: a killed or frozen prefill instance is
                   # tests/test_cluster.py's and tests/test_cluster_races.py's.
                   kill_roles=("decode",), stop_role="decode",
                   # And none of the families that have a test of their own (CI's time): etcd
                   # stopped and a frozen pool node are tests/test_pool_faults.py's, one of two
                   # Conductors killed tests/test_across_hosts.py's, idle and slow-header
                   # connections tests/test_front_door.py's. So no etcd and no pool node either.
                   families=tuple(f for f in FAMILIES if f not in FULL_ONLY + QUICK_SKIPS),
                   etcd=False, pool_node=False, second_conductor=False, frozen_prompts=0)
        return replace(base, **overrides)


# --------------------------------------------------------------------------- well-formed requests




def progress(msg: str) -> None:
    print(f"[bench.chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
