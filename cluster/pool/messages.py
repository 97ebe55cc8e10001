"""What pool clients and segments say to each other over the Messenger.

Each request is a Messenger ``call`` (``notify`` for ``ReleaseRequest``) whose ``op`` is its
class's ``OP``, answered by the segment's owner (``service.SegmentService``); ``to_dict`` /
``from_dict`` are the wire form, and ``from_dict`` validates, raising ``BadRequest`` (a
``ValueError``: the Messenger answers the sender ``BAD_REQUEST``, the sender's fault) rather
than a ``KeyError``. A request answered with nothing else answers ``{}``. A refusal is the
Messenger's: a status other than OK, with a ``reason`` (only ``AllocRequest`` is refused, when
the segment has no room for even its first object).

A segment takes every list in order and answers in the same order: reply item ``i`` is about
request item ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cluster.protocol import BadRequest
from cluster.protocol.fields import _field, _flag, _int, _naturals, _strings


def _list(data: Any, name: str) -> list[Any]:
    value = _field(data, name)
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list")
    return value


def _item(check: Any, name: str, i: int, value: Any) -> Any:
    """``check`` of a list's item ``i``, its errors naming the item."""
    try:
        return check(value)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{name}[{i}]: {exc}") from None


def _entry(value: Any, size: int) -> list[Any]:
    if not isinstance(value, list) or len(value) != size:
        raise ValueError(f"must be a list of {size}")
    return value


def _key(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("a key must be a non-empty string")
    return value


def _natural(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"must be a non-negative integer, got {value!r}")
    return value


def _checksums(value: Any) -> list[int]:
    if not _naturals(value):
        raise ValueError("checksums must be a list of non-negative integers")
    return value


@dataclass(frozen=True)
class Grant:
    """A reader's right to read object ``key`` at ``offset`` of the segment's region until lease
    ``lease`` ends: ``nbytes`` in parts of ``part_bytes`` (one per layer), part ``i`` of which
    hashes to ``checksums[i]`` (so ``nbytes == len(checksums) * part_bytes``). While the lease
    lives the segment neither evicts nor moves the object."""

    key: str
    offset: int
    nbytes: int
    part_bytes: int
    checksums: list[int]
    lease: int

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "offset": self.offset, "nbytes": self.nbytes, "part_bytes": self.part_bytes,
                "checksums": self.checksums, "lease": self.lease}

    @classmethod
    def from_dict(cls, data: Any) -> Grant:
        grant = cls(_key(_field(data, "key")), _int(data, "offset"), _int(data, "nbytes"), _int(data, "part_bytes"),
                    _checksums(_field(data, "checksums")), _int(data, "lease"))
        if grant.part_bytes <= 0 or grant.nbytes != len(grant.checksums) * grant.part_bytes:
            raise BadRequest(f"grant of {grant.key!r}: {grant.nbytes} bytes do not make "
                             f"{len(grant.checksums)} parts of {grant.part_bytes}")
        return grant


@dataclass(frozen=True)
class LeaseRequest:
    """Lease the objects ``keys`` for reading (promoted from the segment's SSD if need be)."""

    OP: ClassVar[str] = "lease"
    keys: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "keys": self.keys}

    @classmethod
    def from_dict(cls, data: Any) -> LeaseRequest:
        return cls(_strings(data, "keys"))


@dataclass(frozen=True)
class LeaseReply:
    """One grant per key asked, in order; None for a key the segment does not hold sealed (or
    could not bring back from its SSD)."""

    grants: list[Grant | None]

    def to_dict(self) -> dict[str, Any]:
        return {"grants": [None if g is None else g.to_dict() for g in self.grants]}

    @classmethod
    def from_dict(cls, data: Any) -> LeaseReply:
        return cls([None if g is None else _item(Grant.from_dict, "grants", i, g)
                    for i, g in enumerate(_list(data, "grants"))])


@dataclass(frozen=True)
class TouchRequest:
    """The objects ``keys`` (a prefix, in order) were used now, as a read would have: the
    segment's LRU order follows. Keys it does not hold are ignored. ``retain``: they are a
    session's, retained at this priority; ``promote``: those on the SSD tier come up to DRAM
    (``Segment.touch``)."""

    OP: ClassVar[str] = "touch"
    keys: list[str]
    retain: int | None = None
    promote: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.OP, "keys": self.keys}
        if self.retain is not None:
            d["retain"] = self.retain
        if self.promote:
            d["promote"] = True
        return d

    @classmethod
    def from_dict(cls, data: Any) -> TouchRequest:
        retain = data.get("retain") if isinstance(data, dict) else None
        promote = isinstance(data, dict) and data.get("promote") is not None and _flag(data, "promote")
        return cls(_strings(data, "keys"), None if retain is None else _int(data, "retain"), promote)


