"""The disaggregated cluster end to end: `python -m server` with a Conductor and instance processes.

One cluster (2 prefill + 2 decode instances of the default model, 1 thread each, loopback and
shared memory) serves the whole module; the test that kills a decode instance runs last. After
every scenario all instances must be back to no blocks in use, no reservation and no staging
range held.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from starlette.testclient import TestClient

from bench.chaos.load import open_fds
from bench.harness import sse_events, until
from cluster.conductor.conductor import Conductor, ConductorConfig
from cluster.conductor.routes import registration_route
from cluster.conductor.placement import PlacementConfig
from clusters import CONTROL_AUTH, SECRET, STARTUP_S, Cluster, complete_concurrently
from engine import SamplingParams
from server.app import build_app

pytestmark = pytest.mark.processes  # starts real server / instance / peer processes

# Prefixes move between instances by push / adopt here; the pool's path is
# tests/test_pool_cluster.py's. Steps of at most 128 tokens: a push from a busy holder waits for
# the step under way and must finish within the 3 s transfer timeout (float32 on one thread,
# AVX2: 512-token steps took 3.5-4.7 s, 256-token ones 1.75 s on average and up to 2.5 s).
FLAGS = ("--prefill-instances", "2", "--decode-instances", "2", "--no-pool", "--max-num-batched-tokens", "128")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(FLAGS, 4, tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.close()


SHARED = ("You are a helpful assistant for a cooking website. Answer briefly and kindly, and always "
          "mention one seasonal ingredient that fits the question. ")
PROMPTS = [
    "The capital of France is",
    SHARED + "How do I make pancakes?",
    SHARED + "What goes well with pumpkin soup?",
    "def fibonacci(n):",
    SHARED + "How do I make pancakes?",  # the whole prompt again: a prefix-cache hit
    "List three colors of the rainbow:",
    # Over two step budgets (128 tokens): its KV streams to the decode instance chunk by chunk.
    "Continue the count: " + ", ".join(str(i) for i in range(1, 250)) + ",",
]


def test_outputs_equal_the_colocated_engine(cluster, colocated):
    greedy = dict(temperature=0, max_tokens=24)
    seeded = dict(temperature=0.8, top_p=0.95, seed=11, max_tokens=24)
    # Sequential first, so the repeated prompt finds its blocks cached on the prefill side.
    got = [cluster.complete(p, **greedy) for p in PROMPTS]
    want = colocated.generate(PROMPTS, SamplingParams(**greedy))
    assert [g["choices"][0]["text"] for g in got] == [w.text for w in want]
    assert got[4]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert got[0]["choices"][0]["text"].startswith(" Paris")
    # Concurrent and seeded: batching on either side, and the generator state crossing over.
    got = asyncio.run(complete_concurrently(cluster.url, [{"prompt": p, **seeded} for p in PROMPTS]))
    want = colocated.generate(PROMPTS, SamplingParams(**seeded))
    assert [g["choices"][0]["text"] for g in got] == [w.text for w in want]
    stats = cluster.http.get("/stats").json()
    assert stats["requests_failed"] == 0 and stats["mode"] == "disaggregated"
    cluster.assert_clean()


def test_streaming_and_chat_through_the_cluster(cluster, colocated):
    with cluster.http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 12,
            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        stream = sse_events(r.iter_lines())
    assert stream.done and stream.error is None and len(stream.events) >= 2
    metrics = cluster.http.get("/metrics")
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    # Done at its first token: the decode instance's reservation is released, nothing decodes.
    out = cluster.complete("The capital of France is", temperature=0, max_tokens=1)
    assert out["choices"][0]["text"] == " Paris" and out["choices"][0]["finish_reason"] == "length"
    cluster.assert_clean()


def test_structured_output_through_the_cluster_as_the_colocated_engine(cluster, colocated):
    """Issue 53 item 1, disaggregated: the prefill instance masks the first token, the decode
    instance's matcher takes that token and holds the rest; openai's parse() gets its object, and
    the text is the colocated engine's under the same constraint."""
    import openai
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=16)
        legs: int = Field(ge=0, le=8)

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    done = client.chat.completions.parse(model=client.models.list().data[0].id, response_format=Pet, temperature=0,
                                         max_tokens=40, messages=[{"role": "user", "content": "Describe a cat."}])
    assert isinstance(done.choices[0].message.parsed, Pet), done.choices[0].message.content
    spec = {"regex": "[0-9]{3}-[a-z]{2,4}"}
    got = cluster.complete("The code is", temperature=0.9, seed=5, max_tokens=10, structured_outputs=spec)
    (want,) = colocated.generate(["The code is"], SamplingParams(temperature=0.9, seed=5, max_tokens=10,
                                                                 structured_outputs=spec))
    assert got["choices"][0]["text"] == want.text and re.fullmatch(spec["regex"], want.text)
    cluster.assert_clean()


