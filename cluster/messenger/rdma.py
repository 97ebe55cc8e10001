"""RDMA transport over pyverbs: RC queue pairs, memory regions, one-sided RDMA WRITE / READ.

Queue-pair details (number, PSN, LID, GID) are exchanged over the authenticated TCP control
stream; remote keys are handed out by the owner per region through EXPORT, so the owner decides
which regions a peer may reach and the NIC enforces each region's bounds through its key. Every
slice is one signaled work request; a poller thread turns completions into batch progress and a
batch fails on the first error completion, or when nothing completes within the timeout.

Only the subset of verbs in :class:`Verbs` is used, so tests can run the same logic against an
in-process stand-in (``tests/verbs_double.py``). No part of this file has run on an RDMA NIC yet.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .batch import Batch, Request, Slice
from .config import MessengerConfig
from .errors import PeerError, RdmaUnavailable, RemoteAccessError, TransferError, remote_error
from .wire import FLAG_CHECKSUM, FLAG_WRITE, MAX_SLICES_PER_MESSAGE, Op, Status, decode_json, encode_json
from .regions import LocalRegion
from .tcp import Stream

DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"  # where python3-pyverbs installs
PORT_NUM = 1
QP_DEPTH = 256  # outstanding work requests per queue pair (Mooncake's MC_MAX_WR)
QPS_PER_PEER = 2  # queue pairs per peer, slices spread over them (MC_NUM_QP_PER_EP)
POLL_BATCH = 32


@dataclass(frozen=True)
class Verbs:
    """The verbs API subset the transport uses: pyverbs classes, or a test double's."""

    get_device_list: Any
    Context: Any
    PD: Any
    CQ: Any
    MR: Any
    QP: Any
    QPCap: Any
    QPInitAttr: Any
    QPAttr: Any
    AHAttr: Any
    GlobalRoute: Any
    GID: Any
    SGE: Any
    SendWR: Any
    enums: Any
    Error: type[Exception]


def load_pyverbs() -> Verbs:
    """Import Debian's pyverbs (its dist-packages is on the path only for this import)."""
    added = DEBIAN_DIST_PACKAGES not in sys.path and os.path.isdir(DEBIAN_DIST_PACKAGES)
    if added:
        sys.path.append(DEBIAN_DIST_PACKAGES)
    # Importing pyverbs configures the root logger (handler and INFO level); the host
    # application's logging is not ours to change, so it is put back afterwards.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        import pyverbs.enums as enums
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, SendWR
    except ImportError as exc:
        raise RdmaUnavailable(f"RDMA unavailable: pyverbs does not import ({exc}); apt-get install python3-pyverbs") from exc
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        if added:
            sys.path.remove(DEBIAN_DIST_PACKAGES)
    return Verbs(get_device_list, Context, PD, CQ, MR, QP, QPCap, QPInitAttr, QPAttr, AHAttr, GlobalRoute, GID, SGE, SendWR, enums, PyverbsError)


def _device_name(device: Any) -> str:
    name = device.name
    return name.decode() if isinstance(name, bytes) else str(name)


