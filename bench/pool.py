"""KVCache pool benchmark: put/get throughput against Mooncake Store, and TTFT with the pool.

Run with ``python -m bench.pool`` (``--help`` for the flags; ``--only throughput|ttft``). Every
figure is compared with a baseline measured in the same run.

1. **Throughput.** One pool node process (``python -m cluster.pool``), the pool's metadata in
   a ``MetadataServer`` process (the Conductor's embedded store; Mooncake's master is a process
   apart too) and a ``PoolClient`` here, on loopback: put =
   ``PoolClient.put_many`` from a registered buffer (the checksums computed in the timed loop:
   they are part of our put), get = ``PoolClient.get`` into a registered buffer. Twice: with the
   transport the Messenger picks (shared memory on one host) and forced to TCP. Against
   Mooncake Store from the ``mooncake-transfer-engine-non-cuda`` wheel: ``mooncake_master``, one
   store process contributing its segment (``setup`` with P2PHANDSHAKE metadata, TCP) and a
   client here contributing none, ``put_from`` / ``get_into`` (``batch_put_from`` /
   ``batch_get_into``) on a registered buffer. Sizes: 64 KiB, 1 MiB and one layer of one pool
   object of the default model. Each size moves ``--mib`` MiB per run in sequential calls of
   one object, then of ``--batch`` objects (16: a prefix of 16 pool objects, as an instance
   loads and stores them), distinct keys per run, nothing evicted; the best of ``--repeat``
   runs after a short warm-up. Our put returns once the node has checked and sealed the object; its index entry
   follows asynchronously and is waited for, untimed, before the gets. Target: ours >=
   Mooncake Store on the same transport (TCP).
2. **TTFT.** The real server, ``python -m server --prefill-instances 2 --decode-instances 1
   --instance-threads 1``: a prompt of ``--prompt-tokens`` (4,096; at most the model's context)
   whose first ``--prefix-fraction`` (90%) was computed on one prefill instance (request 1:
   prefix + suffix A), then, with that instance SIGSTOPped until the Conductor marks it down,
   prefix + suffix B (``max_tokens`` 1, streamed) lands on the other one: it loads the prefix
   from the pool, or, in a second cluster started with ``--no-pool``, recomputes it. The pool
   cluster's instances contribute no DRAM (``--pool-dram-gib 0``) and one ``python -m
   cluster.pool`` node holds the pool: a segment inside the stopped instance would vanish with
   it (its lease expires), and Mooncake also keeps the store apart from compute. Target:
   recompute / pool >= 5x.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing as mp
import os
import queue
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.harness import DONE, ServerProcess, free_port, launch_server, sse_data, until
from bench.trace import MIN_TOKEN_ID
from bench.transfer import format_table
from cluster.protocol import MESSENGER, derive_key
from cluster.pool import PoolClient, PoolConfig, PoolGeometry
from cluster.pool.client import NewObject
from cluster.pool.index import OBJECTS
from cluster.metadata.embedded import HttpMetadata, MetadataServer
from cluster.pool.objects import part_checksums
from cluster.messenger import MessengerConfig, Messenger
from engine.config import EngineConfig
from engine.kv_layout import KVLayout

KiB, MiB = 1 << 10, 1 << 20
MB = 1e6  # throughput is printed in MB/s (10^6 bytes)
DEFAULT_OUT = Path("out") / "pool"

# The default model's KV geometry (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64), in the
# engine's page size and KV dtype on CPU, and the pool's default object of 256 tokens.
MODEL_LAYERS, MODEL_KV_HEADS, MODEL_HEAD_DIM = 30, 3, 64

def _stop_node(node: subprocess.Popen | None) -> None:
    """Stop a ``python -m cluster.pool`` node (SIGTERM: it leaves the pool and revokes its lease)."""
    if node is not None and node.poll() is None:
        node.terminate()
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:
            node.kill()



def pool_layer_bytes() -> int:
    """Bytes of K and V of one layer of one pool object of the default model (what an instance
    reads per layer while it loads a prefix: ``PoolGeometry.part_bytes``)."""
    engine = EngineConfig(device="cpu", threads=1)
    layout = KVLayout(MODEL_LAYERS, MODEL_KV_HEADS, engine.block_size, MODEL_HEAD_DIM, engine.kv_cache_dtype)
    geometry = PoolGeometry(layout, PoolConfig().block_tokens // engine.block_size, "SmolLM2-135M")
    return geometry.part_bytes


def size_name(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes % MiB == 0 else f"{nbytes / KiB:g} KiB"


# ----- throughput: measurement ---------------------------------------------------------------


@dataclass
class Rates:
    """Best seconds of a put run and of a get run of ``n`` objects of ``size`` bytes."""

    size: int
    n: int
    put_s: float
    get_s: float

    def mbps(self, op: str) -> float:
        return self.n * self.size / getattr(self, f"{op}_s") / MB

    def ops(self, op: str) -> float:
        return self.n / getattr(self, f"{op}_s")


def timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(put: Callable[[str, int], None], get: Callable[[str, int], None], size: int, n: int, repeat: int,
            published: Callable[[str, int], None] = lambda run, count: None, batch: int = 1) -> Rates:
    """Warm up (connections, page faults) on one object, then ``repeat`` runs of ``n`` puts of
    fresh keys followed by ``n`` gets of them. ``put(run, count)`` / ``get(run, count)`` move
    objects ``0..count-1`` of the buffer under the keys of ``run`` (``batch`` objects per call:
    it only names the runs apart); ``published(run, count)`` waits, untimed, until they are
    readable."""
    warm = f"{size}/{batch}/warm"
    put(warm, 1)
    published(warm, 1)
    get(warm, 1)
    best_put = best_get = math.inf
    for r in range(repeat):
        run = f"{size}/{batch}/{r}"
        best_put = min(best_put, timed(lambda: put(run, n)))
        published(run, n)
        best_get = min(best_get, timed(lambda: get(run, n)))
    return Rates(size, n, best_put, best_get)


def _groups(count: int, batch: int) -> list[range]:
    """Objects ``0..count-1`` in calls of ``batch``."""
    return [range(first, min(count, first + batch)) for first in range(0, count, batch)]


def _answer(reply, proc, timeout_s: float):
    """What a spawned ``proc`` puts on ``reply``; raises at once if it dies first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return reply.get(timeout=0.5)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{proc.name} exited with {proc.exitcode} before answering") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} did not answer within {timeout_s:g} s") from None


