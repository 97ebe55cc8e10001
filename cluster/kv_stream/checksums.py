"""A checksum per layer of a request's KV, in a trailer after the KV.

The sender writes each layer's checksum with that layer's last write (``KVSender``, or a
replication push in one piece: ``layer_checksums``); the decode instance verifies every layer
before the blocks are admitted (``verify_layers``), so bytes that slipped into the range from a
late write, or that an earlier use of the range left where this one wrote nothing, refuse the
request instead of entering its prefix cache: each checksum is keyed by the range's use and the
layer (``layer_seed``).
"""

from __future__ import annotations

import struct

import torch
import xxhash

# One layer's checksum in the trailer: a little-endian xxh3-64, after the KV of a range whose
# destination has ``sums`` (``KVDestination.sums``).
LAYER_SUM = struct.Struct("<Q")
_MASK = (1 << 64) - 1


def sums_bytes(num_layers: int) -> int:
    """The size of the checksum trailer of ``num_layers`` layers."""
    return LAYER_SUM.size * num_layers


def layer_seed(generation: int | None, layer: int) -> int:
    """The key of a layer's checksum: the use of the range it is written into (its generation)
    and the layer's place in the wire layout. Without it a range reused by a request of the same
    length would hold the earlier request's KV and checksums, consistent with each other, in
    whatever this request never wrote (a layer never sent, a write cut short): the check would
    pass another request's KV as this one's (bench.faults' ``kv-layer-never-sent`` row)."""
    return ((generation or 0) * 0x9E3779B97F4A7C15 + layer) & _MASK


def layer_checksum(data: torch.Tensor, seed: int) -> int:
    """The checksum of one layer's bytes (a contiguous CPU tensor) under ``layer_seed``."""
    return xxhash.xxh3_64_intdigest(memoryview(data.reshape(-1).view(torch.uint8).numpy()), seed)


def layer_checksums(kv: torch.Tensor, generation: int | None) -> bytes:
    """The trailer for ``kv`` (every layer of the wire layout on the first dimension), written
    into the range opened under ``generation``."""
    return b"".join(LAYER_SUM.pack(layer_checksum(kv[i], layer_seed(generation, i))) for i in range(kv.shape[0]))


def verify_layers(kv: torch.Tensor, trailer: torch.Tensor, generation: int | None) -> int | None:
    """The first layer of ``kv`` whose bytes do not match its checksum in ``trailer`` (the
    received uint8 trailer of the range opened under ``generation``), or None when all match."""
    sums = [v for (v,) in LAYER_SUM.iter_unpack(memoryview(trailer.numpy()))]
    for i in range(kv.shape[0]):
        if layer_checksum(kv[i], layer_seed(generation, i)) != sums[i]:
            return i
    return None
