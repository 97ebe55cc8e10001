"""The indexer API (issue 42): other routers ask the Conductor how much of a prompt each instance holds.

The Conductor already keeps the index a KV-aware router needs: each instance's cached prefix
keys (polled, ``registry.py``) and the KVCache pool's objects (``cluster/pool/index.py``). This
serves it in the shape other systems speak, NVIDIA Dynamo's standalone indexer API, which
follows Mooncake's RFC #1403 (sources: Dynamo's docs/components/router/standalone-indexer.md;
Mooncake's docs/source/api-reference/http/conductor-indexer.md):

* ``POST /query`` ``{"model_name": M, "token_ids": [...], "instance_id": optional}``, answered
  ``{"instances": {ID: {"longest_matched": T, "gpu": T, "dp": {"0": T}, "cpu": T, "disk": T}}}``
  in tokens of whole blocks. The tiers are cumulative (gpu <= cpu <= disk): ``gpu`` is the
  instance's own prefix cache (the engine's KV: on a CPU instance that is DRAM too), ``cpu``
  adds what it can load from the pool, ``disk`` the same (the pool's index does not say whether
  an object sits in a node's DRAM or on its SSD tier; a read brings it back up).
* ``POST /query_by_hash`` ``{"model_name": M, "block_hashes": [...]}``: the prompt as sequence
  hashes (``paged_kv.block_hashes``, at the cluster's block size), for a router that never sees
  tokens. The Conductor learns them from the prompts and outputs it serves (``learn``).
* ``POST /register`` ``{"instance_id", "endpoint", "model_name", "block_size", "dp_rank"}``:
  an engine of another system publishing KV events as vLLM and SGLang do (msgpack batches on a
  ZMQ PUB socket at ``endpoint``). The Conductor follows them and answers for it too.
  ``POST /unregister`` ``{"instance_id", "model_name"}`` stops that.

These routes take the server's API key, as /v1 does; ``/register`` is refused unless one is
set: it makes the Conductor connect to an address the caller names.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
from starlette.requests import Request
from starlette.responses import JSONResponse

from cluster.policies.prefix_index import match_len
from paged_kv.block_hashes import sequence_hashes
from paged_kv.prefix_keys import PrefixKey, chain_keys

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
MAX_EXTERNAL = 64  # engines registered at once
MAX_EXTERNAL_BLOCKS = 1 << 21  # blocks indexed per registered engine (beyond: events dropped)
TIERS = ("gpu", "cpu", "disk")
# Event ``medium`` -> tier (vLLM: "GPU"; SGLang: also "CPU_PINNED", "DISK", "EXTERNAL").
_MEDIUM = {None: "gpu", "GPU": "gpu", "CPU": "cpu", "CPU_PINNED": "cpu", "DISK": "disk", "EXTERNAL": "disk"}


class IndexerError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Ours:
    """One of the cluster's instances as the indexer sees it: its id, block size and cached keys."""

    instance_id: str
    block_size: int
    match_len: Callable[[Sequence[PrefixKey]], int]


