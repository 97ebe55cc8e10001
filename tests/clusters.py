"""A `python -m server` cluster for the tests that drive real processes (``bench/harness.py``
starts, watches and stops it, as it does for the benchmarks).

Every test cluster runs the default model in float32 (where a greedy answer does not depend on
what it was batched with), one thread per instance, small KV and staging, a 3 s transfer timeout
and a 30 s reservation lease, with a secret of its own; a module adds the flags its scenarios
need. After each scenario ``assert_clean`` checks that no instance still holds anything.

``MOONCAKE_TEST_SHIPPED_TIMEOUTS=1`` runs them at the shipped lease and transfer timeout instead
(10 s and 30 s: a 2-core machine under the whole suite is slow enough that the tests' own
settings are the ones CI runs; the shipped ones are checked by hand and by bench.chaos).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.harness import ServerProcess, launch_server, until
from cluster.protocol import CONTROL, ControlAuth, derive_key

SECRET = "cluster test secret 0123456789"
CONTROL_AUTH = ControlAuth(derive_key(SECRET.encode(), CONTROL))  # signs control calls as the Conductor does
STARTUP_S = 300
TEST_FLAGS = ("--dtype", "float32", "--instance-threads", "1", "--kv-cache-gib", "0.25", "--staging-gib", "0.1")
# The Conductor's TEST_FLAGS, as an instance started by hand takes them (--threads, not
# --instance-threads).
INSTANCE_FLAGS = tuple("--threads" if f == "--instance-threads" else f for f in TEST_FLAGS)
# The environment of every process a test starts: the cluster secret, and one OpenMP thread per
# process (on 2 shared cores a second one that gets descheduled stalls every parallel region).
PROCESS_ENV = {"MOONCAKE_CLUSTER_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
TRANSFER_TIMEOUT_S, LEASE_S = 30.0, 10.0  # the shipped defaults
if os.environ.get("MOONCAKE_TEST_SHIPPED_TIMEOUTS") != "1":
    TRANSFER_TIMEOUT_S, LEASE_S = 3.0, 30.0
    TEST_FLAGS += ("--transfer-timeout-s", "3", "--reservation-lease-s", "30")
# An abandoned request's receive staging is reused only after twice the transfer timeout (a
# write approved just before its reservation ended may still be copying): what a test waits for
# "nothing held" after a request was cut off.
RELEASE_S = 15.0 + 2 * TRANSFER_TIMEOUT_S
# A reservation whose release never reached its instance (e.g. a call held up by a partition that
# TCP delivers once the link is back) is released when its lease lapses, and its staging two
# transfer timeouts later: what a test waits for "nothing held" after a partition.
LAPSED_S = 10.0 + LEASE_S + 2 * TRANSFER_TIMEOUT_S


def words(tag: str, n: int) -> str:
    """A prompt of ``n`` distinct words starting with ``tag``: no prefix blocks shared with
    another test's prompts."""
    return tag + " " + " ".join(f"{tag}{i}" for i in range(n))


class Cluster:
    """``python -m server`` with ``TEST_FLAGS`` + ``flags``, up once the Conductor counts
    ``instances`` instances up; ``http`` is a client of its public port."""

    def __init__(self, flags: Sequence[str], instances: int, workdir: Path, *, log_level: str = "info",
                 env: dict[str, str] | None = None) -> None:
        self.server: ServerProcess = launch_server(
            [*TEST_FLAGS, *flags, "--log-level", log_level], workdir / "cluster.log", name="test cluster",
            env={**PROCESS_ENV, **(env or {})})
        self.url = self.server.base_url
        self.http = httpx.Client(base_url=self.url, timeout=300)
        self.node: subprocess.Popen | None = None  # a pool node (start_pool_node)
        try:
            self.server.wait_instances(instances, STARTUP_S)
        except BaseException:
            self.close()
            raise

    # -- views ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.http.get("/stats").json()

    def instances(self, role: str | None = None) -> list[dict[str, Any]]:
        return [i for i in self.stats()["instances"] if role is None or i["role"] == role]

    def instance_stats(self, url: str) -> dict[str, Any]:
        return self.server.instance_stats(url)

    def log(self) -> str:
        return self.server.log()

    def computed(self) -> dict[str, int]:
        """Prompt tokens each prefill instance has computed so far, by URL."""
        return {i["url"]: self.instance_stats(i["url"])["num_prompt_tokens_computed"] for i in self.instances("prefill")}

    def complete_on_one_prefill(self, prompt: str, **params: Any) -> str:
        """Complete ``prompt``; the one prefill instance that computed it, once the Conductor's
        view of that instance's cached prefixes includes it (placement decides by that view, and a
        count of cached blocks cannot tell: a full prefix cache evicts as much as it adds)."""
        before = {i["url"]: self.instance_stats(i["url"]) for i in self.instances("prefill")}
        self.complete(prompt, **params)
        after = self.computed()
        (holder,) = [u for u in after if after[u] > before[u]["num_prompt_tokens_computed"]]
        since = before[holder]["cache_version"]

        def seen() -> bool:
            now = self.instance_stats(holder)["cache_version"]
            (rec,) = [i for i in self.instances() if i["url"] == holder]
            return now > since and (rec["cache_version"] or -1) >= now

        until(seen, 30, f"the Conductor to see what {holder} cached", every_s=0.1)
        return holder

    # -- a KVCache pool node ---------------------------------------------------------------------------
    def embedded_metadata_url(self) -> str:
        """Where the Conductor serves the pool's metadata (it logs the address at start)."""
        found = re.search(r"KVCache pool metadata at (\S+)", self.log())
        assert found, "the Conductor did not log its metadata server's address"
        return found.group(1)

    def start_pool_node(self, args: Sequence[str], within_s: float) -> str:
        """``python -m cluster.pool *args`` with the cluster's secret, in place of any node this
        started before; its segment id, once the Conductor lists it (within ``within_s``)."""
        self.stop_pool_node()
        self.node = subprocess.Popen([sys.executable, "-m", "cluster.pool", *args],
                                     env=dict(os.environ, MOONCAKE_CLUSTER_SECRET=SECRET), stdout=subprocess.PIPE,
                                     text=True)
        line = self.node.stdout.readline()
        assert line.startswith("pool node ready: "), f"the pool node did not start: {line!r}"
        segment_id = line.split()[3]
        until(lambda: segment_id in self.stats()["pool"]["segments"], within_s, "the Conductor to see the pool node")
        return segment_id

    def stop_pool_node(self) -> None:
        if self.node is not None and self.node.poll() is None:
            self.node.send_signal(signal.SIGCONT)  # a test may have stopped it
            self.node.terminate()
            self.node.wait(20)
        self.node = None

    # -- requests and checks -------------------------------------------------------------------------
    def complete(self, prompt: str | list, **params: Any) -> dict[str, Any]:
        r = self.http.post("/v1/completions", json={"prompt": prompt, **params})
        assert r.status_code == 200, r.text
        return r.json()

    def assert_clean(self, also: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """Every instance that is up holds no blocks, requests, reservations or staging, within a
        few seconds (aborts travel asynchronously); ``also(conductor stats)`` adds the caller's own."""
        self.server.assert_clean(RELEASE_S, also)

    def close(self) -> None:
        self.stop_pool_node()
        self.http.close()
        self.server.stop(30.0)


async def complete_concurrently(url: str, bodies: list[dict]) -> list[dict]:
    """``POST /v1/completions`` with each body at once; every answer must be a 200."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        rs = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json() for r in rs]