@dataclass(frozen=True)
class TouchReply:
    promoted: int  # objects brought up from the SSD tier

    def to_dict(self) -> dict[str, Any]:
        return {"promoted": self.promoted}

    @classmethod
    def from_dict(cls, data: Any) -> TouchReply:
        return cls(_int(data, "promoted", 0))


@dataclass(frozen=True)
class ReleaseRequest:
    """End the leases ``leases`` (``(key, lease)`` of grants this reader holds). Sent with
    ``notify``: a release that never arrives only keeps its objects pinned until the leases
    expire."""

    OP: ClassVar[str] = "release"
    leases: list[tuple[str, int]]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "leases": [[key, lease] for key, lease in self.leases]}

    @classmethod
    def from_dict(cls, data: Any) -> ReleaseRequest:
        return cls([_item(lambda e: (_key(_entry(e, 2)[0]), _natural(e[1])), "leases", i, e)
                    for i, e in enumerate(_list(data, "leases"))])


@dataclass(frozen=True)
class NewObjectSize:
    """An object to allocate: ``nbytes`` in parts of ``part_bytes`` (one per layer)."""

    key: str
    nbytes: int
    part_bytes: int

    def to_list(self) -> list[Any]:
        return [self.key, self.nbytes, self.part_bytes]

    @classmethod
    def from_list(cls, value: Any) -> NewObjectSize:
        key, nbytes, part_bytes = _entry(value, 3)
        return cls(_key(key), _natural(nbytes), _natural(part_bytes))


@dataclass(frozen=True)
class AllocRequest:
    """Allocate ``objects`` in order, each to be written by the sender and then sealed or
    aborted (an allocation never sealed is taken back after the segment's put timeout)."""

    OP: ClassVar[str] = "alloc"
    objects: list[NewObjectSize]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "objects": [o.to_list() for o in self.objects]}

    @classmethod
    def from_dict(cls, data: Any) -> AllocRequest:
        return cls([_item(NewObjectSize.from_list, "objects", i, o) for i, o in enumerate(_list(data, "objects"))])


@dataclass(frozen=True)
class AllocReply:
    """``offsets[i]``: where object ``i`` goes in the segment's region, or None when the segment
    holds it (or is storing it) already. One per object of a leading run of the request's: the
    first that did not fit ends it, and the sender takes it and the rest elsewhere."""

    offsets: list[int | None]

    def to_dict(self) -> dict[str, Any]:
        return {"offsets": self.offsets}

    @classmethod
    def from_dict(cls, data: Any) -> AllocReply:
        return cls([None if o is None else _item(_natural, "offsets", i, o)
                    for i, o in enumerate(_list(data, "offsets"))])


@dataclass(frozen=True)
class SealRequest:
    """Publish written objects, ``(key, checksums of its parts)`` each, in order: the segment
    checks the bytes against the checksums first."""

    OP: ClassVar[str] = "seal"
    objects: list[tuple[str, list[int]]]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "objects": [[key, sums] for key, sums in self.objects]}

    @classmethod
    def from_dict(cls, data: Any) -> SealRequest:
        return cls([_item(lambda e: (_key(_entry(e, 2)[0]), _checksums(e[1])), "objects", i, e)
                    for i, e in enumerate(_list(data, "objects"))])


@dataclass(frozen=True)
class SealReply:
    """``ok[i]``: object ``i`` is published; False when its bytes did not match its checksums
    (its range is freed) or its allocation was given up meanwhile."""

    ok: list[bool]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok}

    @classmethod
    def from_dict(cls, data: Any) -> SealReply:
        ok = _list(data, "ok")
        if not all(isinstance(v, bool) for v in ok):
            raise BadRequest("ok must be a list of true or false")
        return cls(ok)


@dataclass(frozen=True)
class AbortRequest:
    """Give back the allocations of ``keys`` (not sealed: a sealed object stays)."""

    OP: ClassVar[str] = "abort"
    keys: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "keys": self.keys}

    @classmethod
    def from_dict(cls, data: Any) -> AbortRequest:
        return cls(_strings(data, "keys"))


PoolRequest = LeaseRequest | TouchRequest | ReleaseRequest | AllocRequest | SealRequest | AbortRequest
REQUESTS: dict[str, type[PoolRequest]] = {
    cls.OP: cls for cls in (LeaseRequest, TouchRequest, ReleaseRequest, AllocRequest, SealRequest, AbortRequest)}
OPS = tuple(REQUESTS)  # what a segment answers


def request_from_dict(data: Any) -> PoolRequest:
    """The request ``data`` is; raises ``BadRequest`` for an op not in ``OPS`` or a malformed
    body (the sender's fault)."""
    cls = REQUESTS.get(_field(data, "op"))
    if cls is None:
        raise BadRequest(f"unknown pool request {_field(data, 'op')!r}")
    return cls.from_dict(data)
