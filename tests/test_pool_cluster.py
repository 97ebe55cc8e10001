"""The KVCache pool end to end, against real processes on loopback (issue 12's proof).

A cluster (`python -m server`: a Conductor over 2 prefill + 1 decode instances of the default
model, contributing no DRAM of their own, 64-token pool objects) and a standalone pool node
(`python -m cluster.pool`) that holds every object, so the node is the only replica. Each
scenario that reads or writes the pool's index runs twice: on the Conductor's embedded metadata
server and on a real etcd.

To make a request run on the prefill instance that does *not* hold its prefix (so the prefix can
only come from the pool), the holder is kept busy first with a long prompt that shares the prefix
(Algorithm 1 sends that one to the holder; the next one then goes to the idle instance).

After every scenario no instance holds blocks, reservations or staging, and no pool object is
leased or half-written.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from bench.harness import until
from cluster.protocol import MESSENGER, derive_key
from cluster.pool.index import OBJECTS, SEGMENTS, SegmentInfo
from cluster.pool.messages import LeaseReply, LeaseRequest, ReleaseRequest
from cluster.metadata import connect_metadata
from cluster.messenger import MessengerConfig, Messenger, RegionHandle
from cluster.messenger.wire import Status
from engine import LLM, SamplingParams
from clusters import SECRET, Cluster, words as _words

pytestmark = pytest.mark.processes  # starts real server / instance / peer processes

LEASE_S = 5.0  # PoolConfig.lease_ttl_s: a dead node's objects leave the index within this
GREEDY = dict(temperature=0, max_tokens=8)


class PoolCluster(Cluster):
    """``Cluster`` (its helpers: instances, instance_stats, complete, close) with a pool node,
    the pool's metadata and a pool-aware ``assert_clean``."""

    def __init__(self, etcd: str | None, workdir: Path) -> None:
        self.etcd = etcd
        self.workdir = workdir
        self.metadata = None  # until the cluster is up: a start that fails closes without it
        # A ~1,000-token prompt is one engine step of seconds: it keeps its instance busy.
        flags = ["--prefill-instances", "2", "--decode-instances", "1", "--max-num-batched-tokens", "2048",
                 "--pool-dram-gib", "0", "--pool-block-tokens", "64", *(["--etcd", etcd] if etcd else [])]
        super().__init__(flags, 3, workdir)
        self.metadata_url = etcd or self.embedded_metadata_url()
        self.metadata = connect_metadata(self.metadata_url, SECRET.encode(), etcd=etcd is not None)

    # -- views ---------------------------------------------------------------------------------------
    def pool(self) -> dict:
        return self.stats()["pool"]

    def pool_counters(self) -> dict[str, int]:
        return {k: v for k, v in self.pool().items() if isinstance(v, int)}

    def object_keys(self) -> list[str]:
        """Object keys in the index (the metadata), with the segments holding them."""
        return sorted(self.metadata.get_prefix(OBJECTS))

    # -- the pool node -------------------------------------------------------------------------------
    def start_node(self, dram_gib: float = 0.25, ssd_gib: float = 0.0) -> str:
        where = ["--etcd", self.etcd] if self.etcd else ["--metadata", self.metadata_url]
        args = [*where, "--dram-gib", str(dram_gib), "--transfer-timeout-s", "3", "--log-level", "warning"]
        if ssd_gib:
            args += ["--ssd-dir", tempfile.mkdtemp(dir=self.workdir, prefix="ssd-"), "--ssd-gib", str(ssd_gib)]
        return self.start_pool_node(args, 10)

    def node_address(self, segment_id: str) -> str:
        return self.pool()["segments"][segment_id]["address"]

    # -- requests ------------------------------------------------------------------------------------
    def stored(self, n: int) -> None:
        """Wait until the index holds at least ``n`` objects (stores run after the response)."""
        until(lambda: len(self.object_keys()) >= n, 30, f"{n} objects in the pool")

    def on_the_other_instance(self, prefix: str, prompt: str, holder: str, *, during=None) -> dict:
        """Complete ``prompt`` (which starts with ``prefix``) on the prefill instance that is not
        ``holder``: ``holder`` is kept busy by a long prompt with the same prefix meanwhile.
        ``during(other_url)``, if given, runs once the request is prefilling there."""

        async def scenario() -> dict:
            async with httpx.AsyncClient(base_url=self.url, timeout=300) as http:
                busy = asyncio.create_task(http.post("/v1/completions", json={
                    "prompt": prefix + " " + _words("busytail", 300), "max_tokens": 1, "temperature": 0}))
                (a,) = await asyncio.to_thread(
                    until, lambda: [i for i in self.instances("prefill") if i["prefilling"]], 60, "the long prompt")
                assert a["url"] == holder, "the long prompt should go where its prefix is cached"
                task = asyncio.create_task(http.post("/v1/completions", json={"prompt": prompt, **GREEDY}))
                if during is not None:
                    (b,) = await asyncio.to_thread(
                        until, lambda: [i for i in self.instances("prefill") if i["prefilling"] and i["url"] != holder],
                        10, "the request on the other prefill instance")
                    await asyncio.to_thread(during, b["url"])
                r, done = await task, await busy
                assert done.status_code == 200, done.text
                assert r.status_code == 200, r.text
                return r.json()

        return asyncio.run(scenario())

    # -- integrity -----------------------------------------------------------------------------------
    def assert_clean(self) -> None:
        """No instance holds blocks, reservations or staging (pool staging included), and no pool
        object is leased or half-written (the nodes publish their state every second)."""
        def pool_held(stats: dict) -> dict:
            return {f"{segment_id}.{k}": seg[k] for segment_id, seg in stats["pool"]["segments"].items()
                    for k in ("leased_objects", "pending_puts") if seg[k]}

        super().assert_clean(also=pool_held)

    def close(self) -> None:
        try:
            self.stop_pool_node()
            if self.metadata is not None:
                self.metadata.close()
        finally:
            super().close()


