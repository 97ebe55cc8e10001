"""Objects written straight into a pool ``Segment``, as a pool client would, for the pool's unit
tests: ``OBJ``-byte objects of four ``PART``-byte parts, every byte ``fill``."""

from __future__ import annotations

import torch

from cluster.pool import Segment
from cluster.pool.objects import part_checksums

PART = 4096
OBJ = 4 * PART


def write_object(segment: Segment, key: str, fill: int) -> bytes:
    """Allocate, fill and seal ``key``; its bytes."""
    offset = segment.allocate(key, OBJ, PART)
    assert offset is not None
    data = bytes([fill]) * OBJ
    segment.area.buffer[offset : offset + OBJ].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert segment.seal(key, part_checksums(memoryview(data), PART))
    return data


def leased_bytes(segment: Segment, grant) -> bytes:
    """What a lease ``grant`` points at in the segment's memory."""
    return bytes(segment.area.buffer[grant.offset : grant.offset + grant.nbytes].numpy())