def _metadata_process(reply, stop, secret: str) -> None:
    server = MetadataServer(secret.encode())
    reply.put(server.url)
    stop.wait(3600)
    server.close()


class OurPool:
    """A pool node subprocess, its metadata served by a ``MetadataServer`` in a process of its
    own (as the Conductor serves it: apart from the readers, like Mooncake's master), and
    clients of it in this process."""

    def __init__(self, node_bytes: int, log_dir: Path) -> None:
        self.secret = secrets.token_hex(16)
        self._engines: list[Messenger] = []
        self._metadata: list[HttpMetadata] = []
        self.node: subprocess.Popen | None = None
        ctx = mp.get_context("spawn")
        reply, self._stop = ctx.Queue(), ctx.Event()
        self._server = ctx.Process(target=_metadata_process, args=(reply, self._stop, self.secret), daemon=True)
        self._server.start()
        try:
            self.metadata_url = _answer(reply, self._server, 120)
            self.log_path = log_dir / "pool-node.log"
            with open(self.log_path, "wb") as log:
                self.node = subprocess.Popen(
                    [sys.executable, "-m", "cluster.pool", "--metadata", self.metadata_url,
                     "--dram-gib", f"{node_bytes / (1 << 30):.4f}", "--log-level", "warning"],
                    env={**os.environ, "MOONCAKE_CLUSTER_SECRET": self.secret}, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=log, text=True)
            # The node prints one line once its segment is registered; never wait on it forever.
            timer = threading.Timer(120, self.node.kill)
            timer.start()
            try:
                line = self.node.stdout.readline()
            finally:
                timer.cancel()
            if not line.startswith("pool node ready"):
                raise RuntimeError(f"pool node did not start: {self.log_path.read_text(errors='replace')[-2000:]}")
        except BaseException:
            self.close()
            raise

    def client(self, transport: str) -> tuple[PoolClient, Messenger]:
        engine = Messenger(MessengerConfig(secret=derive_key(self.secret.encode(), MESSENGER), transport=transport))
        metadata = HttpMetadata(self.metadata_url, self.secret.encode())
        self._engines.append(engine)
        self._metadata.append(metadata)
        client = PoolClient(engine, metadata)
        if not client.segments(refresh=True):
            raise RuntimeError("the pool node's segment is not in the metadata")
        return client, engine

    def objects(self) -> int:
        """Objects published in the pool's index (the segments' own stats lag by a heartbeat)."""
        metadata = HttpMetadata(self.metadata_url, self.secret.encode())
        try:
            return len(metadata.get_prefix(OBJECTS))
        finally:
            metadata.close()

    def close(self) -> None:
        for engine in self._engines:
            engine.close()
        for metadata in self._metadata:
            metadata.close()
        _stop_node(self.node)
        self._stop.set()
        self._server.join(30)
        if self._server.is_alive():
            self._server.kill()


