"""The pool's Messenger requests (cluster/pool/messages.py): their wire form, which pool nodes
and clients of other versions of this code speak, their checks, and a segment's answer to a
malformed one."""

from __future__ import annotations

import json

import pytest

from cluster.messenger import Messenger, MessengerConfig
from cluster.messenger.wire import Status
from cluster.pool import PoolClient, Segment, SegmentConfig, SegmentService
from cluster.pool.messages import (
    OPS, AbortRequest, AllocReply, AllocRequest, Grant, LeaseReply, LeaseRequest, NewObjectSize, ReleaseRequest,
    SealReply, SealRequest, TouchRequest, request_from_dict,
)
from cluster.metadata.local import LocalMetadata
from cluster.protocol import BadRequest

GRANT = Grant("ns/a", 64, 8, 4, [11, 2**64 - 1], 3)

# Each message and its wire form, as the untyped code before these messages sent it.
WIRE = [
    (LeaseRequest(["ns/a", "ns/b"]), {"op": "lease", "keys": ["ns/a", "ns/b"]}),
    (LeaseReply([GRANT, None]), {"grants": [{"key": "ns/a", "offset": 64, "nbytes": 8, "part_bytes": 4,
                                             "checksums": [11, 2**64 - 1], "lease": 3}, None]}),
    (TouchRequest(["ns/a"]), {"op": "touch", "keys": ["ns/a"]}),
    (ReleaseRequest([("ns/a", 3), ("ns/b", 4)]), {"op": "release", "leases": [["ns/a", 3], ["ns/b", 4]]}),
    (AllocRequest([NewObjectSize("ns/a", 8, 4)]), {"op": "alloc", "objects": [["ns/a", 8, 4]]}),
    (AllocReply([0, None]), {"offsets": [0, None]}),
    (SealRequest([("ns/a", [1, 2])]), {"op": "seal", "objects": [["ns/a", [1, 2]]]}),
    (SealReply([True, False]), {"ok": [True, False]}),
    (AbortRequest(["ns/a"]), {"op": "abort", "keys": ["ns/a"]}),
]


@pytest.mark.parametrize("message, wire", WIRE, ids=lambda m: type(m).__name__)
def test_wire_form_and_round_trip(message, wire):
    assert message.to_dict() == wire
    assert type(message).from_dict(json.loads(json.dumps(wire))) == message


def test_a_request_is_found_by_its_op():
    assert OPS == ("lease", "touch", "release", "alloc", "seal", "abort")
    for message, wire in WIRE:
        if "op" in wire:
            assert request_from_dict(wire) == message
    with pytest.raises(BadRequest, match="unknown pool request 'stage_step'"):
        request_from_dict({"op": "stage_step"})


@pytest.mark.parametrize("cls, body, names", [
    (LeaseRequest, {"keys": ["a", 1]}, "keys"),
    (ReleaseRequest, {"leases": [["a"]]}, r"leases\[0\]"),
    (ReleaseRequest, {"leases": [["a", -1]]}, r"leases\[0\]"),
    (AllocRequest, {"objects": [["a", 8, 4], ["b", "8", 4]]}, r"objects\[1\]"),
    (AllocRequest, {"objects": "a"}, "objects"),
    (AllocReply, {"offsets": [0, -8]}, r"offsets\[1\]"),
    (SealRequest, {"objects": [["", [1]]]}, r"objects\[0\]"),
    (SealReply, {"ok": [1]}, "ok"),
    (LeaseReply, {"grants": [{**GRANT.to_dict(), "checksums": [1]}]}, r"grants\[0\]"),
    (LeaseReply, {"grants": [{**GRANT.to_dict(), "lease": None}]}, r"grants\[0\]: lease"),
])
def test_a_malformed_body_is_refused_naming_its_field(cls, body, names):
    with pytest.raises(BadRequest, match=names):
        cls.from_dict(body)


def test_a_segment_answers_a_malformed_request_bad_request():
    metadata = LocalMetadata()
    with Messenger(MessengerConfig(secret=b"pool-messages-test-secret-012345")) as node_engine, \
            Messenger(MessengerConfig(secret=b"pool-messages-test-secret-012345")) as other:
        node = SegmentService(Segment(node_engine, SegmentConfig(dram_bytes=1 << 16)), node_engine, metadata,
                              PoolClient(node_engine, metadata), "node", lease_ttl_s=2.0, heartbeat_s=0.2)
        try:
            assert other.call(node_engine.address, {"op": "lease", "keys": [7]})[0] == Status.BAD_REQUEST
            status, answer = other.call(node_engine.address, LeaseRequest(["ns/absent"]).to_dict())
            assert status == Status.OK and LeaseReply.from_dict(answer) == LeaseReply([None])
        finally:
            node.close()
