"""Two processes on loopback: a peer engine (``python -m cluster.messenger``) and this one.

256 MiB of random bytes move as 64 KiB and 1 MiB entries in both directions over TCP and shared
memory; every byte is checked (the peer hashes its region, reads are compared here). Then the
failures: out-of-bounds and unknown handles, a wrong secret, a peer killed with SIGKILL or frozen
with SIGSTOP mid-transfer, and a peer that comes back. Every wait has a timeout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from cluster.messenger import (
    AuthenticationError,
    PeerError,
    RegionHandle,
    RemoteAccessError,
    MessengerConfig,
    Messenger,
    TransferError,
)
from cluster.messenger.__main__ import SECRET_ENV
from cluster.messenger.wire import Status

pytestmark = pytest.mark.processes  # starts real server / instance / peer processes

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
SIZE = 256 * MiB
SECRET = secrets.token_bytes(32)


class Peer:
    """A peer engine in its own process, serving one region; stdout/stderr read by threads."""

    def __init__(self, nbytes: int, *, shared: bool = True, port: int = 0, timeout_s: float = 5.0) -> None:
        env = {**os.environ, SECRET_ENV: SECRET.hex()}
        cmd = [sys.executable, "-m", "cluster.messenger", "--bytes", str(nbytes), "--port", str(port), "--timeout", str(timeout_s)]
        if shared:
            cmd.append("--shared")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()
        info = self._reply(60)
        self.address: str = info["address"]
        self.handle = RegionHandle.from_dict(info["handle"])

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line)

    def _reply(self, timeout: float) -> dict:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            self.kill()
            raise AssertionError(f"peer did not answer; stderr: {''.join(self.stderr)}") from None

    def digest(self) -> str:
        self.proc.stdin.write("digest\n")
        self.proc.stdin.flush()
        return self._reply(30)["digest"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.numpy())


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


@pytest.fixture(scope="module")
def peer():
    p = Peer(SIZE)
    yield p
    p.close()


@pytest.fixture(scope="module")
def data():
    return random_bytes(SIZE, 1), random_bytes(SIZE, 2)


def make_engine(**overrides) -> Messenger:
    return Messenger(MessengerConfig(secret=overrides.pop("secret", SECRET), timeout_s=overrides.pop("timeout_s", 5.0), **overrides))


def scattered(local, remote, piece: int, perm: np.ndarray) -> list:
    """Entry i moves local piece i to remote piece perm[i]: remote offsets are scattered."""
    return [(local, i * piece, remote, int(perm[i]) * piece, piece) for i in range(len(perm))]


def placed(src: torch.Tensor, piece: int, perm: np.ndarray) -> torch.Tensor:
    out = torch.empty_like(src)
    out.view(-1, piece)[torch.from_numpy(perm)] = src.view(-1, piece)
    return out


def gathered(src: torch.Tensor, piece: int, perm: np.ndarray) -> torch.Tensor:
    """What reading ``scattered`` entries produces: local piece i holds remote piece perm[i]."""
    return src.view(-1, piece)[torch.from_numpy(perm)].reshape(-1)


@pytest.mark.parametrize("transport,checksum", [("tcp", False), ("tcp", True), ("shm", False), ("shm", True)])
def test_256mib_each_way_every_byte(peer, data, transport, checksum):
    with make_engine(checksum=checksum, slice_bytes=64 * 1024) as engine:
        back = torch.zeros(SIZE, dtype=torch.uint8)
        mine_back = engine.register(back)
        for src, write_piece, read_piece in ((data[0], 64 * 1024, MiB), (data[1], MiB, 64 * 1024)):
            mine = engine.register(src)
            perm = np.random.default_rng(write_piece).permutation(SIZE // write_piece)
            assert engine.transport_for(peer.address, [peer.handle]) == "shm"  # same host, shared region
            engine.write(peer.address, scattered(mine, peer.handle, write_piece, perm), transport=transport).wait(60)
            expected = placed(src, write_piece, perm)
            assert peer.digest() == digest(expected)
            back.zero_()
            rperm = np.random.default_rng(read_piece).permutation(SIZE // read_piece)
            engine.read(peer.address, scattered(mine_back, peer.handle, read_piece, rperm), transport=transport).wait(60)
            assert torch.equal(back, gathered(expected, read_piece, rperm))
            engine.unregister(mine)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_out_of_bounds_and_unknown_handles_are_refused_untouched(peer, transport):
    with make_engine() as engine:
        src = torch.full((MiB,), 7, dtype=torch.uint8)
        mine = engine.register(src)
        before = peer.digest()
        forged = dataclasses.replace(peer.handle, length=SIZE * 2)
        with pytest.raises(RemoteAccessError) as err:
            engine.write(peer.address, [(mine, 0, forged, SIZE - 100, 4096)], transport=transport).wait(10)
        assert err.value.status == Status.OUT_OF_BOUNDS
        with pytest.raises(RemoteAccessError) as err:
            engine.read(peer.address, [(mine, 0, forged, SIZE, 1)], transport=transport).wait(10)
        assert err.value.status == Status.OUT_OF_BOUNDS
        unknown = dataclasses.replace(peer.handle, region_id=peer.handle.region_id ^ 1)
        with pytest.raises(RemoteAccessError) as err:
            engine.write(peer.address, [(mine, 0, unknown, 0, 4096)], transport=transport).wait(10)
        assert err.value.status == Status.UNKNOWN_REGION
        with pytest.raises(TransferError, match="local range"):
            engine.write(peer.address, [(mine, MiB - 10, peer.handle, 0, 4096)], transport=transport).wait(10)
        assert peer.digest() == before
        # One bad entry fails the whole batch (over TCP its good entries may have landed).
        with pytest.raises(RemoteAccessError):
            engine.write(peer.address, [(mine, 0, peer.handle, 0, 4096), (mine, 0, forged, SIZE, 4096)], transport=transport).wait(10)
        # The connection is still good after refusals.
        engine.write(peer.address, [(mine, 0, peer.handle, 0, 4096)], transport=transport).wait(10)


def test_wrong_secret_is_refused_and_logged(peer):
    with make_engine(secret=b"not the cluster secret") as intruder:
        mine = intruder.register(bytearray(4096))
        with pytest.raises(AuthenticationError):
            intruder.write(peer.address, [(mine, 0, peer.handle, 0, 4096)]).wait(10)
    deadline = time.monotonic() + 5
    while not any("refused peer" in line for line in peer.stderr) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("refused peer" in line for line in peer.stderr)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_peer_killed_mid_transfer_fails_pending_batches(peer, transport):
    victim = Peer(64 * MiB)
    with make_engine(timeout_s=3.0, slice_bytes=64 * 1024) as engine:
        src = engine.register(torch.ones(64 * MiB, dtype=torch.uint8))
        entries = [(src, i, victim.handle, i, 64 * 1024) for i in range(0, 64 * MiB, 64 * 1024)]
        engine.write(victim.address, entries, transport=transport).wait(30)  # connected and warm
        batches = [engine.write(victim.address, entries, transport=transport) for _ in range(48)]
        time.sleep(0.05)
        victim.kill()
        start = time.monotonic()
        outcomes = []
        for batch in batches:
            try:
                batch.wait(10)
                outcomes.append(None)
            except TransferError as exc:
                outcomes.append(exc)
        assert time.monotonic() - start < 8
        assert any(isinstance(o, PeerError) for o in outcomes)
        # Nothing hangs afterwards: the dead address fails fast, other peers are still served.
        with pytest.raises(PeerError):
            engine.write(victim.address, entries[:1], transport=transport).wait(10)
        engine.write(peer.address, [(src, 0, peer.handle, 0, MiB)], transport=transport).wait(10)


def test_frozen_peer_fails_batches_within_the_timeout():
    frozen = Peer(64 * MiB, shared=False)
    try:
        with make_engine(timeout_s=1.0) as engine:
            src = engine.register(torch.ones(64 * MiB, dtype=torch.uint8))
            entries = [(src, 0, frozen.handle, 0, 64 * MiB)]
            engine.write(frozen.address, entries).wait(30)
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            start = time.monotonic()
            batches = [engine.write(frozen.address, entries) for _ in range(4)]
            for batch in batches:
                with pytest.raises(PeerError):
                    batch.wait(10)
            assert time.monotonic() - start < 6
    finally:
        frozen.kill()


def test_reconnects_to_a_restarted_peer():
    first = Peer(MiB, shared=False)
    port = int(first.address.rsplit(":", 1)[1])
    with make_engine() as engine:
        data = random_bytes(MiB, 3)
        src = engine.register(data)
        engine.write(first.address, [(src, 0, first.handle, 0, MiB)]).wait(10)
        first.close()
        with pytest.raises(PeerError):
            engine.write(first.address, [(src, 0, first.handle, 0, MiB)]).wait(10)
        second = Peer(MiB, shared=False, port=port)
        try:
            assert second.address == first.address
            engine.write(second.address, [(src, 0, second.handle, 0, MiB)]).wait(10)
            assert second.digest() == digest(data)
            # The old handle names a region of an engine that is gone.
            with pytest.raises(TransferError, match="belongs to engine"):
                engine.write(second.address, [(src, 0, first.handle, 0, MiB)]).wait(10)
        finally:
            second.close()


def _peer_maps() -> int:
    """Mappings of other processes' transfer memory in this one (ours are in it too: count all)."""
    with open("/proc/self/maps") as f:
        return sum("memfd:mooncake-py-transfer" in line for line in f)