# What reads or writes the pool's index runs on both metadata backends; what happens inside a
# pool node's segment (its checksums, its SSD tier) only on the embedded one. A prefix loaded by
# the other instance reads and writes the index as a second turn does (which runs on both), so
# it runs on the embedded one only (CI's time).
ON_BOTH_BACKENDS = pytest.mark.parametrize("cluster", ["embedded", "etcd"], indirect=True)
ON_EMBEDDED = pytest.mark.parametrize("cluster", ["embedded"], indirect=True)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    etcd = request.getfixturevalue("etcd_url") if request.param == "etcd" else None
    c = PoolCluster(etcd, tmp_path_factory.mktemp(f"pool-{request.param}"))
    try:
        yield c
    finally:
        c.close()


def _want(colocated: LLM, prompt: str) -> str:
    return colocated.generate([prompt], SamplingParams(**GREEDY))[0].text


def _stored_from_one_instance(cluster: PoolCluster, tag: str) -> tuple[str, str]:
    """A new prefix (~290 tokens: four 64-token pool objects) computed by one prefill instance and
    stored in the pool; returns the prefix and that instance."""
    prefix = _words(tag, 100)
    holder = cluster.complete_on_one_prefill(prefix + " First question?", **GREEDY)
    cluster.stored(4)
    return prefix, holder


def _asked_on_the_other_instance(cluster: PoolCluster, colocated: LLM, prefix: str, holder: str,
                                 during=None) -> dict:
    """The prefix with a second question, completed by the instance that is not ``holder``
    (``PoolCluster.on_the_other_instance``); its text must be the colocated engine's."""
    prompt = prefix + " Second question?"
    got = cluster.on_the_other_instance(prefix, prompt, holder, during=during)
    assert got["choices"][0]["text"] == _want(colocated, prompt)
    return got


@ON_EMBEDDED
def test_a_prefix_computed_on_one_instance_is_loaded_by_the_other(cluster, colocated):
    cluster.start_node()
    prefix, holder = _stored_from_one_instance(cluster, "shared")
    # The prefill instance wrote its four objects layer by layer during the prompt's step.
    until(lambda: cluster.instance_stats(holder)["pool_client"]["stored_layerwise"] >= 4, 30,
           "the holder's layer-wise store of its four objects")
    before, migrations = cluster.pool_counters(), cluster.stats()["migrations"]
    computed = cluster.computed()
    got = _asked_on_the_other_instance(cluster, colocated, prefix, holder)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256, "the pool's prefix was not used"
    after = cluster.pool_counters()
    assert after["hits"] >= before["hits"] + 4 and after["loads"] > before["loads"]
    assert cluster.stats()["migrations"] == migrations, "the prefix moved by push, not through the pool"
    (other,) = [u for u in computed if u != holder]
    assert cluster.computed()[other] - computed[other] < 100, "the other instance recomputed the prefix"
    cluster.assert_clean()


