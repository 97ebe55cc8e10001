"""Chunked pipeline parallel prefill in real processes: ``python -m server --cpp-stages 2`` (one
prefill group of two stage processes, one decode instance, the default model). Greedy and seeded
texts equal the colocated engine's, for prompts within one chunk and across three; kill -9 of the
later stage fails what is in flight, and the group comes back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from bench.disagg import free_port
from engine.llm import LLM
from engine.sampling_params import SamplingParams

SECRET = "cpp-cluster-test-secret-0123456789"
LONG = "Continue the count: " + ", ".join(str(i) for i in range(1, 250)) + ","  # 1,141 tokens: 3 chunks
PROMPTS = ["The capital of France is", "List three colors of the rainbow:", LONG]


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--port", str(port), "--prefill-instances", "1", "--decode-instances", "1",
           "--cpp-stages", "2", "--no-pool", "--instance-threads", "1", "--kv-cache-gib", "0.25",
           "--staging-gib", "0.1", "--transfer-timeout-s", "5", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, start_new_session=True, env=dict(os.environ, MOONCAKE_CLUSTER_SECRET=SECRET))
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, "the cluster exited during start-up"
        try:
            if http.get("/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the cluster did not come up"
        time.sleep(1)
    yield http
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)


def _texts(http: httpx.Client, params: dict) -> list[str]:
    out = []
    for p in PROMPTS:
        r = http.post("/v1/completions", json={"prompt": p, **params})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_a_two_stage_group_answers_as_the_colocated_engine(cluster):
    colocated = LLM(threads=1, kv_cache_gib=0.25)
    for params in (dict(temperature=0, max_tokens=12), dict(temperature=0.8, top_p=0.95, seed=7, max_tokens=12)):
        want = [w.text for w in colocated.generate(PROMPTS, SamplingParams(**params))]
        assert _texts(cluster, params) == want


def test_kill_9_of_the_later_stage_and_the_group_comes_back(cluster):
    stages = subprocess.run(["pgrep", "-f", "-n", "cluster.stage"], capture_output=True, text=True).stdout.split()
    assert stages, "no stage process"
    os.kill(int(stages[0]), signal.SIGKILL)
    r = cluster.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2, "temperature": 0})
    # In flight when it died (the engine step failed: 500 for now, not yet a clearer error), or after the restart.
    assert r.status_code in (200, 500, 502, 503), r.text
    deadline = time.monotonic() + 240
    while True:  # the instance exits, the Supervisor starts the group anew
        r = cluster.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                  "temperature": 0})
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"].startswith(" Paris")
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(2)