class OurClient:
    """A ``PoolClient`` on its own transfer engine (forced to ``transport`` or "auto"), with a
    registered source and destination buffer of ``total`` bytes."""

    def __init__(self, pool: OurPool, transport: str, total: int) -> None:
        self.prefix = f"bench-{transport}"
        self.client, engine = pool.client(transport)
        # Shared memory, like an instance's pool staging (``StagingArea``).
        self.src, self.dst = engine.alloc_shared(total), engine.alloc_shared(total)
        self.src.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
        self.src_h, self.dst_h = engine.register(self.src), engine.register(self.dst)
        self.src_mem, self.dst_mem = memoryview(self.src.numpy()), memoryview(self.dst.numpy())
        segment = next(iter(self.client.segments().values()))
        self.transport = engine.transport_for(segment.address, [segment.handle])

    def run(self, size: int, repeat: int, batch: int = 1) -> Rates:
        client, prefix = self.client, self.prefix
        n = len(self.src) // size

        def put(run: str, count: int) -> None:
            for idx in _groups(count, batch):
                objects = [NewObject(f"{prefix}/{run}/{i}", i * size, size, size) for i in idx]
                sums = [part_checksums(self.src_mem[i * size : (i + 1) * size], size) for i in idx]
                if None in client.put_many(self.src_h, objects, sums):
                    raise RuntimeError(f"pool put of {size} bytes refused")

        def get(run: str, count: int) -> None:
            for idx in _groups(count, batch):
                keys = [f"{prefix}/{run}/{i}" for i in idx]
                if client.get(keys, self.dst_h, [i * size for i in idx], self.dst_mem) != len(keys):
                    raise RuntimeError(f"pool get of {keys[0]}.. found less than {len(keys)} objects")

        def published(run: str, count: int) -> None:
            last = f"{prefix}/{run}/{count - 1}"
            deadline = time.monotonic() + 30
            while not client.replicas(last):  # the node publishes in order: the last implies all
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{last} never appeared in the pool's metadata")
                time.sleep(0.002)

        self.dst.zero_()
        rates = measure(put, get, size, n, repeat, published, batch)
        if not torch.equal(self.src[: n * size], self.dst[: n * size]):
            raise RuntimeError(f"pool get of {size}-byte objects returned other bytes")
        return rates


# ----- throughput: Mooncake Store -------------------------------------------------------------


def mooncake_unavailable() -> str | None:
    """None when Mooncake Store can run here, else why not (one line)."""
    try:
        mooncake = importlib.import_module("mooncake")
        importlib.import_module("mooncake.store")  # the wheel also needs Debian's libibverbs1
    except ImportError as exc:
        return (f"mooncake-transfer-engine-non-cuda unavailable ({exc}; pip install -e '.[mooncake]', "
                "apt-get install libibverbs1)")
    if not (Path(mooncake.__file__).parent / "mooncake_master").exists():
        return "the mooncake wheel has no mooncake_master binary"
    return None


def _mooncake_node(reply, stop, master: str, segment_bytes: int, log_path: str) -> None:
    # Mooncake logs through glog to stderr: keep it in a file.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    reply.put(store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, 16 * MiB, "tcp", "", master))
    stop.wait(3600)
    store.close()


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"mooncake_master not listening on {port} after {timeout_s:g} s")