def test_a_dead_peers_memory_is_unmapped_and_its_link_forgotten():
    """Issue 31: a survivor kept every dead peer's shared memory mapped (1 GiB per restart of a
    decode instance). Now the link closes when the peer dies: its windows are unmapped, its copy
    thread ends, and the address is forgotten; a peer restarted there is reached afresh."""
    addresses = []
    with make_engine(timeout_s=3.0) as engine:
        src = engine.register(torch.ones(MiB, dtype=torch.uint8))
        baseline = _peer_maps()
        for _ in range(3):
            victim = Peer(16 * MiB)
            addresses.append(victim.address)
            try:
                engine.write(victim.address, [(src, 0, victim.handle, i * MiB, MiB) for i in range(16)],
                             transport="shm").wait(30)
                assert _peer_maps() == baseline + 1 and victim.address in engine._links
            finally:
                victim.kill()
            deadline = time.monotonic() + 10
            while (_peer_maps() > baseline or victim.address in engine._links) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _peer_maps() == baseline, "the dead peer's memory is still mapped"
            assert victim.address not in engine._links
        # The links' threads (control send / receive, shm copy) end just after their last act.
        deadline = time.monotonic() + 5
        while (left := [t.name for t in threading.enumerate() if any(a in t.name for a in addresses)]) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"threads outlived their links: {left}"