@ON_BOTH_BACKENDS
def test_kill_9_of_the_only_replica_mid_load_recomputes_and_its_objects_leave(cluster, colocated):
    segment_id = cluster.start_node()
    prefix, holder = _stored_from_one_instance(cluster, "doomed")
    before = cluster.pool_counters()
    node = cluster.node

    def kill_mid_load(_other: str) -> None:
        # The other instance asks the (frozen) node for read leases: the load hangs there; then the
        # node dies for good. The lease asks go out right after the request starts prefilling;
        # nothing the test can see says they have, and the assertions below hold either way (a
        # refused lease is a miss, a dead read a failed one), so the pause only makes "mid-load"
        # the likely case.
        time.sleep(0.3)
        node.send_signal(signal.SIGKILL)
        node.wait()

    # Freeze the node first, so the load is under way (not finished) when it dies.
    node.send_signal(signal.SIGSTOP)
    computed = cluster.computed()
    got = _asked_on_the_other_instance(cluster, colocated, prefix, holder, during=kill_mid_load)
    after = cluster.pool_counters()
    # The load ended without the node's objects: its read leases were refused (a miss) or its
    # reads failed (a failed read); either way the other instance computed the whole prompt.
    lost = lambda c: c["misses"] + c["failed_reads_recomputed"]  # noqa: E731
    assert lost(after) > lost(before) and after["hits"] == before["hits"], "the load did not fail"
    (other,) = [u for u in computed if u != holder]
    assert cluster.computed()[other] - computed[other] >= got["usage"]["prompt_tokens"] - 16
    # Its objects leave the index within its lease (the test's own waits count against it).
    until(lambda: not cluster.object_keys(), LEASE_S + 3, "the dead node's objects to leave the index")
    until(lambda: segment_id not in cluster.pool()["segments"], LEASE_S + 3, "the dead node to leave")
    cluster.node = None
    cluster.assert_clean()


def _flip_a_byte_of_every_object(cluster: PoolCluster, segment_id: str) -> int:
    """Corrupt each object the node holds, one byte each, with one-sided writes into its segment
    (as a stray writer would): the node's checksums no longer match its bytes."""
    keys = sorted({k[len(OBJECTS):].rsplit("/", 1)[0] for k in cluster.object_keys()})
    address = cluster.node_address(segment_id)
    with Messenger(MessengerConfig(secret=derive_key(SECRET.encode(), MESSENGER))) as engine:
        status, body = engine.call(address, LeaseRequest(keys).to_dict())
        assert status == Status.OK, body
        grants = [g for g in LeaseReply.from_dict(body).grants if g is not None]
        # The segment's registered region, as readers find it in the metadata.
        region = SegmentInfo.from_entry(segment_id, cluster.metadata.get(SEGMENTS + segment_id),
                                        RegionHandle.from_dict).handle
        buf = engine.alloc_shared(1)
        mine = engine.register(buf)
        for g in grants:
            engine.read_sync(address, [(mine, 0, region, g.offset + 5, 1)])
            buf[0] ^= 0xFF
            engine.write_sync(address, [(mine, 0, region, g.offset + 5, 1)])
        engine.call(address, ReleaseRequest([(g.key, g.lease) for g in grants]).to_dict())
        engine.unregister(mine)
    return len(grants)


@ON_EMBEDDED
def test_a_corrupted_object_is_detected_and_recomputed(cluster, colocated):
    segment_id = cluster.start_node()
    prefix, holder = _stored_from_one_instance(cluster, "flipped")
    assert _flip_a_byte_of_every_object(cluster, segment_id) >= 4
    before = cluster.pool_counters()
    got = _asked_on_the_other_instance(cluster, colocated, prefix, holder)
    after = cluster.pool_counters()
    assert after["failed_reads_recomputed"] > before["failed_reads_recomputed"], "the corruption went unseen"
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] < 64, "a corrupt object was used"
    cluster.assert_clean()


