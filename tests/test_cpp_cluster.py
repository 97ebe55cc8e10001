"""Chunked pipeline parallel prefill in real processes: ``python -m server --cpp-stages 2`` (one
prefill group of two stage processes, one decode instance, the default model) in a KVCache pool
(a pool node of its own; the instances contribute no memory, so the objects outlive a restart).
Greedy and seeded texts equal the colocated engine's, for prompts within one chunk and across
three; each stage stores its layers of a prompt's new objects and loads its layers of a prefix
the pool holds (the logprobs equal the colocated engine's); kill -9 of the later stage fails
what is in flight, and the group comes back and loads what the group before it stored."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.harness import until
from clusters import Cluster
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.processes  # starts real server / instance / peer processes

LONG = "Continue the count: " + ", ".join(str(i) for i in range(1, 250)) + ","  # 1,141 tokens: 3 chunks
PROMPTS = ["The capital of France is", "List three colors of the rainbow:", LONG]
OBJECT_TOKENS = 64


class _Group(Cluster):
    def __init__(self, workdir: Path) -> None:
        super().__init__(["--prefill-instances", "1", "--decode-instances", "1", "--cpp-stages", "2",
                          "--transfer-timeout-s", "5", "--pool-dram-gib", "0",
                          "--pool-block-tokens", str(OBJECT_TOKENS)], 2, workdir)
        self.start_pool_node(["--metadata", self.embedded_metadata_url(), "--dram-gib", "0.5",
                              "--log-level", "warning"], 30)

    def group_stats(self) -> dict:
        (group,) = self.instances("prefill")
        return self.instance_stats(group["url"])


@pytest.fixture(scope="module")
def group():
    with tempfile.TemporaryDirectory() as workdir:
        g = _Group(Path(workdir))
        yield g
        g.close()


@pytest.fixture(scope="module")
def cluster(group):
    return group.http


def _texts(http: httpx.Client, params: dict) -> list[str]:
    out = []
    for p in PROMPTS:
        r = http.post("/v1/completions", json={"prompt": p, **params})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def _assert_as_colocated(cluster: httpx.Client, colocated: LLM, prompt: str) -> dict:
    """Greedy text and every token's logprob as the colocated engine's; returns the answer."""
    r = cluster.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 8, "logprobs": 0})
    assert r.status_code == 200, r.text
    got = r.json()
    (want,) = colocated.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=0))
    assert got["choices"][0]["text"] == want.text
    # Wrong KV in either stage's layers moves these far more than a different chunking does.
    assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx([lp.logprob for lp in want.logprobs],
                                                                             abs=2e-3)
    return got


def test_a_two_stage_group_answers_as_the_colocated_engine(group, cluster, colocated):
    for params in (dict(temperature=0, max_tokens=12), dict(temperature=0.8, top_p=0.95, seed=7, max_tokens=12)):
        want = [w.text for w in colocated.generate(PROMPTS, SamplingParams(**params))]
        assert _texts(cluster, params) == want
    # Both stages wrote their layers of LONG's new objects, and the group sealed them.
    assert group.group_stats()["pool_client"]["stored_layerwise"] >= (len(colocated.tokenizer.encode(LONG)) - 1) // OBJECT_TOKENS


def test_prompt_logprobs_come_back_through_the_stages(cluster, colocated):
    # Every position of LONG (three chunks) is scored on the last stage, in the pool or not.
    r = cluster.post("/v1/completions", json={"prompt": [LONG, PROMPTS[0]], "max_tokens": 1, "logprobs": 1,
                                              "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    want = colocated.generate([LONG, PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    for c, w in zip(r.json()["choices"], want):
        assert c["logprobs"]["token_logprobs"][1:-1] == pytest.approx([e.logprob for e in w.prompt_logprobs[1:]],
                                                                      abs=1e-4)


def test_a_second_turn_loads_the_first_turns_output_on_every_stage(group, cluster, colocated):
    first = "turn " + " ".join(f"turn{i}" for i in range(60)) + " Tell me a long story about the sea."
    r = cluster.post("/v1/completions", json={"prompt": first, "temperature": 0, "max_tokens": 160, "ignore_eos": True})
    assert r.status_code == 200, r.text
    turn = r.json()
    n_first = turn["usage"]["prompt_tokens"]
    second = first + turn["choices"][0]["text"] + " And then?"
    hits = group.group_stats()["pool_client"]["hits"]
    # The decode instance stores the prompt and output once the first turn is done.
    pool = lambda: cluster.get("/stats").json()["pool"]["objects"]  # noqa: E731
    before = pool()
    until(lambda: pool() >= before + (n_first + 150) // OBJECT_TOKENS - n_first // OBJECT_TOKENS, 30,
           "the first turn's output in the pool")
    got = _assert_as_colocated(cluster, colocated, second)
    # The group computed only the first prompt: more cached than its full blocks can only have
    # come from the pool's copy of the output, loaded by both stages.
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (n_first // OBJECT_TOKENS + 1) * OBJECT_TOKENS, f"cached {cached} of a first prompt of {n_first}"
    stats = group.group_stats()
    assert stats["pool_client"]["hits"] > hits
    until(lambda: group.group_stats()["staging_pool_ranges"] == 0, 15, "the group's pool staging to be free")


def test_kill_9_of_the_later_stage_and_the_group_comes_back(group, cluster, colocated):
    stages = subprocess.run(["pgrep", "-f", "-n", "cluster.cpp.group"], capture_output=True, text=True).stdout.split()
    assert stages, "no stage process"
    fresh = "Count down: " + ", ".join(str(i) for i in range(400, 150, -1)) + ","  # seconds of prefill
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(cluster.post, "/v1/completions", json={"prompt": fresh, "max_tokens": 2, "temperature": 0})
        until(lambda: group.group_stats()["num_running"] > 0, 30, "the prompt to be prefilling")
        os.kill(int(stages[0]), signal.SIGKILL)
        r = asked.result()
    # The group was the only prefill instance: the request cannot move, and the client is told so
    # (503 naming the role, with Retry-After); the Conductor's log names the cause.
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) >= 1 and "prefill instance" in r.json()["error"]["message"], r.text
    until(lambda: [line for line in group.log().splitlines() if "cannot move" in line and "pipeline stage 1" in line],
          10, "the Conductor to log the lost pipeline stage")
    deadline = time.monotonic() + 240
    while True:  # the instance exits, the Supervisor starts the group anew
        r = cluster.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                  "temperature": 0})
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"].startswith(" Paris")
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(2)
    # Nothing of the failed request stays held on the decode instance.
    (decode,) = [i for i in cluster.get("/stats").json()["instances"] if i["role"] == "decode"]
    held = ("num_used_blocks", "num_reservations", "num_running", "staging_recv_ranges")
    until(lambda: not any(httpx.get(decode["url"] + "/stats").json().get(k) for k in held), 15,
           "the decode instance to hold nothing")
    # A new group, with an empty prefix cache: LONG's prefix comes from what the first group's
    # two stages stored, every layer of it.
    got = _assert_as_colocated(cluster, colocated, LONG)
    n = got["usage"]["prompt_tokens"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // OBJECT_TOKENS * OBJECT_TOKENS