def test_prompt_logprobs_through_the_cluster_equal_the_colocated_engine(cluster, colocated):
    # PROMPTS[1] and the long count are cached on a prefill instance by now: the scored request
    # must still compute every position (and equal the colocated engine, which has no such hit).
    prompts = [PROMPTS[1], PROMPTS[-1], "The capital of France is Paris"]
    r = cluster.http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
                                                   "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    want = colocated.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    for c, w in zip(r.json()["choices"], want):
        lp = c["logprobs"]
        assert c["text"].startswith(prompts[c["index"]])
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:-1] == pytest.approx([e.logprob for e in w.prompt_logprobs[1:]], abs=1e-4)
        assert len(lp["tokens"]) == len(w.prompt_token_ids) + 1
    cluster.assert_clean()


def _open_sockets(pid: int) -> int:
    return sum(target.startswith("socket:") for target in open_fds(pid))


def test_the_conductor_keeps_no_connection_per_request(cluster):
    """Every request streams from its decode instance; the server cancels the relay once the
    client has its answer, and a close cancelled midway left that connection open for good (one
    socket per request, in CLOSE_WAIT once the instance hung up). Pooled keep-alive connections
    are all that may stay."""
    pid = cluster.server.proc.pid
    cluster.complete("warm up", max_tokens=2)
    before = _open_sockets(pid)
    for i in range(30):
        cluster.complete(f"Count to {i}:", max_tokens=2)
        if i % 2:
            with cluster.http.stream("POST", "/v1/completions",
                                     json={"prompt": f"Name {i}", "max_tokens": 2, "stream": True}) as r:
                r.read()
    assert _open_sockets(pid) - before <= 4


def test_hot_prefix_is_replicated_to_the_idle_prefill_instance(cluster, colocated):
    prefix = SHARED * 6  # ~160 tokens: 9 full blocks the request can reuse
    # The Conductor learns what an instance caches by polling it: until that poll, no instance
    # holds the prefix as far as placement knows, and the next request could go anywhere.
    holder = cluster.complete_on_one_prefill(prefix + "Question one?", temperature=0, max_tokens=2)
    before = cluster.http.get("/stats").json()["migrations"]
    # A long prompt behind the same prefix keeps the instance holding it busy for seconds...
    long_prompt = prefix + " ".join(f"word{i}" for i in range(700))

    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            busy = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": long_prompt, "max_tokens": 2, "temperature": 0}))
            while not any(i["url"] == holder and i["prefilling"] for i in (await http.get("/stats")).json()["instances"]):
                assert not busy.done(), "the long prompt finished before it was seen prefilling"
                await asyncio.sleep(0.05)
            # ...so Algorithm 1 sends this one to the other instance, which pulls the prefix.
            r = await http.post("/v1/completions", json={"prompt": prefix + "Question two?", "max_tokens": 16,
                                                         "temperature": 0})
            assert (await busy).status_code == 200
            return r

    r = asyncio.run(scenario())
    assert r.status_code == 200, r.text
    stats = cluster.http.get("/stats").json()
    assert stats["migrations"] == before + 1 and stats["migrated_blocks"] >= 8
    body = r.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * 16  # served from the pulled copy
    (want,) = colocated.generate([prefix + "Question two?"], SamplingParams(temperature=0, max_tokens=16))
    assert body["choices"][0]["text"] == want.text
    cluster.assert_clean()


