"""bench.faults: the rows of the matrix, and the faults that are not failpoints.

A row names its fault, how it is injected and the traffic it runs under. Most faults are
failpoints (``cluster.failpoints``) armed on the instances of one role for a number of passes;
four are made from outside the failpoints: hostile control messages signed with the cluster's
key (``hostile_control``), pool objects of another KV layout planted under the keys the next
turns will read (``plant_foreign_objects``: a writer of another model or layout whose key
collides with ours, or a segment that lies), the Conductor stopped past its reservation lease
mid-stream (``pause_conductor``), and a Messenger peer restarted at the same address
(``restarted_peer``, two Messengers in the bench's own process: the transport is the real one,
the fault needs a fixed port, which the instances do not use).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from cluster.failpoints import NAMES
from cluster.messenger import Messenger, MessengerConfig, TransferError
from cluster.protocol import EPOCH_HEADER, MESSENGER, AbortRequest, PrefillRequest, ReserveRequest, derive_key
from engine.sampling_params import SamplingParams

# Traffic kinds (``bench.faults.traffic``): fresh prompts; two-turn sessions whose second turn
# reads the pool; the same with two second turns at once that share the first turn's blocks.
FRESH, SESSIONS, SHARED_SESSIONS, NONE = "fresh", "sessions", "shared sessions", "none"
# Where failpoints are armed: the instances of a role, or all of them.
PREFILL, DECODE, EVERY = "prefill", "decode", "every"
# What the bench's own control calls say they come from: a Conductor id of its own, so that no
# real Conductor's reservations are touched by the instance noticing a new epoch.
BENCH_FENCE = "faults-bench/1"
# The prompt of the bench's own reservation (3 blocks of 16), which the hostile calls name too:
# with the same blocks, only what they do wrong on purpose is wrong.
HOSTILE_PROMPT = list(range(1000, 1040))


@dataclass(frozen=True)
class Row:
    name: str
    fault: str  # what happens, for the table
    traffic: str
    failpoints: dict[str, dict[str, int]] = field(default_factory=dict)  # where -> {failpoint: times}
    action: str = ""  # a fault of this module's, run during the traffic
    quick: bool = False  # in ``--quick`` (CI)

    def __post_init__(self) -> None:
        unknown = {n for arm in self.failpoints.values() for n in arm} - NAMES
        assert not unknown, f"row {self.name}: unknown failpoints {unknown}"


ROWS: tuple[Row, ...] = (
    Row("kv-bit-flip", "one bit flipped in a streamed layer, after its checksum", FRESH,
        {PREFILL: {"kv.flip_bit": 2}}, quick=True),
    Row("kv-truncated-layer", "a layer's last write carries half its bytes", FRESH, {PREFILL: {"kv.truncate": 2}}),
    Row("kv-layer-never-sent", "a layer (and its checksum) never written, the prefill says done", FRESH,
        {PREFILL: {"kv.drop_layer": 2}}, quick=True),
    Row("kv-late-write", "a write into the range of a finished request, naming its old use", FRESH,
        {PREFILL: {"kv.stale_write": 3}}, quick=True),
    Row("reservation-lapse", "the decode reservation lapses mid-transfer", FRESH,
        {DECODE: {"reserve.lapse": 2}}),
    Row("control-foreign-blocks", "signed control calls naming foreign, out-of-range or negative blocks",
        FRESH, action="hostile_control", quick=True),
    Row("control-fuzz", "every control endpoint, signed malformed bodies (item 7: only 4xx)", FRESH,
        action="control_fuzz", quick=True),
    Row("pool-dram-corrupt", "one bit flipped in a pool object in DRAM, after its checksums", SESSIONS,
        {EVERY: {"pool.flip_bit": 1}}),
    Row("pool-evicted-after-lookup", "a pool object evicted between the lookup and the read", SESSIONS,
        {EVERY: {"pool.evict_on_lease": 2}}),
    Row("pool-load-fails-shared", "a pool load fails while two requests share its blocks", SHARED_SESSIONS,
        {EVERY: {"pool.fail_read": 1}}),
    Row("pool-foreign-object", "an object of another KV layout stored under the key a turn will read", SESSIONS,
        action="foreign_objects"),
    Row("messenger-peer-restart", "a Messenger peer restarted at the same address; old region handles",
        NONE, action="restarted_peer", quick=True),
    Row("conductor-paused", "the Conductor stopped (SIGSTOP) past the reservation lease mid-stream", FRESH,
        action="pause_conductor"),
)


# --------------------------------------------------------------------------- hostile control calls


@dataclass
class ControlCall:
    """One hostile control call and its answer: it must be refused (a 4xx)."""

    label: str
    status: int | None = None
    answer: str = ""

    @property
    def refused(self) -> bool:
        return self.status is not None and 400 <= self.status < 500


@asynccontextmanager
async def bench_reservation(control: httpx.AsyncClient, decode_url: str) -> AsyncIterator[dict[str, Any]]:
    """A real reservation of the bench's own on the decode instance (its ``KVDestination`` as a
    dict), aborted on the way out: what hostile calls name as their destination."""
    headers = {EPOCH_HEADER: BENCH_FENCE}
    # An id of its own each time: an aborted id is refused to its Conductor for a lease.
    rid = f"faults-bench-reservation-{os.urandom(4).hex()}"
    reserve = ReserveRequest(rid, HOSTILE_PROMPT, SamplingParams(max_tokens=1))
    r = await control.post(decode_url + "/instance/reserve", content=json.dumps(reserve.to_dict()), headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"the bench's own reservation was refused: {r.status_code} {r.text[:300]}")
    try:
        yield r.json()["dest"]
    finally:
        await control.post(decode_url + "/instance/abort", headers=headers,
                           content=json.dumps(AbortRequest(rid, writes_done=True).to_dict()))


async def hostile_control(control: httpx.AsyncClient, prefill_url: str, decode_url: str,
                          dest: dict[str, Any]) -> list[ControlCall]:
    """Signed control calls a confused or hostile caller with the cluster's key could make while
    the cluster serves, ``dest`` a real reservation of the caller's (``bench_reservation``): a
    prefill told to write into it past its end, into another range of the same region, under
    another use's generation, with a negative or huge block count, into a region of another
    engine; a reserve for a prompt of a million tokens. Each must be refused with a 4xx, and the
    traffic beside them must not notice."""
    headers = {EPOCH_HEADER: BENCH_FENCE}
    ids = HOSTILE_PROMPT
    region_len = int(dest["region"]["length"])
    variants: list[tuple[str, dict[str, Any]]] = [
        ("prefill into offsets past the region's end", {**dest, "offset": region_len + 4096}),
        ("prefill into another range of the region (the real generation)",
         {**dest, "offset": (dest["offset"] + region_len // 2) % region_len}),
        ("prefill naming another use's generation", {**dest, "generation": int(dest.get("generation", 0)) + 7919}),
        ("prefill with a negative block count", {**dest, "num_blocks": -3}),
        ("prefill with a billion blocks", {**dest, "num_blocks": 10**9}),
        ("prefill with negative skipped blocks", {**dest, "skip_blocks": -2}),
        ("prefill into a region of another engine", {**dest, "region": {**dest["region"], "engine_id": "0" * 16}}),
        ("prefill with a region of negative length", {**dest, "region": {**dest["region"], "length": -1}}),
    ]
    calls: list[ControlCall] = []
    for i, (label, bad) in enumerate(variants):
        body = PrefillRequest(f"faults-bench-hostile-{i}", ids, SamplingParams(max_tokens=1), bad).to_dict()
        calls.append(await _call(control, prefill_url + "/instance/prefill", body, headers, label))
    huge = ReserveRequest("faults-bench-huge", [7] * 1_000_000, SamplingParams(max_tokens=1)).to_dict()
    calls.append(await _call(control, decode_url + "/instance/reserve", huge, headers,
                             "reserve for a prompt of a million tokens"))
    return calls


async def _call(control: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str], label: str) -> ControlCall:
    call = ControlCall(label)
    try:
        r = await control.post(url, content=json.dumps(body), headers={**headers, "Content-Type": "application/json"})
        call.status, call.answer = r.status_code, r.text[:200]
    except httpx.HTTPError as e:
        call.answer = f"no answer: {type(e).__name__}"
    return call


# --------------------------------------------------------------------------- foreign pool objects


def plant_foreign_objects(secret: bytes, metadata_url: str, namespace: str, blocks_per_object: int,
                          block_size: int, prompts: Sequence[list[int]], part_bytes: int) -> int:
    """Store, under the pool key of each prompt's first object, an object of another layout
    (parts of ``part_bytes // 2``, random bytes, true checksums of its own), before anything of
    ours is stored there (a stored key is never written again: ours are then skipped). Returns
    how many the pool took."""
    from cluster.pool import PoolClient
    from cluster.metadata import connect_metadata
    from cluster.pool.objects import object_keys, part_checksums
    from paged_kv.prefix_keys import chain_keys

    metadata = connect_metadata(metadata_url, secret)
    half = part_bytes // 2
    with Messenger(MessengerConfig(secret=derive_key(secret, MESSENGER))) as transfer:
        client = PoolClient(transfer, metadata)
        nbytes = half * 30  # any number of parts: another model's
        buf = transfer.alloc_shared(nbytes)
        handle = transfer.register(buf)
        planted = 0
        for ids in prompts:
            tokens = blocks_per_object * block_size
            (key,) = object_keys(namespace, chain_keys(ids[:tokens], block_size), blocks_per_object)
            buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
            sums = part_checksums(memoryview(buf.numpy()), half)
            planted += client.put(key, handle, 0, nbytes, half, sums) is not None
        transfer.unregister(handle)
    metadata.close()
    return planted


# --------------------------------------------------------------------------- the Conductor paused


async def pause_conductor(pid: int, after_s: float, stop_s: float) -> None:
    """SIGSTOP the Conductor ``after_s`` into the traffic (streams are mid-way) for ``stop_s``:
    past the reservation lease, so the instances release what it reserved; then SIGCONT."""
    await asyncio.sleep(after_s)
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(stop_s)
    finally:
        os.kill(pid, signal.SIGCONT)


# --------------------------------------------------------------------------- a Messenger peer restarted


@dataclass
class PeerRestart:
    fresh_write_intact: bool  # a write through the new incarnation's own handle landed as sent
    stale_refused: int  # writes naming the old incarnation's region that were refused
    stale_landed: int  # ... that landed: the failure this row looks for
    detail: str = ""


def restarted_peer(secret: bytes, writes: int = 3) -> PeerRestart:
    """A receiver at a fixed port registers a region and a sender writes into it; the receiver
    is closed and a new one starts at the same address (a restarted instance, same port) with a
    region of its own; the sender, its connection cached, writes with the old handle again.
    Every such write must be refused and the new region keep its bytes; a write with the new
    incarnation's handle must land."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = MessengerConfig(secret=secret, port=port, transport="tcp", timeout_s=5.0)
    sender = Messenger(MessengerConfig(secret=secret, transport="tcp", timeout_s=5.0))
    old = Messenger(cfg)
    try:
        src = sender.alloc_shared(4096)
        src_handle = sender.register(src)
        dst = old.alloc_shared(4096)
        old_handle = old.register(dst)
        src[:] = 1
        sender.write_sync(old.address, [(src_handle, 0, old_handle, 0, 4096)])
        old.close()
        new = _bind_again(cfg)
        try:
            mem = new.alloc_shared(4096)
            mem[:] = 9
            new_handle = new.register(mem)
            refused = landed = 0
            src[:] = 2
            for _ in range(writes):
                try:
                    sender.write_sync(new.address, [(src_handle, 0, old_handle, 0, 4096)])
                    landed += 1
                except TransferError:
                    refused += 1
            landed += int(not bool((mem.numpy() == 9).all()))
            src[:] = 3
            sender.write_sync(new.address, [(src_handle, 0, new_handle, 0, 4096)])
            fresh = bool((mem.numpy() == 3).all())
        finally:
            new.close()
    finally:
        sender.close()
    return PeerRestart(fresh, refused, landed, f"port {port}")


def _bind_again(cfg: MessengerConfig, within_s: float = 10.0) -> Messenger:
    """A Messenger at ``cfg``'s fixed port, once the old one's socket has let go of it."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return Messenger(cfg)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
