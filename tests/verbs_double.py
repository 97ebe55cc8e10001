"""TEST DOUBLE: an in-process stand-in for the subset of pyverbs the RDMA transport uses.

Not RDMA and not a simulator of a NIC's timing: it imitates the verbs *semantics* the transport
relies on, so the transport's logic can be tested on machines without an RDMA device:

- devices: ``get_device_list`` returns the fabric's devices (or fails, like rdma-core without any);
- RC queue pairs: RESET -> INIT -> RTR -> RTS in that order only; ``post_send`` outside RTS
  raises; a full send queue raises; a QP whose work request failed goes to ERR and flushes
  every later one with ``IBV_WC_WR_FLUSH_ERR``;
- memory regions: a key per registration; RDMA WRITE/READ check the local key and range, the
  remote key, range and access flags, and the remote QP being connected back to the sender;
  a violation completes with ``IBV_WC_REM_ACCESS_ERR`` (or ``IBV_WC_LOC_PROT_ERR``) and
  touches no memory; a permitted one copies the bytes (``memmove`` stands in for the DMA);
- completions: signaled work requests complete on the QP's send CQ, polled with ``poll(n)``.

Enum values are rdma-core's. ``VERBS`` plugs the double into ``Messenger(..., verbs=VERBS)``.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from types import SimpleNamespace

from cluster.messenger.rdma import Verbs

enums = SimpleNamespace(
    IBV_QPT_RC=2,
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_ACCESS_REMOTE_READ=4,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_READ=4,
    IBV_SEND_SIGNALED=2,
    IBV_WC_SUCCESS=0,
    IBV_WC_LOC_PROT_ERR=4,
    IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_ACCESS_ERR=10,
    IBV_QPS_RESET=0,
    IBV_QPS_INIT=1,
    IBV_QPS_RTR=2,
    IBV_QPS_RTS=3,
    IBV_QPS_ERR=6,
    IBV_MTU_1024=3,
)


class VerbsError(Exception):
    """Stands in for pyverbs' PyverbsError."""


class Fabric:
    """Everything the double's devices share: queue pairs by number, memory regions by key."""

    def __init__(self, devices: tuple[str, ...] = ("double0",), list_fails: bool = False) -> None:
        self.devices = devices
        self.list_fails = list_fails
        self.stall = False  # accept work requests but never complete them (a hung peer)
        self.qps: dict[int, QP] = {}
        self.mrs: dict[int, MR] = {}  # by lkey and by rkey (distinct numbers)
        self.lock = threading.Lock()
        self._numbers = itertools.count(0x100)

    def number(self) -> int:
        return next(self._numbers)


FABRIC = Fabric()


def reset(devices: tuple[str, ...] = ("double0",), list_fails: bool = False) -> Fabric:
    global FABRIC
    FABRIC = Fabric(devices, list_fails)
    return FABRIC


def get_device_list() -> list:
    if FABRIC.list_fails:
        raise VerbsError("Failed to get devices list")
    return [SimpleNamespace(name=name.encode()) for name in FABRIC.devices]


class GID:
    def __init__(self, val: str) -> None:
        self.gid = val

    def __str__(self) -> str:
        return self.gid


class Context:
    def __init__(self, name: str) -> None:
        if name not in FABRIC.devices:
            raise VerbsError(f"device {name} not found")
        self.name = name
        self._lid = FABRIC.number()

    def query_port(self, port_num: int) -> SimpleNamespace:
        if port_num != 1:
            raise VerbsError(f"no port {port_num}")
        return SimpleNamespace(lid=self._lid)

    def query_gid(self, port_num: int, index: int) -> GID:
        return GID(f"fe80:0000:0000:0000:0000:0000:0000:{self._lid:04x}")

    def close(self) -> None:
        pass


class PD:
    def __init__(self, context: Context) -> None:
        self.context = context

    def close(self) -> None:
        pass