@pytest.mark.parametrize("admission", ["early", "predictive"])
def test_early_rejection_answers_429_and_costs_no_prefill(cluster, admission):
    """A second Conductor over the same instances, with an SLO no request can meet."""
    urls = tuple(i["url"] for i in cluster.instances())
    prefills = [i["url"] for i in cluster.instances("prefill")]
    computed = sum(cluster.instance_stats(u)["num_prompt_tokens_computed"] for u in prefills)
    placement = PlacementConfig(admission=admission, slo_ttft_s=1e-4, slo_tbt_s=1e-4)
    conductor = Conductor(ConductorConfig(secret=SECRET.encode(), instances=urls, placement=placement,
                                          poll_interval_s=0.1, conductor_id="second"))
    app = build_app(conductor, extra_routes=[registration_route(conductor)])
    with TestClient(app) as client:
        until(lambda: client.get("/health").status_code == 200, 60, "the second Conductor to see its instances")
        for body in ({"prompt": "The capital of France is", "max_tokens": 8},
                     {"prompt": "Hello", "max_tokens": 4, "stream": True}):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 429, r.text
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        assert client.get("/stats").json()["requests_rejected"] == 2
    assert sum(cluster.instance_stats(u)["num_prompt_tokens_computed"] for u in prefills) == computed
    cluster.assert_clean()


def _conductors_fence(cluster: Cluster) -> dict[str, str]:
    """The cluster's Conductor's own id and epoch, as a header. Under its own id a reservation
    made behind its back is one its ledger does not know of, and not one the instance's polled
    report shows as another Conductor's work (which the Conductor would route around at once)."""
    stats = cluster.http.get("/stats").json()
    return {"X-Conductor-Epoch": f"{stats['conductor_id']}/{stats['epoch']}"}


def _reserve_directly(cluster: Cluster, url: str, rid: str, n_tokens: int) -> httpx.Response:
    """A reservation made as the cluster's Conductor would, which it does not know of."""
    return httpx.post(url + "/instance/reserve", timeout=30,
                      auth=CONTROL_AUTH, headers=_conductors_fence(cluster),
                      json={"request_id": rid, "prompt_token_ids": [(i * 7) % 5000 + 10 for i in range(n_tokens)],
                            "params": {"max_tokens": 1}})


def _release_directly(cluster: Cluster, url: str, rid: str) -> None:
    r = httpx.post(url + "/instance/abort", timeout=30, auth=CONTROL_AUTH, headers=_conductors_fence(cluster),
                   json={"request_id": rid, "writes_done": True})
    assert r.status_code == 200


def test_a_full_decode_instance_is_skipped_then_all_full_is_429(cluster):
    decodes = cluster.instances("decode")
    assert [d["role"] for d in decodes] == ["decode", "decode"]
    # Not through the Conductor, so its bookkeeping still sees both decode instances idle and
    # plans the first one: only that instance's 507 tells it the truth.
    capacity = cluster.instance_stats(decodes[0]["url"])["num_blocks"] * 16
    filler = capacity - 7 * 16
    r = httpx.post(decodes[0]["url"] + "/instance/reserve", json={})
    assert r.status_code == 401  # control routes need the cluster secret
    assert _reserve_directly(cluster, decodes[0]["url"], "filler-0", filler).status_code == 200
    prompt = " ".join(f"item{i}" for i in range(120))  # more than 7 blocks of KV
    before = cluster.http.get("/stats").json()["decode_reservation_retries"]
    out = cluster.complete(prompt, temperature=0, max_tokens=4)
    assert out["usage"]["completion_tokens"] == 4
    assert cluster.http.get("/stats").json()["decode_reservation_retries"] == before + 1
    assert _reserve_directly(cluster, decodes[1]["url"], "filler-1", filler).status_code == 200
    r = cluster.http.post("/v1/completions", json={"prompt": prompt + " more", "max_tokens": 4})
    assert r.status_code == 429 and "room for the KV" in r.json()["error"]["message"]
    _release_directly(cluster, decodes[0]["url"], "filler-0")
    _release_directly(cluster, decodes[1]["url"], "filler-1")
    cluster.assert_clean()