class MooncakeStore:
    """``mooncake_master``, a store process contributing ``segment_bytes``, a client here."""

    def __init__(self, segment_bytes: int, log_dir: Path) -> None:
        import mooncake
        from mooncake.store import MooncakeDistributedStore

        port = free_port()
        with open(log_dir / "mooncake-master.log", "wb") as log:
            self.master = subprocess.Popen(
                [str(Path(mooncake.__file__).parent / "mooncake_master"), f"--rpc_port={port}",
                 f"--metrics_port={free_port()}", "--enable_metric_reporting=false"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.node = None
        self.stop = None
        self.store = None
        try:
            # A client whose master is not up yet retries for a minute and a half: wait for it.
            _wait_port(port, self.master, 30)
            ctx = mp.get_context("spawn")
            reply, self.stop = ctx.Queue(), ctx.Event()
            self.node = ctx.Process(target=_mooncake_node, daemon=True,
                                    args=(reply, self.stop, f"127.0.0.1:{port}", segment_bytes,
                                          str(log_dir / "mooncake-node.log")))
            self.node.start()
            rc = _answer(reply, self.node, 180)
            if rc != 0:
                raise RuntimeError(f"Mooncake store node setup failed (rc={rc})")
            self.store = MooncakeDistributedStore()
            # This client contributes no segment, so every object lives in the node's memory.
            rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", f"127.0.0.1:{port}")
            if rc != 0:
                raise RuntimeError(f"Mooncake store client setup failed (rc={rc})")
        except BaseException:
            self.close()
            raise

    def register(self, total: int) -> None:
        self.src = torch.randint(0, 256, (total,), dtype=torch.uint8)
        self.dst = torch.zeros(total, dtype=torch.uint8)
        for buf in (self.src, self.dst):
            if self.store.register_buffer(buf.data_ptr(), total) != 0:
                raise RuntimeError("Mooncake could not register a buffer")

    def run(self, size: int, repeat: int, batch: int = 1) -> Rates:
        store, src, dst = self.store, self.src.data_ptr(), self.dst.data_ptr()
        n = len(self.src) // size

        def put(run: str, count: int) -> None:
            for idx in _groups(count, batch):
                keys = [f"bench/{run}/{i}" for i in idx]
                if batch == 1:  # the single-object call itself, not a batch of one
                    rcs = [store.put_from(keys[0], src + idx[0] * size, size)]
                else:
                    rcs = store.batch_put_from(keys, [src + i * size for i in idx], [size] * len(idx))
                if any(rc != 0 for rc in rcs):
                    raise RuntimeError(f"Mooncake put of {size}-byte objects failed (rc={rcs})")

        def get(run: str, count: int) -> None:
            for idx in _groups(count, batch):
                keys = [f"bench/{run}/{i}" for i in idx]
                if batch == 1:
                    got = [store.get_into(keys[0], dst + idx[0] * size, size)]
                else:
                    got = store.batch_get_into(keys, [dst + i * size for i in idx], [size] * len(idx))
                if any(g != size for g in got):
                    raise RuntimeError(f"Mooncake get of {size}-byte objects returned {got}")

        self.dst.zero_()
        rates = measure(put, get, size, n, repeat, batch=batch)
        if not torch.equal(self.src[: n * size], self.dst[: n * size]):
            raise RuntimeError(f"Mooncake get of {size}-byte objects returned other bytes")
        return rates

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.stop is not None:
            self.stop.set()
        if self.node is not None:
            self.node.join(30)
            if self.node.is_alive():
                self.node.kill()
        self.master.terminate()
        try:
            self.master.wait(30)
        except subprocess.TimeoutExpired:
            self.master.kill()


# ----- throughput: report ---------------------------------------------------------------------

OURS_AUTO, OURS_TCP, MOONCAKE = ("ours", "auto"), ("ours", "tcp"), ("mooncake store", "tcp")


def throughput_report(results: dict[tuple[str, str], dict[int, Rates]], sizes: list[int],
                      mooncake_note: str | None, shm_transport: str, held: int | None = None) -> str:
    rows = []
    for (system, transport), per_size in results.items():
        shown = shm_transport if transport == "auto" else transport
        for size in sizes:
            r = per_size[size]
            rows.append([system, shown, size_name(size), f"{r.mbps('put'):.1f}", f"{r.ops('put'):.0f}",
                         f"{r.mbps('get'):.1f}", f"{r.ops('get'):.0f}"])
    if mooncake_note:  # no silent fallback: the baseline's row says why it is missing
        rows.append(["mooncake store", "tcp", "-", "n/a", "n/a", "n/a", "n/a"])
    lines = [format_table(["system", "transport", "size", "put MB/s", "put ops/s", "get MB/s", "get ops/s"], rows)]
    if held is not None:  # a put's cost on our node grows with what it holds (bench/README.md)
        lines.append(f"(our pool node held {held} objects after the runs)")
    if mooncake_note:
        lines.append(f"mooncake store: {mooncake_note}")
        lines.append("Target ours >= Mooncake Store (same transport): not checked, no Mooncake figures")
        return "\n".join(lines)
    ratio_rows, missed = [], []
    for size in sizes:
        theirs = results[MOONCAKE][size]
        row = [size_name(size)]
        for key in (OURS_TCP, OURS_AUTO):
            for op in ("put", "get"):
                ratio = results[key][size].mbps(op) / theirs.mbps(op)
                row.append(f"{ratio:.2f}x")
                if key == OURS_TCP and ratio < 1:
                    missed.append(f"{op} {size_name(size)}")
        ratio_rows.append(row)
    lines.append("")
    lines.append("ours / mooncake store (MB/s):")
    lines.append(format_table(["size", "tcp put", "tcp get", f"{shm_transport} put", f"{shm_transport} get"],
                              ratio_rows))
    verdict = "MET" if not missed else "MISSED at " + ", ".join(missed)
    lines.append(f"Target ours >= Mooncake Store on the same transport (tcp): {verdict}")
    return "\n".join(lines)


def run_throughput(sizes: list[int], total: int, repeat: int, log_dir: Path, with_mooncake: bool = True,
                   batches: tuple[int, ...] = (1, 16)) -> str:
    # Room for the warm-up and every timed run of both our clients, below the eviction watermark.
    stored = 2 * (repeat * total + max(sizes)) * len(sizes) * len(batches)
    pool = OurPool(int(stored / 0.85) + 64 * MiB, log_dir)
    note = mooncake_unavailable() if with_mooncake else "not run (--no-mooncake)"
    mooncake: MooncakeStore | None = None
    results: dict[int, dict[tuple[str, str], dict[int, Rates]]] = {b: {OURS_AUTO: {}, OURS_TCP: {}} for b in batches}
    try:
        clients = {OURS_AUTO: OurClient(pool, "auto", total), OURS_TCP: OurClient(pool, "tcp", total)}
        if note is None:
            try:
                mooncake = MooncakeStore(int(stored / 2 / 0.85) + 64 * MiB, log_dir)
                mooncake.register(total)
            except Exception as exc:  # noqa: BLE001 -- reported in the table; ours still run
                note = f"could not start ({exc})"
                if mooncake is not None:
                    mooncake.close()
                    mooncake = None
        # One size at a time for every system, so a burst of load from elsewhere on a shared
        # host skews them alike.
        for batch in batches:
            for size in sizes:
                for key, client in clients.items():
                    results[batch][key][size] = client.run(size, repeat, batch)
                if mooncake is not None:
                    try:
                        results[batch].setdefault(MOONCAKE, {})[size] = mooncake.run(size, repeat, batch)
                    except Exception as exc:  # noqa: BLE001
                        note = f"failed during the run ({exc})"
                        mooncake.close()
                        mooncake = None
        if note is not None:  # no partial baseline: the report says why it is missing
            for per_batch in results.values():
                per_batch.pop(MOONCAKE, None)
        held = pool.objects()
    finally:
        if mooncake is not None:
            mooncake.close()
        pool.close()
    reports = []
    for batch in batches:
        calls = "one object per call" if batch == 1 else f"{batch} objects per call (put_many / get of {batch} keys; " \
            f"Mooncake's batch_put_from / batch_get_into)"
        reports.append(f"{calls}:\n" + throughput_report(results[batch], sizes, note, clients[OURS_AUTO].transport,
                                                           held if batch == batches[-1] else None))
    return "\n\n".join(reports)


# ----- TTFT: a prefix computed on the other prefill instance ----------------------------------


@dataclass
class TtftRound:
    first_s: float  # request 1 (prefix + suffix A), computed from scratch on the holder
    second_s: float  # request 2 (prefix + suffix B) on the other prefill instance
    pool_hits: int | None  # pool objects the other instance loaded (None: no pool)
    local_s: float | None = None  # prefix + suffix C with the prefix in the instance's own cache


@dataclass
class TtftResult:
    cluster: str
    rounds: list[TtftRound]
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return statistics.median(r.second_s for r in self.rounds)


def random_tokens(n: int, seed: int, vocab_size: int = 32000) -> list[int]:
    return np.random.default_rng([seed, 31]).integers(MIN_TOKEN_ID, vocab_size, size=n).tolist()


def first_token_s(base_url: str, model: str, prompt: list[int], timeout_s: float = 900.0) -> float:
    """Seconds from sending a streamed completion (``max_tokens`` 1) to its first token."""
    payload = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=payload, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}")
        for line in resp.iter_lines():
            if (data := sse_data(line)) is not None and data != DONE:
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"request failed: {chunk['error']}")
                if chunk.get("choices"):
                    return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def _prefills(stats: dict | None) -> list[dict]:
    return [i for i in (stats or {}).get("instances", []) if i.get("role") == "prefill"]


