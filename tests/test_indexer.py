"""Issue 42 item 6: the indexer API (cluster/conductor/indexer.py) and the block hashes it speaks
(paged_kv/block_hashes.py). A live cluster answering /query while it serves:
tests/test_pool_cluster.py."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import msgpack
import zmq
from starlette.applications import Starlette
from starlette.routing import Route

from cluster.conductor.indexer import ExternalEngine, Indexer, Ours
from cluster.policies.prefix_index import match_len
from paged_kv.block_hashes import local_hash, sequence_hashes
from paged_kv.prefix_keys import chain_keys

# Golden vectors of the convention, written down from NVIDIA Dynamo's published values
# (lib/tokens/src/lib.rs: HASH_1_4, HASH_5_8, HASH_9_12 and their SEQ_HASH_*; Mooncake's RFC #1527
# takes Dynamo's XXH3 seed 1337): tokens 1..12 in blocks of 4.
LOCAL = [14643705804678351452, 16777012769546811212, 483935686894639516]
SEQUENCE = [14643705804678351452, 4945711292740353085, 12583592247330656132]
MODEL = "test-model"
BS = 4


def test_block_hashes_match_the_conventions_golden_vectors():
    tokens = list(range(1, 13))
    assert [local_hash(tokens[i:i + 4]) for i in range(0, 12, 4)] == LOCAL
    assert sequence_hashes(tokens, 4) == SEQUENCE
    assert sequence_hashes(tokens + [13, 14], 4) == SEQUENCE  # a partial last block has none
    assert sequence_hashes(tokens[4:], 4, parent=SEQUENCE[0]) == SEQUENCE[1:]  # a chain goes on


class _Cache:
    def __init__(self, keys: list[bytes]) -> None:
        self.keys = set(keys)

    def match_len(self, keys) -> int:
        return match_len(keys, self.keys)


PROMPT = list(range(100, 124))  # 6 blocks of 4
KEYS = chain_keys(PROMPT, BS)


def _indexer(pool_blocks: int = 0, registrations: bool = True) -> Indexer:
    ours = [Ours("p0", BS, _Cache(KEYS[:2]).match_len), Ours("p1", BS, _Cache(KEYS[:5]).match_len)]

    async def pool(keys) -> int:
        return min(pool_blocks, len(keys))
    return Indexer(MODEL, lambda: ours, pool, registrations)


def _client(indexer: Indexer) -> httpx.AsyncClient:
    app = Starlette(routes=[Route(p, f, methods=["POST"]) for p, f in (
        ("/query", indexer.query_route), ("/query_by_hash", indexer.query_by_hash_route),
        ("/register", indexer.register_route), ("/unregister", indexer.unregister_route))])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://indexer")


def _entry(gpu: int, cpu: int, rank: str = "0") -> dict:
    return {"longest_matched": cpu, "gpu": gpu, "dp": {rank: gpu}, "cpu": cpu, "disk": cpu}


def test_query_answers_per_instance_and_tier_and_refuses_bad_input():
    async def scenario() -> None:
        async with _client(_indexer(pool_blocks=3)) as http:
            r = await http.post("/query", json={"model_name": MODEL, "token_ids": PROMPT + [1, 2]})
            # p0 holds 2 blocks, p1 5; the pool 3, which either may load: cumulative tiers.
            assert r.json() == {"instances": {"p0": _entry(8, 12), "p1": _entry(20, 20)}}
            r = await http.post("/query", json={"model_name": MODEL, "token_ids": PROMPT, "instance_id": "p0"})
            assert r.json() == {"instances": {"p0": _entry(8, 12)}}
            for body, status in [({"model_name": "other", "token_ids": PROMPT}, 404), ({"token_ids": PROMPT}, 400),
                                 ({"model_name": MODEL, "token_ids": [1, -2]}, 400),
                                 ({"model_name": MODEL, "token_ids": "1 2"}, 400),
                                 ({"model_name": MODEL, "token_ids": PROMPT, "lora_name": "sql-adapter"}, 400),
                                 ({"model_name": MODEL, "token_ids": PROMPT, "cache_salt": "w8a8"}, 400)]:
                assert (await http.post("/query", json=body)).status_code == status, body
            assert (await http.post("/query", content=b"[not json")).status_code == 400
    asyncio.run(scenario())


def test_query_by_hash_knows_the_blocks_of_what_was_served():
    indexer = _indexer()
    hashes = sequence_hashes(PROMPT, BS)

    async def scenario() -> None:
        async with _client(indexer) as http:
            body = {"model_name": MODEL, "block_hashes": hashes}
            assert (await http.post("/query_by_hash", json=body)).json()["instances"]["p1"]["gpu"] == 0
            indexer.learn(PROMPT)  # the Conductor served it
            r = await http.post("/query_by_hash", json=body)
            assert r.json()["instances"] == {"p0": _entry(8, 8), "p1": _entry(20, 20)}
            r = await http.post("/query_by_hash", json={**body, "block_size": 16})
            assert r.status_code == 400 and "block_size" in r.json()["error"]
    asyncio.run(scenario())


def _stored(hashes, parent, tokens, medium="GPU") -> list:
    return ["BlockStored", hashes, parent, tokens, BS, None, medium]


def test_a_registered_engines_events_build_its_tiers():
    engine = ExternalEngine("vllm-1", "tcp://127.0.0.1:1", BS, 1)
    engine.apply([0.0, [_stored([11, 12], None, PROMPT[:8]), _stored([13], 12, PROMPT[8:12], "CPU_PINNED")], 1])
    assert engine.tiers(PROMPT) == {"gpu": 8, "cpu": 12, "disk": 12}
    engine.apply([0.1, [_stored([99], 98, PROMPT[16:20])], 1])  # its parent was never stored: not indexed
    assert engine.dropped == 1
    engine.apply([0.2, [["BlockRemoved", [12], "GPU"]], 1])
    assert engine.tiers(PROMPT) == {"gpu": 4, "cpu": 4, "disk": 4}  # a gap ends the prefix
    engine.apply([0.3, [["AllBlocksCleared"]], 1])
    assert engine.tiers(PROMPT) == {"gpu": 0, "cpu": 0, "disk": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_register_follows_an_engines_kv_events_over_zmq_and_unregister_stops():
    indexer = _indexer()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)

    async def scenario() -> None:
        async with _client(indexer) as http:
            reg = {"model_name": MODEL, "instance_id": "vllm-1", "endpoint": endpoint, "block_size": BS, "dp_rank": 2}
            r = await http.post("/register", json=reg)
            assert r.json() == {"status": "registered successfully", "instance_id": "vllm-1"}
            batch = msgpack.packb([time.time(), [_stored([1, 2, 3], None, PROMPT[:12])], 2])
            deadline = time.monotonic() + 10
            while True:  # a SUB socket misses what was sent before it connected: send until seen
                pub.send_multipart([b"", (0).to_bytes(8, "big"), batch])
                r = await http.post("/query", json={"model_name": MODEL, "token_ids": PROMPT})
                if r.json()["instances"]["vllm-1"]["gpu"] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert r.json()["instances"]["vllm-1"] == _entry(12, 12, "2")
            assert r.json()["instances"]["p1"]["gpu"] == 20  # and the cluster's own, beside it
            for bad in ({**reg, "endpoint": "http://x"}, {**reg, "block_size": 0}, {**reg, "instance_id": "p0"}):
                assert (await http.post("/register", json=bad)).status_code in (400, 409), bad
            r = await http.post("/unregister", json={"model_name": MODEL, "instance_id": "vllm-1"})
            assert r.json() == {"status": "unregistered successfully", "removed_instances": ["vllm-1"]}
            assert "vllm-1" not in (await http.post("/query", json={"model_name": MODEL, "token_ids": PROMPT})
                                    ).json()["instances"]
            assert (await http.post("/unregister", json={"model_name": MODEL, "instance_id": "vllm-1"})
                    ).status_code == 404
    try:
        asyncio.run(scenario())
    finally:
        indexer.close()
        pub.close(0)


def test_without_an_api_key_no_engine_may_register():
    async def scenario() -> None:
        async with _client(_indexer(registrations=False)) as http:
            r = await http.post("/register", json={"model_name": MODEL, "instance_id": "x",
                                                   "endpoint": "tcp://127.0.0.1:9", "block_size": 4})
            assert r.status_code == 403 and "--api-key" in r.json()["error"]
    asyncio.run(scenario())