class CQ:
    def __init__(self, context: Context, cqe: int, cq_context: object, channel: object, comp_vector: int) -> None:
        self.entries: deque[SimpleNamespace] = deque()
        self.capacity = cqe

    def push(self, wc: SimpleNamespace) -> None:
        if len(self.entries) >= self.capacity:
            raise VerbsError("CQ overrun")
        self.entries.append(wc)

    def poll(self, num_entries: int = 1) -> tuple[int, list]:
        out = []
        while self.entries and len(out) < num_entries:
            wc = self.entries.popleft()
            with FABRIC.lock:
                qp = FABRIC.qps.get(wc.qp_num)
                if qp is not None:
                    qp.outstanding -= 1  # the send-queue slot frees when its completion is polled
            out.append(wc)
        return len(out), out

    def close(self) -> None:
        pass


class MR:
    def __init__(self, pd: PD, length: int, access: int, address: int | None = None) -> None:
        if address is None:
            raise VerbsError("this double registers existing memory only")
        self.pd, self.length, self.access, self.address = pd, length, access, address
        self.lkey = FABRIC.number()
        self.rkey = FABRIC.number()
        with FABRIC.lock:
            FABRIC.mrs[self.lkey] = self
            FABRIC.mrs[self.rkey] = self

    def covers(self, addr: int, length: int) -> bool:
        return self.address <= addr and addr + length <= self.address + self.length

    def close(self) -> None:
        with FABRIC.lock:
            FABRIC.mrs.pop(self.lkey, None)
            FABRIC.mrs.pop(self.rkey, None)


class QPCap:
    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 1, max_send_sge: int = 1, max_recv_sge: int = 1) -> None:
        self.max_send_wr = max_send_wr


class QPInitAttr:
    def __init__(self, qp_type: int, scq: CQ, rcq: CQ, cap: QPCap) -> None:
        self.qp_type, self.scq, self.rcq, self.cap = qp_type, scq, rcq, cap


class QPAttr:
    def __init__(self) -> None:
        self.qp_access_flags = 0
        self.port_num = 0
        self.pkey_index = 0
        self.path_mtu = 0
        self.dest_qp_num = None
        self.rq_psn = None
        self.sq_psn = None
        self.ah_attr = None
        self.max_dest_rd_atomic = 0
        self.min_rnr_timer = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.max_rd_atomic = 0


class AHAttr:
    def __init__(self, dlid: int, port_num: int, is_global: int, grh: GlobalRoute) -> None:
        self.dlid, self.port_num, self.is_global, self.grh = dlid, port_num, is_global, grh


class GlobalRoute:
    def __init__(self, dgid: GID, sgid_index: int) -> None:
        self.dgid, self.sgid_index = dgid, sgid_index


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(self, wr_id: int = 0, opcode: int = 0, num_sge: int = 1, sg: SGE | None = None, send_flags: int = 0) -> None:
        self.wr_id, self.opcode, self.num_sge, self.sg, self.send_flags = wr_id, opcode, num_sge, sg, send_flags
        self.rkey = None
        self.remote_addr = None

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


