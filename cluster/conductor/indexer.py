"""The indexer API: other routers ask the Conductor how much of a prompt each instance holds.

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
  ZMQ PUB socket at ``endpoint``, decoded by ``kv_events.py``). The Conductor follows them on a
  thread per engine and answers for it too. ``POST /unregister`` ``{"instance_id", "model_name"}``
  stops that.

These routes are the operator's (``--operator-key``, as ``/stats``; without one, a user's key,
as /v1, under ``--cache-scope shared`` only): a cached prefix is what another user's prompt began
with. They answer for unsalted prompts (``SamplingParams.cache_salt``): a salted one never
matches. The HTTP side is ``cluster/conductor/routes.py``. ``/register`` is refused
unless an operator key is set and the operator listed the endpoint (``--indexer-allow``): it
makes the Conductor connect to an address the caller names.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from cluster.conductor.kv_events import (
    MAX_BLOCK_SIZE, MAX_FRAME_BYTES, BlockHash, BlockRemoved, BlockStored, Event, decode_batch,
)
from cluster.policies.prefix_index import match_len
from paged_kv.block_hashes import sequence_hashes
from paged_kv.prefix_keys import PrefixKey, chain_keys

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # when the server names none
MAX_EXTERNAL = 64  # engines registered at once
# Blocks indexed for registered engines (beyond: their events are dropped, and counted): ~210 bytes
# a block with vLLM's 32-byte hashes, so at most ~60 MiB an engine and ~230 MiB for all of them.
MAX_EXTERNAL_BLOCKS = 1 << 18
MAX_INDEXED_BLOCKS = 1 << 20
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


class BlockBudget:
    """The blocks all registered engines may index together. Taken and given back by the
    followers' threads only (the lock is never one the event loop waits on)."""

    def __init__(self, limit: int = MAX_INDEXED_BLOCKS) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


# A block's media as bits, one a tier: one block may sit in several at once (vLLM offloading to CPU
# keeps the GPU copy). A tier's answer counts the blocks in it or any tier before it (cumulative).
_BIT = {tier: 1 << i for i, tier in enumerate(TIERS)}
_CUMULATIVE = tuple((tier, (1 << (i + 1)) - 1) for i, tier in enumerate(TIERS))
LOG_EVERY_S = 30.0  # a registered engine's bad batches are logged at most this often (all are counted)
RECONNECT_S = 1.0  # after a dropped connection, before the next


