"""A segment on the network: its owner's answers to writers and readers, its metadata, its heat.

``SegmentService`` serves a :class:`Segment` through the process's transfer engine (the
requests of ``messages.py``, ``alloc`` / ``seal`` / ``abort`` / ``lease`` / ``touch`` /
``release``, arrive on the Messenger's authenticated control stream) and keeps the segment in
the metadata store under a lease (``index.py`` reads it):

* ``pool/segments/<id>``: where it is (Messenger address and region handle) and its stats,
  rewritten every heartbeat with the lease kept alive;
* ``pool/objects/<key>/<id>``: one entry per object it holds, put when a write is sealed and
  deleted when the object is evicted for good.

Every entry is tied to the lease, so a node that dies leaves the index when its lease expires:
no master to fail over. A node whose lease expired while it was alive (paused, cut off)
registers again and republishes what it holds.

Hot-spot replication (the paper's hot-block replication; Mooncake Store's hot-replica fanout):
each heartbeat, an object leased ``hot_reads`` times within the segment's window gets one more
replica on another segment, up to ``max_replicas``; readers spread over replicas by load.

The lease's keepalive and the replication run on threads of their own: a copy to a slow segment
(up to the transfer timeout) or a slow metadata read for it never delays a keepalive, so a node
never loses its lease, and with it every entry it published, for being busy.
"""

from __future__ import annotations

import json
import logging
import threading

from cluster.messenger import Messenger
from cluster.messenger.wire import Status
from cluster.pool.client import PoolClient
from cluster.pool.index import SEGMENTS, object_entry
from cluster.pool.messages import (
    OPS, AbortRequest, AllocReply, AllocRequest, LeaseReply, LeaseRequest, ReleaseRequest, SealReply, SealRequest,
    TouchReply, TouchRequest, request_from_dict,
)
from cluster.metadata import LeaseGone, MetadataStore, MetadataUnavailable
from cluster.pool.segment import PoolFull, Segment

log = logging.getLogger(__name__)


class SegmentService:
    def __init__(self, segment: Segment, transfer: Messenger, metadata: MetadataStore, client: PoolClient,
                 name: str, *, lease_ttl_s: float = 5.0, heartbeat_s: float = 1.0, hot_reads: int = 8,
                 max_replicas: int = 3) -> None:
        if not heartbeat_s < lease_ttl_s:
            raise ValueError("the heartbeat must come more often than the lease expires")
        self.segment = segment
        self.segment_id = f"{name}-{transfer.engine_id}"
        self._transfer = transfer
        self._metadata = metadata
        self._client = client
        self._lease_ttl_s = lease_ttl_s
        self._heartbeat_s = heartbeat_s
        self._hot_reads = hot_reads
        self._max_replicas = max_replicas
        self.replicas_made = 0
        self._stop = threading.Event()
        self._lease = self._metadata.grant_lease(lease_ttl_s)
        self._register()
        segment.start_publishing(self.publish)
        transfer.serve(self._handle, OPS)
        self._threads = [threading.Thread(target=self._heartbeat_loop, name="pool heartbeat", daemon=True),
                         threading.Thread(target=self._replication_loop, name="pool replication", daemon=True)]
        for thread in self._threads:
            thread.start()

    # -- metadata -----------------------------------------------------------------------------------
    def publish(self, key: str, present: bool) -> None:
        """The segment's publisher: runs in order on its own thread."""
        entry = object_entry(key, self.segment_id)
        if present:
            self._metadata.put(entry, "1", lease=self._lease)
        else:
            self._metadata.delete(entry)

    def _entry(self) -> str:
        stats = {**self.segment.stats(), "replicas_made": self.replicas_made}
        return json.dumps({"address": self._transfer.address, "handle": self.segment.handle.to_dict(),
                           "stats": stats})

    def _register(self) -> None:
        self._metadata.put(SEGMENTS + self.segment_id, self._entry(), lease=self._lease)

    def _heartbeat_loop(self) -> None:
        """Keep the lease alive and the segment's entry fresh: nothing else runs on this thread."""
        while not self._stop.wait(self._heartbeat_s):
            try:
                try:
                    self._metadata.keepalive(self._lease)
                    self._register()
                except LeaseGone:
                    log.warning("pool: segment %s lost its metadata lease; registering again", self.segment_id)
                    self._lease = self._metadata.grant_lease(self._lease_ttl_s)
                    self._register()
                    for key in self.segment.keys():
                        self.publish(key, True)
            except MetadataUnavailable as exc:
                log.warning("pool: metadata unavailable: %s", exc)
            except Exception:
                log.exception("pool: heartbeat failed")

    def _replication_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                self._replicate_hot()
            except MetadataUnavailable as exc:
                log.info("pool: metadata unavailable for replication: %s", exc)
            except Exception:
                log.exception("pool: replication failed")

    def _replicate_hot(self) -> None:
        for key in self.segment.hot_keys(self._hot_reads):
            holders = self._client.replicas(key)
            if len(holders) >= self._max_replicas:
                continue
            copy = self.segment.lease([key])[0]
            if copy is None:
                continue
            try:
                made = self._client.put(key, self.segment.handle, copy.offset, copy.nbytes, copy.part_bytes,
                                        copy.checksums, exclude=holders)
            finally:
                self.segment.release(key, copy.lease)
            if made is not None:
                self.replicas_made += 1
                self.segment.cool(key)

    # -- requests -----------------------------------------------------------------------------------
    def _handle(self, request: dict, peer_hello: dict) -> tuple[Status, dict]:
        """One request of ``messages.py``, answered as it says. A malformed one raises
        ``BadRequest`` (the Messenger answers ``BAD_REQUEST``: the sender's fault)."""
        seg = self.segment
        match request_from_dict(request):
            case LeaseRequest(keys=keys):
                return Status.OK, LeaseReply(seg.lease(keys)).to_dict()
            case TouchRequest(keys=keys, retain=retain, promote=promote):
                return Status.OK, TouchReply(seg.touch(keys, retain, promote)).to_dict()
            case ReleaseRequest(leases=leases):
                for key, lease in leases:
                    seg.release(key, lease)
            case AllocRequest(objects=objects):
                offsets: list[int | None] = []
                for o in objects:
                    try:
                        offsets.append(seg.allocate(o.key, o.nbytes, o.part_bytes))
                    except PoolFull as exc:
                        if not offsets:
                            return Status.UNSUPPORTED, {"reason": str(exc)}
                        break  # the writer takes the rest elsewhere
                return Status.OK, AllocReply(offsets).to_dict()
            case SealRequest(objects=objects):
                return Status.OK, SealReply([seg.seal(key, sums) for key, sums in objects]).to_dict()
            case AbortRequest(keys=keys):
                for key in keys:
                    seg.abort(key)
        return Status.OK, {}

    def close(self) -> None:
        """Leave the pool: the lease's revocation drops every entry of this segment at once."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.segment.close()
        try:
            self._metadata.revoke(self._lease)
        except MetadataUnavailable:
            pass  # the lease expires by itself