def test_killing_a_decode_instance_mid_stream_moves_the_request(cluster, colocated):
    """The stream pauses, goes on from another decode instance (its prompt plus the tokens already
    streamed prefilled again) and, greedy in float32, says what an undisturbed run says."""
    prompt = "Tell me a long story about a dragon."
    body = {"prompt": prompt, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    moved = cluster.http.get("/stats").json()["requests_moved"]
    with cluster.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]  # the stream is under way on some decode instance
        (victim,) = [i for i in cluster.instances("decode") if i["running"]]
        os.kill(victim["pid"], signal.SIGKILL)
        rest = list(lines)
    stream = sse_events(received + rest)
    assert stream.done and stream.error is None, stream.error
    text = stream.text
    (want,) = colocated.generate([prompt], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    assert text == want.text
    assert cluster.http.get("/stats").json()["requests_moved"] == moved + 1
    # The dead instance is out of scheduling; the survivors keep serving.
    # (The stream went on for seconds after the kill: the Supervisor may have restarted it already.)
    until(lambda: not any(i["up"] and i["instance_id"] == victim["instance_id"] for i in cluster.instances("decode")),
          10, "the killed instance to be marked down")
    for _ in range(3):
        out = cluster.complete("The capital of France is", temperature=0, max_tokens=6)
        assert out["choices"][0]["text"].startswith(" Paris")
    assert cluster.http.get("/health").status_code == 200
    cluster.assert_clean()

    # The Conductor's supervisor starts it again at the same address; it rejoins and is scheduled.
    (back,) = until(lambda: [i for i in cluster.instances("decode") if i["url"] == victim["url"] and i["up"]],
                    STARTUP_S, "the Supervisor to bring the killed decode instance back", every_s=0.5)
    assert back["instance_id"] != victim["instance_id"] and back["pid"] != victim["pid"]
    (supervised,) = [m for m in cluster.http.get("/stats").json()["supervised"] if m["url"] == victim["url"]]
    assert supervised["restarts"] >= 1 and supervised["last_exit"] == "signal SIGKILL"
    served = set()
    for i in range(6):  # least predicted TBT spreads concurrent requests over both
        async def two():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
                async def one(k):
                    r = await http.post("/v1/completions", json={"prompt": f"Count to {k}:", "max_tokens": 24,
                                                                 "ignore_eos": True})
                    assert r.status_code == 200, r.text

                task = asyncio.gather(one(2 * i), one(2 * i + 1))
                # Where both are decoding (each runs 24 tokens: seconds), not after a fixed pause.
                while not task.done():
                    running = await asyncio.to_thread(cluster.instances, "decode")
                    if sum(d["running"] for d in running) == 2:
                        served.update(d["url"] for d in running if d["running"])
                        break
                    await asyncio.sleep(0.05)
                await task

        asyncio.run(two())
        if victim["url"] in served:
            break
    assert victim["url"] in served
    cluster.assert_clean()


def test_killing_a_prefill_instance_mid_prefill_moves_the_request(cluster, colocated):
    """The request goes to the other prefill instance (with a fresh decode reservation) and is
    answered as if nothing happened; the decode reservation made for the first try is released
    once no late write can land in it."""
    # ~1,100 tokens: nine steps of 128 on one thread, time enough to be killed mid-prefill.
    long_prompt = " ".join(f"token{i}" for i in range(300))
    moved = cluster.http.get("/stats").json()["requests_moved"]

    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            task = asyncio.create_task(http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4,
                                                                          "temperature": 0}))
            deadline = time.monotonic() + 30
            while True:
                busy = [i for i in cluster.instances("prefill") if i["prefilling"]]
                if busy:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            os.kill(busy[0]["pid"], signal.SIGKILL)
            return busy[0], await task

    victim, r = asyncio.run(scenario())
    assert r.status_code == 200, r.text
    (want,) = colocated.generate([long_prompt], SamplingParams(temperature=0, max_tokens=4))
    assert r.json()["choices"][0]["text"] == want.text
    stats = cluster.http.get("/stats").json()
    assert stats["requests_moved"] == moved + 1 and stats["requests_failed"] == 0
    assert not any(i["up"] and i["instance_id"] == victim["instance_id"] for i in cluster.instances("prefill"))
    for _ in range(2):
        out = cluster.complete("The capital of France is", temperature=0, max_tokens=6)
        assert out["choices"][0]["text"].startswith(" Paris")
    cluster.assert_clean()