class HashIndex:
    """Sequence hashes (the convention's) -> our prefix keys, for the blocks of what the
    Conductor served lately (bounded: the oldest go first). Used on the event loop only."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, PrefixKey] = OrderedDict()

    def learn(self, token_ids: Sequence[int], block_size: int) -> None:
        for h, key in zip(sequence_hashes(token_ids, block_size), chain_keys(token_ids, block_size)):
            self._keys[h] = key
            self._keys.move_to_end(h)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def keys(self, hashes: Sequence[int]) -> list[PrefixKey]:
        """Our keys of the leading run of ``hashes`` known here."""
        return [self._keys[h] for h in hashes[:match_len(hashes, self._keys)]]


@dataclass
class ExternalEngine:
    """A registered engine of another system, its KV events followed on a thread of its own."""

    instance_id: str
    endpoint: str
    block_size: int
    dp_rank: int
    blocks: dict[str, set[int]] = field(default_factory=lambda: {t: set() for t in TIERS})
    _seq: dict[Any, int] = field(default_factory=dict)  # the engine's block hash -> sequence hash
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    events: int = 0
    dropped: int = 0

    def start(self, context: zmq.Context) -> None:
        threading.Thread(target=self._follow, args=(context,), name=f"kv events {self.instance_id}",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _follow(self, context: zmq.Context) -> None:
        sock = context.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.endpoint)
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                try:
                    self.apply(msgpack.unpackb(frames[-1], raw=False, strict_map_key=False))
                except (ValueError, TypeError, IndexError, msgpack.UnpackException) as e:
                    log.warning("indexer: a KV event batch of %s could not be read: %s", self.instance_id, e)
        finally:
            sock.close()

    def apply(self, batch: Any) -> None:
        """One event batch, vLLM's ``KVEventBatch``: ``[ts, [event, ...], dp_rank]``, each event
        an array with its tag first: ``["BlockStored", block_hashes, parent_block_hash,
        token_ids, block_size, lora_id, medium, ...]``, ``["BlockRemoved", block_hashes,
        medium]``, ``["AllBlocksCleared"]``."""
        with self._lock:
            for event in batch[1]:
                self.events += 1
                tag = event[0]
                if tag == "BlockStored":
                    self._stored(event[1], event[2], event[3], event[4], event[6] if len(event) > 6 else None)
                elif tag == "BlockRemoved":
                    tier = self.blocks[_MEDIUM.get(event[2] if len(event) > 2 else None, "disk")]
                    for h in event[1]:
                        if (seq := self._seq.pop(h, None)) is not None:
                            tier.discard(seq)
                elif tag == "AllBlocksCleared":
                    for tier in self.blocks.values():
                        tier.clear()
                    self._seq.clear()

    def _stored(self, hashes: list, parent: Any, token_ids: list[int], block_size: int, medium: str | None) -> None:
        if parent is not None and parent not in self._seq:
            self.dropped += len(hashes)  # its parent was never stored here: no chain to extend
            return
        if len(self._seq) + len(hashes) > MAX_EXTERNAL_BLOCKS:
            self.dropped += len(hashes)
            return
        seqs = sequence_hashes(token_ids, block_size, None if parent is None else self._seq[parent])
        tier = self.blocks[_MEDIUM.get(medium, "disk")]
        for h, seq in zip(hashes, seqs):
            self._seq[h] = seq
            tier.add(seq)

    def tiers(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Tokens of ``token_ids``'s leading blocks held in each tier, cumulatively."""
        seqs = sequence_hashes(token_ids, self.block_size)
        held: set[int] = set()
        out = {}
        with self._lock:
            for tier in TIERS:
                held |= self.blocks[tier]
                out[tier] = match_len(seqs, held) * self.block_size
        return out