def _pool_hits(stats: dict | None) -> int:
    return ((stats or {}).get("pool") or {}).get("hits", 0)


class Cluster:
    """``python -m server`` with 2 prefill + 1 decode instances (and, with the pool, one pool
    node holding all of the pool's DRAM)."""

    def __init__(self, name: str, pool: bool, log_dir: Path, startup_s: float) -> None:
        self.name, self.pool = name, pool
        secret = secrets.token_hex(16)
        flags = ["--prefill-instances", "2", "--decode-instances", "1", "--instance-threads", "1"]
        flags += ["--pool-dram-gib", "0"] if pool else ["--no-pool"]
        # The server takes the secret from its environment (never a command line), and the pool
        # node needs the same one.
        self.server: ServerProcess = launch_server(flags, log_dir / f"server-{name}.log", name=name,
                                                   env={"MOONCAKE_CLUSTER_SECRET": secret})
        self.base_url = self.server.base_url
        self.node: subprocess.Popen | None = None
        try:
            if pool:
                url = until(self._metadata_url, 120, "the Conductor's pool metadata URL")
                with open(log_dir / f"pool-node-{name}.log", "wb") as log:
                    self.node = subprocess.Popen(
                        [sys.executable, "-m", "cluster.pool", "--metadata", url, "--dram-gib", "1"],
                        env={**os.environ, "MOONCAKE_CLUSTER_SECRET": secret}, stdin=subprocess.DEVNULL,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.server.wait_healthy(startup_s)
            models = httpx.get(f"{self.base_url}/v1/models", timeout=10).json()["data"][0]
            self.model, self.max_model_len = models["id"], int(models.get("max_model_len", 2048))
            if pool:
                until(lambda: (self.server.stats() or {}).get("pool", {}).get("segments"), 60,
                      "the pool node's segment")
        except BaseException:
            self.close()
            raise

    def _metadata_url(self) -> str | None:
        if self.server.proc.poll() is not None:
            raise RuntimeError(f"server exited: {self.server.log_tail()}")
        found = re.search(r"KVCache pool metadata at (http://\S+)", self.server.log_tail(100_000))
        return found.group(1) if found else None

    def _both_prefills_up(self) -> None:
        until(lambda: [i["up"] for i in _prefills(self.server.stats())] == [True, True], 120,
              "both prefill instances up")

    def round(self, prefix: list[int], suffixes: list[list[int]], block_tokens: int) -> TtftRound:
        """Request 1 (prefix + ``suffixes[0]``), its holder stopped, request 2 (prefix +
        ``suffixes[1]``) on the other instance; with the pool, then the reference: prefix +
        ``suffixes[2]`` once both are back, a hit in the local prefix cache of either."""
        suffix_a, suffix_b, suffix_c = suffixes
        self._both_prefills_up()
        stats = self.server.stats() or {}
        before = {i["pid"]: i["cached_blocks"] for i in _prefills(stats)}
        prefix_blocks = len(prefix) // stats.get("block_size", 16)  # engine blocks, not pool objects
        first = first_token_s(self.base_url, self.model, prefix + suffix_a)

        def holder() -> dict | None:  # the instance whose prefix cache took request 1's blocks
            grown = [i for i in _prefills(self.server.stats())
                     if i["cached_blocks"] - before.get(i["pid"], 0) >= prefix_blocks]
            return grown[0] if len(grown) == 1 else None

        held = until(holder, 30, "the prefill instance holding request 1")
        if self.pool:  # request 1's pool blocks are stored in the background after its prefill
            blocks = (len(prefix) + len(suffix_a)) // block_tokens
            until(lambda: (self.server.stats() or {}).get("pool", {}).get("objects", 0) >= blocks, 120,
                  f"{blocks} pool objects stored")
        os.kill(held["pid"], signal.SIGSTOP)  # so the Conductor places request 2 on the other one
        try:
            until(lambda: not next(i["up"] for i in _prefills(self.server.stats()) if i["pid"] == held["pid"]), 60,
                  "the stopped instance marked down")
            hits = _pool_hits(self.server.stats())
            second = first_token_s(self.base_url, self.model, prefix + suffix_b)
            loaded = None
            if self.pool:  # the reader's counters reach the Conductor with its next poll
                time.sleep(1.0)
                loaded = _pool_hits(self.server.stats()) - hits
        finally:
            os.kill(held["pid"], signal.SIGCONT)
        local = None
        if self.pool:  # what the suffix alone costs: the pool load's share of TTFT is the rest
            self._both_prefills_up()
            local = first_token_s(self.base_url, self.model, prefix + suffix_c)
        return TtftRound(first, second, loaded, local)

    def close(self) -> None:
        _stop_node(self.node)
        self.server.stop()


def run_ttft(prompt_tokens: int, prefix_fraction: float, rounds: int, log_dir: Path,
             startup_s: float = 900.0) -> str:
    block_tokens = PoolConfig().block_tokens  # the server's default --pool-block-tokens
    results: list[TtftResult] = []
    prompt_len = prefix_len = 0
    for name, pool in (("pool", True), ("no-pool", False)):
        result = TtftResult(name, [])
        results.append(result)
        cluster = None
        try:
            cluster = Cluster(name, pool, log_dir, startup_s)
            # The prompt and its one output token must fit the model's context.
            prompt_len = min(prompt_tokens, cluster.max_model_len - 1)
            prefix_len = int(prompt_len * prefix_fraction)
            for r in range(rounds):  # a fresh prefix each round: nothing cached from the last
                prefix = random_tokens(prefix_len, seed=4 * r)
                suffixes = [random_tokens(prompt_len - prefix_len, seed=4 * r + k) for k in (1, 2, 3)]
                result.rounds.append(cluster.round(prefix, suffixes, block_tokens))
        except Exception as exc:  # noqa: BLE001 -- the table says what failed; the other cluster still runs
            result.error = f"{type(exc).__name__}: {exc}"[:400]
        finally:
            if cluster is not None:
                cluster.close()
    return ttft_report(results, prompt_tokens, prompt_len, prefix_len, block_tokens)


def ttft_report(results: list[TtftResult], asked: int, prompt_len: int, prefix_len: int, block_tokens: int,
                engine_block: int = EngineConfig.block_size) -> str:
    lines = []
    if prompt_len and prompt_len < asked:
        lines.append(f"(the model's context fits {prompt_len} prompt tokens, not the {asked} asked for)")
    reusable = prefix_len // block_tokens
    share = prefix_len / max(1, prompt_len)
    lines.append(f"TTFT of a {prompt_len}-token prompt whose first {prefix_len} tokens ({share:.0%}) another "
                 f"prefill instance computed ({reusable} pool objects of {block_tokens} tokens):")
    rows = []
    for res in results:
        if res.error or not res.rounds:
            rows.append([res.cluster, "n/a", "n/a", "n/a", f"failed: {res.error}"])
            continue
        loaded = [r.pool_hits for r in res.rounds]
        source = "recomputed" if res.cluster == "no-pool" else f"pool objects loaded: {', '.join(map(str, loaded))}"
        rows.append([res.cluster, f"{res.ttft_s:.2f}", str(len(res.rounds)),
                     f"{statistics.median(r.first_s for r in res.rounds):.2f}", source])
    lines.append(format_table(["cluster", "TTFT (s)", "rounds", "request 1 TTFT (s)", "prefix"], rows))
    by_name = {r.cluster: r for r in results if r.rounds and not r.error}
    pool = by_name.get("pool")
    if pool and all(r.local_s is not None for r in pool.rounds):
        local = statistics.median(r.local_s for r in pool.rounds)
        # The prefix cache keeps whole engine blocks, the pool whole pool objects: a local hit
        # may reuse a few more tokens than the pool load did.
        cached, loaded = prefix_len // engine_block * engine_block, prefix_len // block_tokens * block_tokens
        lines.append(f"reference: the same prefix in the instance's own prefix cache: {local:.2f} s "
                     f"({cached} tokens reused, {prompt_len - cached} computed; the pool hit reused {loaded}, "
                     f"computed {prompt_len - loaded}: {pool.ttft_s - local:+.2f} s)")
    if "pool" in by_name and "no-pool" in by_name:
        ratio = by_name["no-pool"].ttft_s / by_name["pool"].ttft_s
        lines.append(f"recompute / pool = {ratio:.2f}x; target >= 5x: {'MET' if ratio >= 5 else 'MISSED'}")
    else:
        lines.append("recompute / pool: n/a (a cluster failed); target >= 5x: not checked")
    return "\n".join(lines)


# ----- command line ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small runs: 4 MiB per size, 1 run, a 1,024-token prompt (the tests use it)")
    parser.add_argument("--only", choices=("throughput", "ttft"), help="run one part only")
    parser.add_argument("--mib", type=float, default=None, help="MiB moved per size and run (64; --quick 4)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per figure, best kept (3; --quick 1)")
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake Store even if installed")
    parser.add_argument("--batch", type=int, default=16,
                        help="objects per call of the batched runs (16; 1: single-object calls only)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="TTFT prompt length (4096; --quick 1024)")
    parser.add_argument("--prefix-fraction", type=float, default=0.9, help="share of the prompt computed before (0.9)")
    parser.add_argument("--rounds", type=int, default=1, help="TTFT measurements per cluster, median kept (1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for the logs ({DEFAULT_OUT})")
    args = parser.parse_args(argv)
    mib = args.mib if args.mib is not None else (4 if args.quick else 64)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    prompt_tokens = args.prompt_tokens if args.prompt_tokens is not None else (1024 if args.quick else 4096)
    if mib <= 0 or repeat < 1 or args.rounds < 1 or prompt_tokens < 2 or args.batch < 1 \
            or not 0 < args.prefix_fraction < 1:
        parser.error("--mib, --repeat, --rounds, --batch and --prompt-tokens must be positive, "
                     "--prefix-fraction in (0, 1)")
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.out))
    print(f"{os.cpu_count()} CPUs, loopback; logs in {log_dir}", flush=True)
    if args.only in (None, "throughput"):
        sizes = [64 * KiB, MiB, pool_layer_bytes()]
        total = max(int(mib * MiB), max(sizes))
        print(f"\nPut / get throughput: {total / MiB:g} MiB per size and run, best of {repeat}; "
              f"one pool node process, the client in this process", flush=True)
        print(f"({size_name(sizes[2])} = one layer of one 256-token pool object of SmolLM2-135M)", flush=True)
        batches = (1,) if args.batch == 1 else (1, args.batch)
        print(run_throughput(sizes, total, repeat, log_dir, not args.no_mooncake, batches), flush=True)
    if args.only in (None, "ttft"):
        print("\nTTFT, python -m server --prefill-instances 2 --decode-instances 1 --instance-threads 1:", flush=True)
        print(run_ttft(prompt_tokens, args.prefix_fraction, args.rounds, log_dir), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