class RdmaDevice:
    """One opened device: protection domain, memory regions of registered buffers, passive QPs."""

    def __init__(self, verbs: Verbs, name: str, config: MessengerConfig) -> None:
        self.verbs = verbs
        self.name = name
        self.gid_index = config.rdma_gid_index
        self.context = verbs.Context(name=name)
        self.pd = verbs.PD(self.context)
        self.lid = self.context.query_port(PORT_NUM).lid
        self.gid = str(self.context.query_gid(PORT_NUM, self.gid_index))
        # Peers' QPs on our side only receive one-sided operations and never complete anything,
        # but a QP needs a CQ all the same.
        self._passive_cq = verbs.CQ(self.context, QP_DEPTH, None, None, 0)
        self._passive: list[Any] = []
        self._mrs: dict[int, tuple[LocalRegion, Any]] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, name: str | None, verbs: Verbs | None, config: MessengerConfig) -> RdmaDevice:
        """Open ``name`` (or the first device); RdmaUnavailable says in one line why not."""
        verbs = verbs or load_pyverbs()
        try:
            devices = [_device_name(d) for d in verbs.get_device_list()]
        except verbs.Error as exc:
            raise RdmaUnavailable(f"RDMA unavailable: no RDMA device on this host ({exc})") from exc
        if not devices:
            raise RdmaUnavailable("RDMA unavailable: no RDMA device on this host")
        if name is not None and name not in devices:
            raise RdmaUnavailable(f"RDMA unavailable: no device named {name} (found {', '.join(devices)})")
        try:
            return cls(verbs, name or devices[0], config)
        except verbs.Error as exc:
            raise RdmaUnavailable(f"RDMA unavailable: cannot open {name or devices[0]} ({exc})") from exc

    def register(self, region: LocalRegion) -> None:
        e = self.verbs.enums
        access = e.IBV_ACCESS_REMOTE_READ
        if region.writable:
            access |= e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        try:
            mr = self.verbs.MR(self.pd, region.length, access, address=region.address)
        except self.verbs.Error as exc:
            raise TransferError(f"cannot register region with the RDMA device: {exc}") from exc
        with self._lock:
            self._mrs[region.region_id] = (region, mr)

    def deregister(self, region_id: int) -> None:
        with self._lock:
            entry = self._mrs.pop(region_id, None)
        if entry is not None:
            entry[1].close()

    def lkey(self, region_id: int) -> int:
        with self._lock:
            entry = self._mrs.get(region_id)
        if entry is None:
            raise TransferError(f"local region {region_id} is not registered with the RDMA device")
        return entry[1].lkey

    def export(self, region_id: int) -> tuple[Status, dict]:
        """Owner side: the address, remote key and extent a peer needs to reach one region."""
        with self._lock:
            entry = self._mrs.get(region_id)
        if entry is None:
            return Status.UNKNOWN_REGION, {}
        region, mr = entry
        return Status.OK, {"addr": region.address, "rkey": mr.rkey, "length": region.length, "writable": region.writable}

    def create_qp(self, cq: Any) -> Any:
        v = self.verbs
        cap = v.QPCap(max_send_wr=QP_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        return v.QP(self.pd, v.QPInitAttr(qp_type=v.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))

    def endpoint(self, qp: Any, psn: int) -> dict:
        return {"qpn": qp.qp_num, "psn": psn, "lid": self.lid, "gid": self.gid}

    def connect(self, qp: Any, psn: int, remote: dict) -> None:
        """RESET -> INIT -> RTR (aimed at the remote QP) -> RTS."""
        v, e = self.verbs, self.verbs.enums
        attr = v.QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        attr.port_num = PORT_NUM
        attr.pkey_index = 0
        qp.to_init(attr)
        attr = v.QPAttr()
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = int(remote["qpn"])
        attr.rq_psn = int(remote["psn"])
        attr.max_dest_rd_atomic = 16
        attr.min_rnr_timer = 12
        route = v.GlobalRoute(dgid=v.GID(str(remote["gid"])), sgid_index=self.gid_index)
        attr.ah_attr = v.AHAttr(dlid=int(remote["lid"]), port_num=PORT_NUM, is_global=1, grh=route)
        qp.to_rtr(attr)
        attr = v.QPAttr()
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.sq_psn = psn
        attr.max_rd_atomic = 16
        qp.to_rts(attr)

    def accept(self, remote: dict) -> dict:
        """Owner side of RDMA_CONNECT: a passive QP connected back to the requester's."""
        qp = self.create_qp(self._passive_cq)
        psn = secrets.randbits(24)
        self.connect(qp, psn, remote)
        with self._lock:
            self._passive.append(qp)
        return self.endpoint(qp, psn)

    def close(self) -> None:
        with self._lock:
            mrs, self._mrs = list(self._mrs.values()), {}
            passive, self._passive = self._passive, []
        for qp in passive:
            qp.close()
        for _, mr in mrs:
            mr.close()
        self._passive_cq.close()
        self.pd.close()
        self.context.close()


@dataclass
class _Job:
    batch: Batch
    op: Op
    requests: Sequence[Request]
    remaining: int = 0
    generation: int | None = None


class RdmaTransport:
    """Requesting side for one peer: QPs connected to the peer's passive QPs, a poller, a poster."""

    name = "rdma"

    def __init__(self, device: RdmaDevice, control: Stream, config: MessengerConfig) -> None:
        self._device = device
        self._control = control
        self._config = config
        v = device.verbs
        self._cq = v.CQ(device.context, QP_DEPTH * QPS_PER_PEER, None, None, 0)
        self._qps: list[Any] = []
        for _ in range(QPS_PER_PEER):
            qp = device.create_qp(self._cq)
            psn = secrets.randbits(24)
            status, _, body = control.call(Op.RDMA_CONNECT, encode_json(device.endpoint(qp, psn)))
            if status != Status.OK:
                raise remote_error(status, f"{control.name}: peer refused the RDMA connection")
            device.connect(qp, psn, decode_json(body))
            self._qps.append(qp)
        self._remote: dict[int, dict] = {}
        self._credits = [QP_DEPTH] * len(self._qps)
        self._inflight: dict[int, tuple[_Job, int]] = {}
        self._next_wr = 0
        self._cond = threading.Condition()
        self._error: TransferError | None = None
        self._closed = False
        self._work: queue.SimpleQueue[tuple[str, _Job] | None] = queue.SimpleQueue()
        self._poster = threading.Thread(target=self._post_loop, name=f"{control.name} rdma post", daemon=True)
        self._poller = threading.Thread(target=self._poll_loop, name=f"{control.name} rdma poll", daemon=True)
        self._poster.start()
        self._poller.start()

    @property
    def alive(self) -> bool:
        return self._error is None and self._control.alive

    def submit(self, batch: Batch, op: Op, requests: Sequence[Request], generation: int | None = None) -> None:
        batch.expect(1)
        self._work.put(("post", _Job(batch, op, requests, generation=generation)))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._work.put(None)
        self._poller.join(timeout=2)
        self._fail_all(PeerError(f"{self._control.name}: RDMA transport closed"))
        for qp in self._qps:
            qp.close()
        self._cq.close()

    # ----- posting --------------------------------------------------------------------------

    def _post_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            kind, job = item
            try:
                if kind == "post":
                    self._post(job)
                else:
                    self._verify(job)
                    job.batch.part_done()
            except TransferError as exc:
                job.batch.fail(exc)

    def _region(self, region_id: int) -> dict:
        info = self._remote.get(region_id)
        if info is None:
            status, _, body = self._control.call(Op.EXPORT, encode_json({"kind": "rdma", "region_id": region_id}))
            if status != Status.OK:
                raise remote_error(status, f"{self._control.name}: region {region_id}")
            info = self._remote[region_id] = decode_json(body)
        return info

    def _post(self, job: _Job) -> None:
        if self._error is not None:
            raise self._error
        e = self._device.verbs.enums
        work: list[tuple[int, int, int, int, int]] = []  # (local addr, length, lkey, remote addr, rkey)
        for r in job.requests:
            info = self._region(r.region_id)  # the owner's extent and key for this region
            if r.offset < 0 or r.offset + r.length > info["length"]:
                raise RemoteAccessError(f"{self._control.name}: access out of the region's bounds", Status.OUT_OF_BOUNDS)
            if job.op == Op.WRITE and not info["writable"]:
                raise RemoteAccessError(f"{self._control.name}: region is read-only", Status.READ_ONLY)
            lkey = self._device.lkey(r.local_region.region_id)
            base = r.local_region.address + r.local_offset
            for start in range(0, r.length, self._config.slice_bytes):
                n = min(self._config.slice_bytes, r.length - start)
                work.append((base + start, n, lkey, info["addr"] + r.offset + start, info["rkey"]))
        if not work:
            job.batch.part_done()
            return
        if job.generation is not None and job.op == Op.WRITE:
            self._admit(job)
        job.remaining = len(work)
        opcode = e.IBV_WR_RDMA_WRITE if job.op == Op.WRITE else e.IBV_WR_RDMA_READ
        for i, (laddr, n, lkey, raddr, rkey) in enumerate(work):
            lane = i % len(self._qps)
            with self._cond:
                while self._credits[lane] == 0 and self._error is None and not self._closed:
                    self._cond.wait(self._config.timeout_s)
                if self._error is not None or self._closed:
                    raise self._error or PeerError("RDMA transport closed")
                self._credits[lane] -= 1
                self._next_wr += 1
                wr_id = self._next_wr
                self._inflight[wr_id] = (job, lane)
            v = self._device.verbs
            wr = v.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=v.SGE(laddr, n, lkey), send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(rkey, raddr)
            try:
                self._qps[lane].post_send(wr)
            except v.Error as exc:
                with self._cond:
                    self._inflight.pop(wr_id, None)
                    self._credits[lane] += 1
                self._set_error(PeerError(f"{self._control.name}: post_send failed: {exc}"))
                raise self._error from exc

    def _admit(self, job: _Job) -> None:
        """A write into a guarded range goes out only once the owner has checked its generation
        (one-sided writes pass the owner's CPU by, as shared memory's copies do)."""
        for start in range(0, len(job.requests), MAX_SLICES_PER_MESSAGE):
            chunk = [Slice(r.local, r.region_id, r.offset) for r in job.requests[start : start + MAX_SLICES_PER_MESSAGE]]
            status, index, _ = self._control.call(Op.CHECK, slices=chunk, flags=FLAG_WRITE, generation=job.generation)
            if status != Status.OK:
                raise remote_error(status, f"{self._control.name}, entry at offset {chunk[index].offset}")

    def _verify(self, job: _Job) -> None:
        """Checksums for bytes that moved without the owner's CPU: the owner hashes its side."""
        slices = [s for r in job.requests for s in r.slices(self._config.slice_bytes)]
        for start in range(0, len(slices), MAX_SLICES_PER_MESSAGE):
            chunk = slices[start : start + MAX_SLICES_PER_MESSAGE]
            status, index, _ = self._control.call(Op.CHECK, slices=chunk, flags=FLAG_CHECKSUM)
            if status != Status.OK:
                raise remote_error(status, f"{self._control.name}, slice at offset {chunk[index].offset}")

    # ----- completions ----------------------------------------------------------------------

    def _poll_loop(self) -> None:
        e = self._device.verbs.enums
        last_progress = time.monotonic()
        while not self._closed:
            npolled, wcs = self._cq.poll(POLL_BATCH)
            if npolled == 0:
                if self._inflight and time.monotonic() - last_progress > self._config.timeout_s:
                    self._set_error(PeerError(f"{self._control.name}: no RDMA completion within {self._config.timeout_s}s"))
                time.sleep(0.0002)  # a Python busy-poll would starve the other threads on this core
                continue
            last_progress = time.monotonic()
            for wc in wcs[:npolled]:
                with self._cond:
                    job, lane = self._inflight.pop(wc.wr_id, (None, 0))
                    self._credits[lane] += 1
                    self._cond.notify_all()
                if job is None:
                    continue
                if wc.status != e.IBV_WC_SUCCESS:
                    self._remote.clear()  # keys may be stale (region unregistered): ask again next time
                    self._set_error(TransferError(f"{self._control.name}: RDMA {job.op.name} failed (work completion status {wc.status})"))
                    continue
                job.remaining -= 1
                if job.remaining == 0:
                    if self._config.checksum:
                        self._work.put(("verify", job))
                    else:
                        job.batch.part_done()

    def _set_error(self, error: TransferError) -> None:
        # A failed work request moves the QP to the error state; every later one would be
        # flushed, so the transport is done and the engine opens a new one on the next request.
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()
        self._fail_all(self._error)

    def _fail_all(self, error: TransferError) -> None:
        with self._cond:
            jobs = {id(job): job for job, _ in self._inflight.values()}
            self._inflight.clear()
        for job in jobs.values():
            job.batch.fail(error)