@ON_EMBEDDED
def test_past_the_high_water_mark_objects_go_to_ssd_and_come_back(cluster, colocated):
    # A node with room for about a dozen objects: filling it demotes the least recently used.
    cluster.start_node(dram_gib=0.04, ssd_gib=0.5)
    prefix, holder = _stored_from_one_instance(cluster, "cold")
    for k in range(4):  # newer objects push the first prompt's out of DRAM
        cluster.complete(_words(f"filler{k}x", 100) + " Go on.", **GREEDY)
    until(lambda: cluster.pool()["demotions"] >= 4, 30, "the segment to demote to SSD")
    before = cluster.pool_counters()
    got = _asked_on_the_other_instance(cluster, colocated, prefix, holder)
    after = cluster.pool_counters()
    assert after["promotions"] > before["promotions"], "the hit did not come back up from SSD"
    assert after["failed_reads_recomputed"] == before["failed_reads_recomputed"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    cluster.assert_clean()
    cluster.stop_pool_node()


@ON_BOTH_BACKENDS
def test_a_second_turn_hits_the_first_turns_output(cluster, colocated):
    cluster.start_node()
    first = _words("turn", 40) + " Tell me a long story about the sea."
    turn = cluster.complete(first, temperature=0, max_tokens=160, ignore_eos=True)
    reply, n_first = turn["choices"][0]["text"], turn["usage"]["prompt_tokens"]
    second = first + reply + " And then?"
    # The decode instance stores prompt and output when the first turn finishes.
    until(lambda: len(cluster.object_keys()) >= (n_first + 150) // 64, 30, "the first turn's output in the pool")
    got = cluster.complete(second, **GREEDY)
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The prefill instances computed only the first prompt: more cached than its full blocks
    # can only have come from the pool's copy of the output.
    assert cached >= (n_first // 64 + 1) * 64, f"cached {cached} of a first prompt of {n_first} tokens"
    assert got["choices"][0]["text"] == _want(colocated, second)
    cluster.assert_clean()
    cluster.stop_pool_node()


@ON_EMBEDDED
def test_a_salted_turn_is_found_in_the_pool_under_its_salt_only(cluster, colocated):
    """Issue 52 item 3 through the cluster: a request's cache_salt keys its blocks on the prefill
    and decode instances and its objects in the pool (the decode instance's store of the output
    too, from its reservation): the next turn under the same salt hits the pool's copy of the
    output, the same prompt under another salt hits nothing, anywhere."""
    cluster.start_node()
    first = _words("salted", 40) + " Tell me a long story about the sea."
    pooled = len(cluster.object_keys())
    turn = cluster.complete(first, temperature=0, max_tokens=96, ignore_eos=True, cache_salt="alice")
    reply, n_first = turn["choices"][0]["text"], turn["usage"]["prompt_tokens"]
    second = first + reply + " And then?"
    until(lambda: len(cluster.object_keys()) >= pooled + (n_first + 90) // 64, 30, "the salted turn in the pool")
    probe = cluster.complete(second, **GREEDY, cache_salt="mallory")
    assert probe["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    got = cluster.complete(second, **GREEDY, cache_salt="alice")
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= (n_first // 64 + 1) * 64
    assert probe["choices"][0]["text"] == got["choices"][0]["text"] == _want(colocated, second)
    cluster.assert_clean()
    cluster.stop_pool_node()


@ON_EMBEDDED
def test_a_sessions_turn_is_retained_in_the_pool_and_the_instances_and_the_next_is_kept_there(cluster, colocated):
    """Issue 42 at the shipped defaults: a hinted turn's KV is retained where it is cached (the
    prefill instance's prompt, the decode instance's prompt and output, the pool's copy of them),
    and the next turn goes back to the prefill instance that holds it."""
    segment = cluster.start_node()
    first = _words("session", 40) + " Tell me about the mountains."
    hint = {"session_id": "hiker-1", "priority": 1}
    turn = cluster.complete(first, temperature=0, max_tokens=40, ignore_eos=True, **hint)
    second = first + turn["choices"][0]["text"] + " And the rivers?"
    until(lambda: cluster.pool()["segments"][segment]["retained_objects"] > 0, 30, "the turn retained in the pool")
    held = {i["url"]: cluster.instance_stats(i["url"])["num_retained_blocks"] for i in cluster.instances()}
    assert sum(n > 0 for n in held.values()) == 2, held  # the prefill instance it ran on, and the decode one
    got = cluster.complete(second, **GREEDY, **hint)
    assert got["choices"][0]["text"] == _want(colocated, second)
    stats = cluster.stats()
    assert (stats["session_turns_followed"], stats["session_turns_kept"]) == (1, 1)
    cluster.assert_clean()
    cluster.stop_pool_node()


@ON_EMBEDDED
def test_the_indexer_answers_from_the_live_index_while_the_cluster_serves(cluster, colocated):
    """Issue 42 item 6: /query, in the indexer API's documented shape, says which prefill
    instance holds a prompt it computed and that the pool holds it for the others; asked while
    another prompt keeps the cluster busy."""
    cluster.start_node()
    ids = colocated.tokenizer.encode(_words("indexed", 100) + " First question?")
    holder = cluster.complete_on_one_prefill(ids, **GREEDY)
    cluster.stored(3)
    ids_of = {i["url"]: i["instance_id"] for i in cluster.instances()}
    model = cluster.http.get("/v1/models").json()["data"][0]["id"]

    async def scenario() -> dict:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            busy = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": _words("indexbusy", 300), "max_tokens": 1, "temperature": 0}))
            await asyncio.to_thread(until, lambda: [i for i in cluster.instances("prefill") if i["prefilling"]], 60,
                                    "the long prompt on an instance")
            r = await http.post("/query", json={"model_name": model, "token_ids": ids})
            assert (await busy).status_code == 200
            return r.json()

    answer = asyncio.run(scenario())
    blocks = len(ids) // 16 * 16  # whole engine blocks
    by_id = answer["instances"]
    assert set(by_id) == set(ids_of.values())
    mine = by_id[ids_of[holder]]
    assert set(mine) == {"longest_matched", "gpu", "dp", "cpu", "disk"} and mine["gpu"] >= blocks - 16
    for url, iid in ids_of.items():
        entry = by_id[iid]
        assert entry["gpu"] <= entry["cpu"] <= entry["disk"] == entry["longest_matched"]
        assert entry["cpu"] >= 64 * 3  # every instance can load the pool's three objects
    cluster.stop_pool_node()


@pytest.mark.parametrize("cluster", ["etcd"], indirect=True)
def test_an_instance_put_into_etcd_without_the_secret_gets_no_request(cluster, colocated):
    """Issue 40: one unsigned write to etcd once added a fake prefill instance that answered 14 of
    20 clients. Now its record fails the membership MAC: the Conductor never polls it, sends it
    nothing, and counts the record in /stats and /metrics; the real instances' records verify."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hits: list[str] = []

    class Fake(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- http.server's name
            hits.append(self.path)
            self.send_response(500)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    fake = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    fake_url = f"http://127.0.0.1:{fake.server_address[1]}"
    key = "members/instances/fake0000"
    cluster.metadata.put(key, json.dumps({"url": fake_url, "role": "prefill"}))
    try:
        until(lambda: cluster.stats().get("membership_refused") == 1, 15, "the Conductor to refuse the record")
        prompts = [_words(f"fake{i}", 12) + " The capital of France is" for i in range(6)]
        for p in prompts:
            assert cluster.complete(p, **GREEDY)["choices"][0]["text"] == _want(colocated, p)
        assert hits == [], f"the fake instance was called: {hits}"
        assert fake_url not in [i["url"] for i in cluster.instances()]
        metrics = cluster.http.get("/metrics").text
        assert 'mooncake:membership_records_refused{model_name=' in metrics and "} 1.0" in metrics.split(
            "mooncake:membership_records_refused{")[1].split("\n")[0]
    finally:
        cluster.metadata.delete(key)
        fake.shutdown()
    until(lambda: cluster.stats().get("membership_refused") == 0, 15, "the record to leave the count")
    cluster.assert_clean()
