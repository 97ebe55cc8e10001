"""Two Conductors with elastic roles over one set of instances (issue 41 item 4): one decides for
the cluster. Two prefill and one decode instance started by hand; the decode instance is killed:
each Conductor alone would refill the empty decode role with a prefill instance of its own
choosing, and the two together could move both and empty prefill instead. Deciding once for the
cluster (the etcd decider key), exactly one instance switches, prefill never empties, both
Conductors then serve (predicting decode with the dead instance's model: the switched one
measured none); kill -9 of the decider hands the decision to the other within a lease.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from bench.harness import ServerProcess, launch_server, until
from clusters import INSTANCE_FLAGS, PROCESS_ENV, STARTUP_S, TEST_FLAGS

ELASTIC = ("--elastic-roles", "--slo-ttft-s", "30", "--slo-tbt-s", "5", "--elastic-interval-s", "0.5")
DECIDER_TTL_S = 3.0  # membership.DEFAULT_TTL_S


@pytest.mark.processes
def test_two_elastic_conductors_refill_an_empty_role_once_and_hand_the_decision_over(tmp_path, etcd_url):
    procs: list[ServerProcess] = []
    try:
        started = []
        for k, role in enumerate(("prefill", "prefill", "decode")):
            started.append(launch_server(["--role", role, "--etcd", etcd_url, *INSTANCE_FLAGS, "--pool-dram-gib", "0",
                                          "--log-level", "warning"], tmp_path / f"{role}{k}.log", name=f"{role} {k}",
                                         env=PROCESS_ENV, advertise=True))
        procs += started
        instances, decode = started[:2], started[2]
        conductors = [launch_server([*TEST_FLAGS, "--prefill-instances", "0", "--decode-instances", "0", "--etcd",
                                     etcd_url, "--conductor-id", f"elastic-{k}", *ELASTIC, "--log-level", "warning"],
                                    tmp_path / f"conductor{k}.log", name=f"conductor {k}", env=PROCESS_ENV) for k in (1, 2)]
        procs += conductors

        for c in conductors:
            c.wait_instances(3, STARTUP_S)
        decode.stop(5.0, signal.SIGKILL)

        def roles() -> list[str]:
            return sorted(ServerProcess.instance_stats(i.base_url)["role"] for i in instances)

        # Sampled all along: prefill never empties, and the instances switch once in all.
        seen: list[list[str]] = []

        def settled() -> bool:
            seen.append(roles())
            return seen[-1] == ["decode", "prefill"] and all(c.stats() and c.stats()["ready"] for c in conductors)

        until(settled, 60, "one prefill instance to serve decode, seen by both Conductors", every_s=0.1)
        for _ in range(20):  # a second switch, were one coming, would show within a few decisions
            seen.append(roles())
            time.sleep(0.1)
        assert all("prefill" in r for r in seen), seen
        assert seen[-1] == ["decode", "prefill"], seen
        switches = sum(ServerProcess.instance_stats(i.base_url)["role_switches"] for i in instances)
        assert switches == 1, switches
        deciding = [c.stats()["role_deciding"] for c in conductors]
        assert sorted(deciding) == [False, True], deciding
        for c in conductors:  # both serve, disaggregated
            r = httpx.post(c.base_url + "/v1/completions", json={"prompt": "The capital of France is",
                                                                 "max_tokens": 4, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text

        decider, other = (conductors[0], conductors[1]) if deciding[0] else (conductors[1], conductors[0])
        assert other.stats()["role_decider"] == decider.stats()["role_decider"]
        decider.stop(5.0, signal.SIGKILL)
        t_kill = time.monotonic()
        until(lambda: other.stats()["role_deciding"], 3 * DECIDER_TTL_S, "the other Conductor to decide")
        # Its lease ran out in etcd (one TTL) and the other asks every third of one.
        assert time.monotonic() - t_kill <= DECIDER_TTL_S + 3.0
        assert roles() == ["decode", "prefill"]
    finally:
        for p in reversed(procs):
            p.stop(10.0)
