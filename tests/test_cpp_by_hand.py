"""A pipeline group started by hand, as on several hosts: ``python -m server --role prefill --stage
0/2 --group NAME`` registers with a Conductor, ``--stage 1/2 --group NAME --first URL`` joins it
(here all on loopback, the default model). A stage naming another group is refused; the group
answers as the colocated engine; when the later stage is killed, the first stage exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from bench.harness import HOST, free_port, start_server, until
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.processes  # starts real server / instance / peer processes

SECRET = "cpp-by-hand-test-secret-0123456789"
LONG = "Continue the count: " + ", ".join(str(i) for i in range(1, 120)) + ","  # 491 tokens: two chunks of 256
PROMPTS = ["The capital of France is", LONG]
COMMON = ["--threads", "1", "--kv-cache-gib", "0.25", "--staging-gib", "0.1", "--transfer-timeout-s", "5",
          "--max-num-batched-tokens", "256", "--log-level", "warning"]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory):
    env = {"MOONCAKE_CLUSTER_SECRET": SECRET}
    logs = tmp_path_factory.mktemp("cpp-by-hand")
    port, first_port = free_port(), free_port()
    conductor_url, first_url = f"http://{HOST}:{port}", f"http://{HOST}:{first_port}"
    started = [
        start_server("conductor", [sys.executable, "-m", "server", "--port", str(port), "--prefill-instances", "0",
                                   "--decode-instances", "1", "--instance-threads", "1", "--no-pool", *COMMON[2:]],
                     conductor_url, logs / "conductor.log", env),
        start_server("first", [sys.executable, "-m", "server", "--role", "prefill", "--stage", "0/2", "--group", "g1",
                               "--port", str(first_port), "--conductor", conductor_url, *COMMON],
                     first_url, logs / "first.log", env),
        start_server("second", [sys.executable, "-m", "server", "--role", "prefill", "--stage", "1/2", "--group",
                                "g1", "--first", first_url, *COMMON], "", logs / "second.log", env),
    ]
    running = {sp.name: sp.proc for sp in started}
    conductor = started[0]

    def up() -> bool:
        for sp in started:
            assert sp.proc.poll() is None, f"{sp.name} exited with {sp.proc.returncode} during start-up:\n{sp.log_tail()}"
        return sum(i["up"] for i in conductor.instances()) == 2

    until(up, 300, "the conductor to see the group and the decode instance")
    with httpx.Client(base_url=conductor_url, timeout=300) as http:
        yield http, running, first_url, dict(os.environ, **env)
    for sp in started:
        sp.stop(60)


def test_a_stage_of_another_group_is_refused(group):
    _, _, first_url, env = group
    wrong = subprocess.run([sys.executable, "-m", "server", "--role", "prefill", "--stage", "1/2", "--group", "g2",
                            "--first", first_url, *COMMON], env=env, capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0 and "leads group 'g1', not 'g2'" in wrong.stderr


def test_the_group_answers_as_the_colocated_engine(group):
    http, running, _, _ = group
    colocated = LLM(threads=1, kv_cache_gib=0.25)
    params = dict(temperature=0, max_tokens=10)
    want = [w.text for w in colocated.generate(PROMPTS, SamplingParams(**params))]
    got = []
    for p in PROMPTS:
        r = http.post("/v1/completions", json={"prompt": p, **params})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    assert got == want


def test_when_the_later_stage_dies_the_first_stage_exits(group):
    _, running, _, _ = group
    running["second"].send_signal(signal.SIGKILL)
    running["second"].wait(10)
    # Three missed pings, a second each, then the instance lets its answers leave and exits.
    running["first"].wait(60)
    assert running["first"].returncode not in (0, None)
