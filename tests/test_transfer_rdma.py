"""The RDMA transport's logic against ``verbs_double`` (a TEST DOUBLE of the verbs subset it uses),
plus the one-line "no device" detection with the real pyverbs on this host.

Nothing here ran on an RDMA NIC: the double checks the order of queue-pair state changes, work
requests, keys, bounds and completions, not a real fabric.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
import verbs_double
from verbs_double import VERBS

from cluster.messenger import PeerError, RdmaUnavailable, RemoteAccessError, MessengerConfig, Messenger, TransferError
from cluster.messenger.wire import Status
from cluster.messenger.rdma import RdmaDevice

SECRET = b"rdma test double secret"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def fabric():
    yield verbs_double.reset()


def config(**overrides) -> MessengerConfig:
    return MessengerConfig(secret=SECRET, timeout_s=overrides.pop("timeout_s", 5.0), slice_bytes=overrides.pop("slice_bytes", 64 * 1024), **overrides)


@pytest.fixture
def pair():
    a = Messenger(config(), verbs=VERBS)
    b = Messenger(config(), verbs=VERBS)
    yield a, b
    a.close()
    b.close()


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def test_real_pyverbs_here_reports_a_missing_device_in_one_line():
    try:
        device = RdmaDevice.open(None, None, config())
    except RdmaUnavailable as exc:
        message = str(exc)
        assert message.startswith("RDMA unavailable: ") and "\n" not in message
    else:  # a host with an RDMA device
        device.close()


@pytest.mark.parametrize("list_fails", [False, True])
def test_no_device_is_detected_and_reported(list_fails):
    verbs_double.reset(devices=(), list_fails=list_fails)
    with pytest.raises(RdmaUnavailable, match="no RDMA device"):
        RdmaDevice.open(None, VERBS, config())
    with pytest.raises(RdmaUnavailable):
        Messenger(config(transport="rdma"), verbs=VERBS)
    with Messenger(config(), verbs=VERBS) as engine:  # auto: falls back, says why
        assert engine.rdma_status.startswith("RDMA unavailable: no RDMA device")
        assert "\n" not in engine.rdma_status


def test_unknown_device_name_is_reported():
    with pytest.raises(RdmaUnavailable, match="no device named mlx5_9"):
        RdmaDevice.open("mlx5_9", VERBS, config())


def test_queue_pairs_walk_reset_init_rtr_rts_and_refuse_early_posts():
    e = verbs_double.enums
    a = RdmaDevice.open(None, VERBS, config())
    b = RdmaDevice.open(None, VERBS, config())
    cq = VERBS.CQ(a.context, 16, None, None, 0)
    qp = a.create_qp(cq)
    wr = VERBS.SendWR(wr_id=1, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=VERBS.SGE(0, 1, 0), send_flags=e.IBV_SEND_SIGNALED)
    with pytest.raises(verbs_double.VerbsError):
        qp.post_send(wr)  # RESET: not connected yet
    remote = b.accept(a.endpoint(qp, 7))
    a.connect(qp, 7, remote)
    assert qp.history == [e.IBV_QPS_RESET, e.IBV_QPS_INIT, e.IBV_QPS_RTR, e.IBV_QPS_RTS]
    passive = verbs_double.FABRIC.qps[remote["qpn"]]
    assert passive.qp_state == e.IBV_QPS_RTS and passive.dest_qp_num == qp.qp_num
    with pytest.raises(verbs_double.VerbsError):
        a.connect(qp, 7, remote)  # RTS -> INIT is not a valid transition
    a.close()
    b.close()


@pytest.mark.parametrize("checksum", [False, True])
def test_write_and_read_scattered_slices_over_rdma(checksum):
    with Messenger(config(checksum=checksum), verbs=VERBS) as a, Messenger(config(checksum=checksum), verbs=VERBS) as b:
        n, piece = 8 * MiB, 64 * 1024
        src, dst, back = random_bytes(n, 1), torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        hs, hd, hb = a.register(src), b.register(dst), a.register(back)
        assert a.transport_for(b.address, [hd]) == "rdma"
        perm = np.random.default_rng(0).permutation(n // piece)
        a.write(b.address, [(hs, i * piece, hd, int(p) * piece, piece) for i, p in enumerate(perm)]).wait(30)
        expected = torch.empty_like(src)
        expected.view(-1, piece)[torch.from_numpy(perm)] = src.view(-1, piece)
        assert torch.equal(dst, expected)
        a.read(b.address, [(hb, 0, hd, 0, n)]).wait(30)  # one entry, cut into 128 slices over 2 QPs
        assert torch.equal(back, expected)
        link = a._links[b.address]
        assert set(link.transports) == {"rdma"}


def test_bounds_unknown_and_read_only_regions_are_refused(pair):
    a, b = pair
    src = a.register(torch.ones(MiB, dtype=torch.uint8))
    dst_tensor = torch.zeros(MiB, dtype=torch.uint8)
    dst = b.register(dst_tensor)
    forged = dataclasses.replace(dst, length=4 * MiB)
    with pytest.raises(RemoteAccessError) as err:
        a.write(b.address, [(src, 0, forged, MiB - 8, 4096)]).wait(10)
    assert err.value.status == Status.OUT_OF_BOUNDS
    with pytest.raises(RemoteAccessError) as err:
        a.read(b.address, [(src, 0, dataclasses.replace(dst, region_id=dst.region_id ^ 1), 0, 16)]).wait(10)
    assert err.value.status == Status.UNKNOWN_REGION
    constant = b.register(bytes(4096))  # read-only buffer: registered for remote reads only
    with pytest.raises(RemoteAccessError) as err:
        a.write(b.address, [(src, 0, constant, 0, 4096)]).wait(10)
    assert err.value.status == Status.READ_ONLY
    a.read(b.address, [(src, 0, constant, 0, 4096)]).wait(10)
    assert int(dst_tensor.sum()) == 0


def test_stale_remote_key_fails_the_batch_then_the_engine_reconnects(pair):
    a, b = pair
    data = random_bytes(MiB, 2)
    src = a.register(data)
    first = torch.zeros(MiB, dtype=torch.uint8)
    old = b.register(first)
    a.write(b.address, [(src, 0, old, 0, MiB)]).wait(10)  # caches the region's remote key
    b.unregister(old)  # its memory region is gone; the requester's cached key is now stale
    with pytest.raises(TransferError, match="work completion status 10"):  # IBV_WC_REM_ACCESS_ERR
        a.write(b.address, [(src, 0, old, 0, MiB)]).wait(10)
    first.zero_()
    assert int(first.sum()) == 0
    second = torch.zeros(MiB, dtype=torch.uint8)
    new = b.register(second)
    a.write(b.address, [(src, 0, new, 0, MiB)]).wait(10)  # a fresh transport, fresh queue pairs
    assert torch.equal(second, data)


def test_missing_completions_fail_the_batch_within_the_timeout(fabric):
    with Messenger(config(timeout_s=0.5), verbs=VERBS) as a, Messenger(config(timeout_s=0.5), verbs=VERBS) as b:
        src = a.register(torch.ones(MiB, dtype=torch.uint8))
        dst = b.register(torch.zeros(MiB, dtype=torch.uint8))
        a.write(b.address, [(src, 0, dst, 0, MiB)]).wait(10)
        fabric.stall = True
        start = time.monotonic()
        with pytest.raises(PeerError, match="no RDMA completion"):
            a.write(b.address, [(src, 0, dst, 0, MiB)]).wait(10)
        assert time.monotonic() - start < 3