class Indexer:
    """The routes, over the Conductor's view (``ours``: its instances up, ``pool_blocks``: how many
    leading keys of a prompt, in engine blocks, the pool holds)."""

    def __init__(self, model_name: str, ours: Callable[[], list[Ours]],
                 pool_blocks: Callable[[list[PrefixKey]], Awaitable[int]], registrations_allowed: bool) -> None:
        self.model_name = model_name
        self._ours = ours
        self._pool_blocks = pool_blocks
        self.registrations_allowed = registrations_allowed
        self.hashes = HashIndex()
        self.external: dict[str, ExternalEngine] = {}
        self._context: zmq.Context | None = None

    # -- the index -----------------------------------------------------------------------------------
    def learn(self, token_ids: Sequence[int]) -> None:
        """What the instances now likely hold (a prompt, or a prompt and its output): its
        sequence hashes, for ``/query_by_hash``."""
        ours = self._ours()
        if ours:
            self.hashes.learn(token_ids, ours[0].block_size)

    async def query(self, token_ids: list[int] | None, hashes: list[int] | None, instance_id: str | None
                    ) -> dict[str, Any]:
        ours = self._ours()
        answer: dict[str, Any] = {}
        if ours:
            bs = ours[0].block_size
            keys = chain_keys(token_ids, bs) if token_ids is not None else self.hashes.keys(hashes)
            pooled = await self._pool_blocks(keys) if keys else 0
            for inst in ours:
                gpu = inst.match_len(keys) * bs
                cpu = max(gpu, pooled * bs)
                answer[inst.instance_id] = _entry(gpu, cpu, cpu, 0)
        if token_ids is not None:  # other systems' engines hash tokens their own way: only tokens tell
            for ext in list(self.external.values()):
                t = ext.tiers(token_ids)
                answer[ext.instance_id] = _entry(t["gpu"], t["cpu"], t["disk"], ext.dp_rank)
        if instance_id is not None:
            answer = {k: v for k, v in answer.items() if k == instance_id}
        return {"instances": answer}

    # -- routes --------------------------------------------------------------------------------------
    async def query_route(self, request: Request) -> JSONResponse:
        return await self._answer(request, self._query_tokens)

    async def query_by_hash_route(self, request: Request) -> JSONResponse:
        return await self._answer(request, self._query_hashes)

    async def register_route(self, request: Request) -> JSONResponse:
        return await self._answer(request, self._register)

    async def unregister_route(self, request: Request) -> JSONResponse:
        return await self._answer(request, self._unregister)

    async def _answer(self, request: Request, handle: Callable[[dict], Awaitable[dict]]) -> JSONResponse:
        try:
            body = await _json_body(request)
            return JSONResponse(await handle(body))
        except IndexerError as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)

    async def _query_tokens(self, body: dict) -> dict:
        self._check_model(body)
        return await self.query(_uints(body, "token_ids", 32), None, _instance(body, optional=True))

    async def _query_hashes(self, body: dict) -> dict:
        self._check_model(body)
        size = body.get("block_size")
        ours = self._ours()
        if size is not None and ours and size != ours[0].block_size:
            raise IndexerError(f"'block_size' must be this cluster's, {ours[0].block_size}, to query by hash")
        return await self.query(None, _uints(body, "block_hashes", 64), _instance(body, optional=True))

    async def _register(self, body: dict) -> dict:
        if not self.registrations_allowed:
            raise IndexerError("registrations need the server's API key (--api-key): a registration makes the "
                               "Conductor connect to the endpoint it names", 403)
        self._check_model(body)
        instance_id = _instance(body)
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
            raise IndexerError("'endpoint' must be a ZMQ address (tcp://HOST:PORT or ipc://PATH)")
        block_size, dp_rank = body.get("block_size"), body.get("dp_rank", 0)
        for name, value, low in (("block_size", block_size, 1), ("dp_rank", dp_rank, 0)):
            if type(value) is not int or value < low:
                raise IndexerError(f"'{name}' must be an integer >= {low}")
        if instance_id in {o.instance_id for o in self._ours()}:
            raise IndexerError(f"'{instance_id}' is one of this cluster's own instances", 409)
        if instance_id not in self.external and len(self.external) >= MAX_EXTERNAL:
            raise IndexerError(f"at most {MAX_EXTERNAL} engines may be registered", 429)
        if self._context is None:
            self._context = zmq.Context.instance()
        old = self.external.pop(instance_id, None)
        if old is not None:
            old.stop()
        engine = self.external[instance_id] = ExternalEngine(instance_id, endpoint, block_size, dp_rank)
        engine.start(self._context)
        log.info("indexer: following the KV events of %s at %s", instance_id, endpoint)
        return {"status": "registered successfully", "instance_id": instance_id}

    async def _unregister(self, body: dict) -> dict:
        if not self.registrations_allowed:
            raise IndexerError("registrations need the server's API key (--api-key)", 403)
        self._check_model(body)
        instance_id = _instance(body)
        engine = self.external.pop(instance_id, None)
        if engine is None:
            raise IndexerError(f"no engine '{instance_id}' is registered", 404)
        engine.stop()
        return {"status": "unregistered successfully", "removed_instances": [instance_id]}

    def _check_model(self, body: dict) -> None:
        model = body.get("model_name", body.get("model", body.get("modelname")))
        if model is None:
            raise IndexerError("'model_name' is required")
        if model != self.model_name:
            raise IndexerError(f"this Conductor serves '{self.model_name}', not {model!r}", 404)
        # No adapters and no salted caches here: an answer computed without them would be wrong.
        # (``tenant_id`` / ``routing_group`` are ignored: one cluster is one tenant.)
        for name in ("lora_name", "cache_salt", "additional_salt", "additionalsalt"):
            if body.get(name):
                raise IndexerError(f"'{name}' is not supported: this cluster serves no LoRA adapters and no "
                                   "salted caches")

    def close(self) -> None:
        for engine in self.external.values():
            engine.stop()
        self.external.clear()

    def describe(self) -> dict[str, Any]:
        return {"indexer_registered": {e.instance_id: {"events": e.events, "dropped_blocks": e.dropped}
                                       for e in self.external.values()}}


def _entry(gpu: int, cpu: int, disk: int, dp_rank: int) -> dict[str, Any]:
    return {"longest_matched": disk, "gpu": gpu, "dp": {str(dp_rank): gpu}, "cpu": cpu, "disk": disk}


async def _json_body(request: Request) -> dict:
    size = 0
    chunks = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise IndexerError(f"the body is over {MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError:
        raise IndexerError("the body must be JSON") from None
    if not isinstance(body, dict):
        raise IndexerError("the body must be a JSON object")
    return body


def _uints(body: dict, name: str, bits: int) -> list[int]:
    value = body.get(name)
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v < 1 << bits for v in value):
        raise IndexerError(f"'{name}' must be an array of unsigned {bits}-bit integers")
    return value


def _instance(body: dict, optional: bool = False) -> str | None:
    value = body.get("instance_id")
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value) or len(str(value)) > 256:
        raise IndexerError("'instance_id' must be a string or an integer (at most 256 characters)")
    return str(value)
