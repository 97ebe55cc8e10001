"""A checksum per layer of a request's KV, in a trailer after the KV (issue 23 §5).

The sender writes each layer's checksum with that layer's last write (``KVSender``, or a
replication push in one piece: ``layer_checksums``); the decode instance verifies every layer
before the blocks are admitted (``verify_layers``), so bytes that slipped into the range from a
late write refuse the request instead of entering its prefix cache.
"""

from __future__ import annotations

import struct

import torch
import xxhash

# One layer's checksum in the trailer: a little-endian xxh3-64, after the KV of a range whose
# destination has ``sums`` (``KVDestination.sums``).
LAYER_SUM = struct.Struct("<Q")


def sums_bytes(num_layers: int) -> int:
    """The size of the checksum trailer of ``num_layers`` layers."""
    return LAYER_SUM.size * num_layers


def layer_checksum(data: torch.Tensor) -> int:
    """The checksum of one layer's bytes (a contiguous CPU tensor)."""
    return xxhash.xxh3_64_intdigest(memoryview(data.reshape(-1).view(torch.uint8).numpy()))


def layer_checksums(kv: torch.Tensor) -> bytes:
    """The trailer for ``kv`` (layers on the first dimension): each layer's checksum."""
    return b"".join(LAYER_SUM.pack(layer_checksum(kv[i])) for i in range(kv.shape[0]))


def verify_layers(kv: torch.Tensor, trailer: torch.Tensor) -> int | None:
    """The first layer of ``kv`` whose bytes do not match its checksum in ``trailer`` (the
    received uint8 trailer), or None when every layer matches."""
    sums = [v for (v,) in LAYER_SUM.iter_unpack(memoryview(trailer.numpy()))]
    for i in range(kv.shape[0]):
        if layer_checksum(kv[i]) != sums[i]:
            return i
    return None