class ExternalEngine:
    """A registered engine of another system, its KV events followed on a thread of its own.

    Invariants: only the follower thread writes ``_held`` (sequence hash -> media bits) and
    ``_seq`` (the engine's block hash -> sequence hash); a query reads ``_held`` one ``dict.get``
    at a time (atomic under the GIL), so the event loop never waits on the follower; a clear swaps
    in new dicts. ``_seq`` holds at most ``max_blocks`` hashes of at most ``MAX_HASH_BYTES``: what
    an engine can make the Conductor keep is bounded in bytes, as are its frames (``MAX_FRAME_BYTES``,
    ``QUEUED_FRAMES`` of them queued). No batch stops the follower: a bad one is counted, logged and
    named in ``/stats``; only the socket failing ends it, and then ``alive`` says so."""

    QUEUED_FRAMES = 8

    def __init__(self, instance_id: str, endpoint: str, block_size: int, dp_rank: int,
                 budget: BlockBudget | None = None, max_blocks: int = MAX_EXTERNAL_BLOCKS) -> None:
        self.instance_id, self.endpoint, self.block_size, self.dp_rank = instance_id, endpoint, block_size, dp_rank
        self.budget = budget or BlockBudget()
        self.max_blocks = max_blocks
        self._held: dict[int, int] = {}
        self._seq: dict[BlockHash, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_seq: int | None = None
        self._logged_at = -LOG_EVERY_S
        self.events = self.dropped = self.bad_batches = self.missed_batches = self.reconnects = 0
        self.last_error: str | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def start(self, context: zmq.Context) -> None:
        self._thread = threading.Thread(target=self._follow, args=(context,), name=f"kv events {self.instance_id}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        """Wait (bounded) for the follower to end after ``stop``; True once it has."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()

    def _follow(self, context: zmq.Context) -> None:
        try:
            while not self._stop.is_set():
                self._follow_connection(context)
                if not self._stop.wait(RECONNECT_S):
                    self.reconnects += 1
        except Exception as e:  # noqa: BLE001 -- the socket failed: said in /stats and /query (alive)
            self.last_error = f"the follower stopped: {type(e).__name__}: {e}"
            log.exception("indexer: the KV event follower of %s stopped", self.instance_id)
        finally:
            self.budget.give(len(self._seq))
            self._held, self._seq = {}, {}

    def _follow_connection(self, context: zmq.Context) -> None:
        """Read batches until the connection drops. ZMQ reconnects by itself after a peer goes
        away, but not after a protocol error (a message over MAX_FRAME_BYTES, say): so on any
        disconnection the socket is made anew, after RECONNECT_S."""
        sock = context.socket(zmq.SUB)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a bigger message drops the connection, unread
            sock.setsockopt(zmq.RCVHWM, self.QUEUED_FRAMES)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.endpoint)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(200))
                if sock in ready:
                    self.receive(sock.recv_multipart())
                elif monitor in ready:
                    monitor.recv_multipart()
                    self.last_error = (f"the connection to {self.endpoint} dropped (the publisher went away, or sent "
                                       f"a message over {MAX_FRAME_BYTES} bytes); reconnecting")
                    return
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def receive(self, frames: list[bytes]) -> None:
        """One message: ``[topic, sequence number (8 bytes, big-endian), batch]`` (the topic optional)."""
        try:
            if len(frames) >= 2 and len(frames[-2]) == 8:
                seq = int.from_bytes(frames[-2], "big")
                if self._last_seq is not None and seq > self._last_seq + 1:
                    self.missed_batches += seq - self._last_seq - 1  # lost to the queue bound, or before we joined
                self._last_seq = seq
            _, events, _ = decode_batch(frames[-1])
            self.apply(events)
        except Exception as e:  # noqa: BLE001 -- whatever a publisher sends, the follower goes on
            self.bad_batches += 1
            self.last_error = f"{type(e).__name__}: {e}"[:300]
            now = time.monotonic()
            if now - self._logged_at >= LOG_EVERY_S:
                self._logged_at = now
                log.warning("indexer: a KV event batch of %s could not be used (%d so far): %s", self.instance_id,
                            self.bad_batches, self.last_error)

    def apply(self, events: list[Event]) -> None:
        """Decoded events (``kv_events.decode_batch``), in order."""
        for event in events:
            self.events += 1
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            else:
                self.budget.give(len(self._seq))
                self._held, self._seq = {}, {}

    def _stored(self, event: BlockStored) -> None:
        n = len(event.block_hashes)
        parent = None
        if event.parent is not None:
            parent = self._seq.get(event.parent)
            if parent is None:
                self.dropped += n  # its parent was never stored here: no chain to extend
                return
        if event.keyed_beyond_tokens or event.block_size != self.block_size:
            # A prompt's tokens at the registered block size cannot say whether these match.
            self.dropped += n
            return
        new = len({h for h in event.block_hashes if h not in self._seq})
        if len(self._seq) + new > self.max_blocks or not self.budget.take(new):
            self.dropped += n
            return
        bit = _BIT[_MEDIUM.get(event.medium, "disk")]
        held = self._held
        for h, seq in zip(event.block_hashes, sequence_hashes(event.token_ids, event.block_size, parent)):
            self._seq[h] = seq
            held[seq] = held.get(seq, 0) | bit

    def _removed(self, event: BlockRemoved) -> None:
        bit = _BIT[_MEDIUM.get(event.medium, "disk")]
        held = self._held
        for h in event.block_hashes:
            seq = self._seq.get(h)
            if seq is None:
                continue
            left = held.get(seq, 0) & ~bit
            if left:
                held[seq] = left  # still in another medium
            else:
                held.pop(seq, None)
                del self._seq[h]
                self.budget.give(1)

    def tiers(self, seqs: Sequence[int]) -> dict[str, int]:
        """Tokens of a prompt's leading blocks (``seqs``: their sequence hashes at this engine's
        block size) held in each tier, cumulatively."""
        held = self._held  # one reference: a clear swaps the dict, never empties this one
        out = {}
        for tier, mask in _CUMULATIVE:
            n = 0
            while n < len(seqs) and held.get(seqs[n], 0) & mask:
                n += 1
            out[tier] = n * self.block_size
        return out

    def describe(self) -> dict[str, Any]:
        return {"alive": self.alive, "events": self.events, "blocks": len(self._seq), "dropped_blocks": self.dropped,
                "bad_batches": self.bad_batches, "missed_batches": self.missed_batches, "reconnects": self.reconnects,
                "last_error": self.last_error}