class QP:
    def __init__(self, pd: PD, init_attr: QPInitAttr) -> None:
        if init_attr.qp_type != enums.IBV_QPT_RC:
            raise VerbsError("this double only has RC queue pairs")
        self.pd = pd
        self.scq = init_attr.scq
        self.max_send_wr = init_attr.cap.max_send_wr
        self.qp_num = FABRIC.number()
        self.qp_state = enums.IBV_QPS_RESET
        self.history = [enums.IBV_QPS_RESET]
        self.access = 0
        self.dest_qp_num: int | None = None
        self.outstanding = 0
        with FABRIC.lock:
            FABRIC.qps[self.qp_num] = self

    def _move(self, expected: int, new: int) -> None:
        if self.qp_state != expected:
            raise VerbsError(f"invalid QP transition {self.qp_state} -> {new}")
        self.qp_state = new
        self.history.append(new)

    def to_init(self, attr: QPAttr) -> None:
        if attr.port_num != 1:
            raise VerbsError("INIT needs port_num")
        self._move(enums.IBV_QPS_RESET, enums.IBV_QPS_INIT)
        self.access = attr.qp_access_flags

    def to_rtr(self, attr: QPAttr) -> None:
        if attr.dest_qp_num is None or attr.rq_psn is None or attr.ah_attr is None or not attr.path_mtu:
            raise VerbsError("RTR needs dest_qp_num, rq_psn, path_mtu and ah_attr")
        self._move(enums.IBV_QPS_INIT, enums.IBV_QPS_RTR)
        self.dest_qp_num = attr.dest_qp_num

    def to_rts(self, attr: QPAttr) -> None:
        if attr.sq_psn is None:
            raise VerbsError("RTS needs sq_psn")
        self._move(enums.IBV_QPS_RTR, enums.IBV_QPS_RTS)

    def post_send(self, wr: SendWR) -> None:
        if self.qp_state not in (enums.IBV_QPS_RTS, enums.IBV_QPS_ERR):
            raise VerbsError(f"post_send on a QP in state {self.qp_state}")
        with FABRIC.lock:
            if self.outstanding >= self.max_send_wr:
                raise VerbsError("send queue full")
            self.outstanding += 1
        if FABRIC.stall:
            return
        status = enums.IBV_WC_WR_FLUSH_ERR if self.qp_state == enums.IBV_QPS_ERR else self._execute(wr)
        if status != enums.IBV_WC_SUCCESS:
            self.qp_state = enums.IBV_QPS_ERR
        if status != enums.IBV_WC_SUCCESS or wr.send_flags & enums.IBV_SEND_SIGNALED:
            self.scq.push(SimpleNamespace(wr_id=wr.wr_id, status=status, opcode=wr.opcode, qp_num=self.qp_num))
        else:
            with FABRIC.lock:
                self.outstanding -= 1

    def _execute(self, wr: SendWR) -> int:
        sge = wr.sg
        with FABRIC.lock:
            local = FABRIC.mrs.get(sge.lkey)
            remote_qp = FABRIC.qps.get(self.dest_qp_num)
            remote = FABRIC.mrs.get(wr.rkey)
        if local is None or local.lkey != sge.lkey or local.pd is not self.pd or not local.covers(sge.addr, sge.length):
            return enums.IBV_WC_LOC_PROT_ERR
        if wr.opcode == enums.IBV_WR_RDMA_READ and not local.access & enums.IBV_ACCESS_LOCAL_WRITE:
            return enums.IBV_WC_LOC_PROT_ERR
        if remote_qp is None or remote_qp.dest_qp_num != self.qp_num or remote_qp.qp_state not in (enums.IBV_QPS_RTR, enums.IBV_QPS_RTS):
            return enums.IBV_WC_REM_ACCESS_ERR
        needed = enums.IBV_ACCESS_REMOTE_WRITE if wr.opcode == enums.IBV_WR_RDMA_WRITE else enums.IBV_ACCESS_REMOTE_READ
        if (
            remote is None
            or remote.rkey != wr.rkey
            or remote.pd is not remote_qp.pd
            or not remote.covers(wr.remote_addr, sge.length)
            or not remote.access & needed
            or not remote_qp.access & needed
        ):
            return enums.IBV_WC_REM_ACCESS_ERR
        if wr.opcode == enums.IBV_WR_RDMA_WRITE:
            ctypes.memmove(wr.remote_addr, sge.addr, sge.length)
        else:
            ctypes.memmove(sge.addr, wr.remote_addr, sge.length)
        return enums.IBV_WC_SUCCESS

    def close(self) -> None:
        with FABRIC.lock:
            FABRIC.qps.pop(self.qp_num, None)


VERBS = Verbs(
    get_device_list=get_device_list,
    Context=Context,
    PD=PD,
    CQ=CQ,
    MR=MR,
    QP=QP,
    QPCap=QPCap,
    QPInitAttr=QPInitAttr,
    QPAttr=QPAttr,
    AHAttr=AHAttr,
    GlobalRoute=GlobalRoute,
    GID=GID,
    SGE=SGE,
    SendWR=SendWR,
    enums=enums,
    Error=VerbsError,
)