class Indexer:
    """The routes, over the Conductor's view (``ours``: its instances up, ``pool_blocks``: how many
    leading keys of a prompt, in engine blocks, the pool holds; ``reserved``: the cluster's own
    ``host:port`` addresses, which no registration may name).

    Registrations need the server's operator key and an endpoint the operator listed (``allow``:
    ``host:port`` or ``ipc://path`` entries, ``--indexer-allow``): a registration makes the
    Conductor connect where the caller says. Work that grows with a prompt (reading the body,
    hashing it) runs off the event loop, and a body is bounded as /v1's are (``max_body_bytes``)."""

    JOIN_S = 10.0  # how long a re-registration waits for the follower it replaces

    def __init__(self, model_name: str, ours: Callable[[], list[Ours]],
                 pool_blocks: Callable[[list[PrefixKey]], Awaitable[int]], registrations_allowed: bool, *,
                 allow: Sequence[str] = (), reserved: Callable[[], set[str]] = set,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.model_name = model_name
        self._ours = ours
        self._pool_blocks = pool_blocks
        self.registrations_allowed = registrations_allowed
        self.allow = frozenset(allow)
        self._reserved = reserved
        self.max_body_bytes = max_body_bytes
        self.hashes = HashIndex()
        self.external: dict[str, ExternalEngine] = {}
        self.budget = BlockBudget()
        self._context: zmq.Context | None = None
        self._registering = asyncio.Lock()

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
        # Other systems' engines hash tokens their own way: only tokens tell what they hold.
        external = list(self.external.values()) if token_ids is not None else []
        bs = ours[0].block_size if ours else None
        keys, seqs = await asyncio.to_thread(_hash_prompt, token_ids, bs, {e.block_size for e in external})
        answer: dict[str, Any] = {}
        if ours:
            if token_ids is None:
                keys = self.hashes.keys(hashes)
            pooled = await self._pool_blocks(keys) if keys else 0
            for inst in ours:
                gpu = inst.match_len(keys) * bs
                cpu = max(gpu, pooled * bs)
                answer[inst.instance_id] = _entry(gpu, cpu, cpu, 0)
        for ext in external:
            if ext.alive:
                t = ext.tiers(seqs[ext.block_size])
                answer[ext.instance_id] = _entry(t["gpu"], t["cpu"], t["disk"], ext.dp_rank)
            else:  # its follower stopped: what it last knew may be long gone
                answer[ext.instance_id] = {**_entry(0, 0, 0, ext.dp_rank), "stale": True}
        if instance_id is not None:
            answer = {k: v for k, v in answer.items() if k == instance_id}
        return {"instances": answer}

    # -- what the routes call (cluster/conductor/routes.py): a JSON body in, an answer out, an
    # ``IndexerError`` for what the caller got wrong --------------------------------------------------
    async def query_tokens(self, body: dict) -> dict:
        self._check_model(body)
        tokens = await asyncio.to_thread(_uints, body, "token_ids", 32)
        return await self.query(tokens, None, _instance(body, optional=True))

    async def query_hashes(self, body: dict) -> dict:
        self._check_model(body)
        size = body.get("block_size")
        ours = self._ours()
        if size is not None and ours and size != ours[0].block_size:
            raise IndexerError(f"'block_size' must be this cluster's, {ours[0].block_size}, to query by hash")
        hashes = await asyncio.to_thread(_uints, body, "block_hashes", 64)
        return await self.query(None, hashes, _instance(body, optional=True))

    async def register(self, body: dict) -> dict:
        if not self.registrations_allowed:
            raise IndexerError("registrations need the server's operator key (--operator-key): a registration "
                               "makes the Conductor connect to the endpoint it names", 403)
        self._check_model(body)
        instance_id = _instance(body)
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")) or len(endpoint) > 512:
            raise IndexerError("'endpoint' must be a ZMQ address (tcp://HOST:PORT or ipc://PATH)")
        self._check_endpoint(endpoint)
        block_size, dp_rank = body.get("block_size"), body.get("dp_rank", 0)
        for name, value, low, high in (("block_size", block_size, 1, MAX_BLOCK_SIZE), ("dp_rank", dp_rank, 0, 1 << 16)):
            if type(value) is not int or not low <= value <= high:
                raise IndexerError(f"'{name}' must be an integer in {low}..{high}")
        if instance_id in {o.instance_id for o in self._ours()}:
            raise IndexerError(f"'{instance_id}' is one of this cluster's own instances", 409)
        async with self._registering:
            if instance_id not in self.external and len(self.external) >= MAX_EXTERNAL:
                raise IndexerError(f"at most {MAX_EXTERNAL} engines may be registered", 429)
            old = self.external.pop(instance_id, None)
            if old is not None:
                await self._retire(old)
            if self._context is None:
                self._context = zmq.Context.instance()
            engine = self.external[instance_id] = ExternalEngine(instance_id, endpoint, block_size, dp_rank, self.budget)
            engine.start(self._context)
        log.info("indexer: following the KV events of %s at %s", instance_id, endpoint)
        return {"status": "registered successfully", "instance_id": instance_id}

    async def unregister(self, body: dict) -> dict:
        if not self.registrations_allowed:
            raise IndexerError("registrations need the server's operator key (--operator-key)", 403)
        self._check_model(body)
        instance_id = _instance(body)
        async with self._registering:
            engine = self.external.pop(instance_id, None)
            if engine is None:
                raise IndexerError(f"no engine '{instance_id}' is registered", 404)
            await self._retire(engine)
        return {"status": "unregistered successfully", "removed_instances": [instance_id]}

    async def _retire(self, engine: ExternalEngine) -> None:
        """Stop a follower and wait for it, so that no two follow one id (or pile up)."""
        engine.stop()
        if not await asyncio.to_thread(engine.join, self.JOIN_S):
            raise IndexerError(f"the KV event follower of '{engine.instance_id}' did not stop within "
                               f"{self.JOIN_S:.0f} s; try again", 503)

    def _check_endpoint(self, endpoint: str) -> None:
        try:
            address = endpoint_address(endpoint)
        except ValueError as e:
            raise IndexerError(str(e)) from None
        if address in self._reserved():
            raise IndexerError(f"{endpoint} is one of this cluster's own addresses", 403)
        if address not in self.allow:
            raise IndexerError(f"{endpoint} is not an endpoint the operator allows (--indexer-allow "
                               f"{address} on the server)", 403)

    def _check_model(self, body: dict) -> None:
        model = body.get("model_name", body.get("model", body.get("modelname")))
        if model is None:
            raise IndexerError("'model_name' is required")
        if model != self.model_name:
            raise IndexerError(f"this Conductor serves '{self.model_name}', not {str(model)[:100]!r}", 404)
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
        return {"indexer_registered": {e.instance_id: e.describe() for e in self.external.values()},
                "indexer_blocks": {"used": self.budget.used, "limit": self.budget.limit}}


def endpoint_address(endpoint: str) -> str:
    """An endpoint as registrations and ``--indexer-allow`` are compared: ``ipc://PATH`` as it is,
    ``tcp://HOST:PORT`` or ``HOST:PORT`` as ``HOST:PORT``. Raises ValueError for anything else."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{endpoint!r} is not tcp://HOST:PORT (or HOST:PORT) nor ipc://PATH")
    return f"{host}:{int(port)}"


def _hash_prompt(token_ids: list[int] | None, block_size: int | None, external_sizes: set[int]
                 ) -> tuple[list[PrefixKey], dict[int, list[int]]]:
    """A prompt's keys at the cluster's block size and its sequence hashes at each registered
    engine's: once per block size, whatever the number of engines."""
    if token_ids is None:
        return [], {}
    keys = chain_keys(token_ids, block_size) if block_size else []
    return keys, {size: sequence_hashes(token_ids, size) for size in external_sizes}


def _entry(gpu: int, cpu: int, disk: int, dp_rank: int) -> dict[str, Any]:
    return {"longest_matched": disk, "gpu": gpu, "dp": {str(dp_rank): gpu}, "cpu": cpu, "disk": disk}


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
