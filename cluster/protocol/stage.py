"""Pipeline stages: a later stage <-> its first stage (``cluster.cpp.group``), and the stages <->
each other over the Messenger (``cluster.cpp.stage``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cluster.protocol.errors import BadRequest
from cluster.protocol.fields import _dest, _dict, _field, _flag, _int, _ints, _naturals, _number, _str


# -- a later pipeline stage <-> its first stage (cluster.cpp.group) ------------------------------------

@dataclass(frozen=True)
class StageSpec:
    """What a later stage takes from its first stage to start: its ``EngineConfig`` as a dict
    (with its stage), its buffers' sizes, the transfer timeout, and the pool geometry (``[blocks
    per object, pool staging bytes]``) when the group is in a KVCache pool."""

    engine: dict[str, Any]
    buffer_bytes: int
    staging_bytes: int
    timeout_s: float
    pool: list[int] | None = None

    def for_stage(self, stage: int) -> StageSpec:
        stages = self.engine["stage"][1]
        return dataclasses.replace(self, engine={**self.engine, "stage": [stage, stages]})

    @classmethod
    def of(cls, engine: Any, buffer_bytes: int, staging_bytes: int, timeout_s: float,
           pool: tuple[int, int] | None) -> StageSpec:
        """``engine``: the first stage's ``EngineConfig`` (a dataclass)."""
        return cls(dataclasses.asdict(engine), buffer_bytes, staging_bytes, timeout_s,
                   None if pool is None else list(pool))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> StageSpec:
        engine = _dict(data, "engine")
        timeout = _number(data, "timeout_s")
        pool = _field(data, "pool")
        if pool is not None and (not isinstance(pool, list) or len(pool) != 2 or
                                 not all(type(n) is int for n in pool)):
            raise BadRequest("pool must be [blocks per object, pool staging bytes]")
        return cls(dict(engine), _int(data, "buffer_bytes"), _int(data, "staging_bytes"), timeout, pool)


@dataclass(frozen=True)
class StageJoin:
    """``POST /instance/stage/join`` from a later stage of a group started by hand: without
    ``peer``, it asks for its ``StageSpec``; with its peer (``cluster.cpp.group.peer_dict``), for
    its links once every stage has joined."""

    group: str
    stage: int
    stages: int
    peer: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "stage": self.stage, "stages": self.stages, "peer": self.peer}

    @classmethod
    def from_dict(cls, data: Any) -> StageJoin:
        return cls(_str(data, "group"), _int(data, "stage"), _int(data, "stages"),
                   _dict(data, "peer", optional=True))


@dataclass(frozen=True)
class StageSpecReply:
    spec: StageSpec

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.to_dict()}

    @classmethod
    def from_dict(cls, data: Any) -> StageSpecReply:
        return cls(StageSpec.from_dict(_dict(data, "spec")))


@dataclass(frozen=True)
class StageLinks:
    """A later stage's links (peers as ``peer_dict``s): where it sends (``next``; None for the
    last stage, which sends back to ``first``) and the first stage it pings."""

    first: dict[str, Any]
    next: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"next": self.next, "first": self.first}

    @classmethod
    def from_dict(cls, data: Any) -> StageLinks:
        return cls(_dict(data, "first"), _dict(data, "next", optional=True))


# -- pipeline stages <-> each other, over the Messenger (cluster.cpp.stage) ------------------------------
# Each is a Messenger ``call`` (``notify`` for ``StagePoolUnload``) whose ``op`` is its class's
# ``OP``; a call answered with nothing else answers ``{}``. A refusal is the Messenger's: a status
# other than OK, with a ``reason``.

@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of a ``StageStepCall`` or ``StageLogits`` lies in the receiver's inbox
    (written there before the call): ``dtype`` is torch's name without ``torch.``."""

    shape: list[int]
    dtype: str
    offset: int

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "dtype": self.dtype, "offset": self.offset}

    @classmethod
    def from_dict(cls, data: Any) -> TensorSlot:
        return cls(_ints(data, "shape"), _str(data, "dtype"), _int(data, "offset"))


def _tensors(data: Any) -> list[TensorSlot]:
    value = _field(data, "tensors")
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRequest("tensors must be a list of JSON objects")
    return [TensorSlot.from_dict(t) for t in value]


@dataclass(frozen=True)
class StageStepCall:
    """One step on to the next stage: the ``StageStep.to_dict()`` and its hidden states and
    residual, in the inbox."""

    OP: ClassVar[str] = "stage_step"
    step: dict[str, Any]
    tensors: list[TensorSlot] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "step": self.step, "tensors": [t.to_dict() for t in self.tensors]}

    @classmethod
    def from_dict(cls, data: Any) -> StageStepCall:
        return cls(_dict(data, "step"), _tensors(data))


@dataclass(frozen=True)
class StageLogits:
    """From the last stage to the first: step ``step_id``'s sampled rows' logits, in the inbox;
    or, with ``error`` (and no tensors), why a stage failed the step."""

    OP: ClassVar[str] = "stage_logits"
    step_id: int
    tensors: list[TensorSlot] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "step_id": self.step_id, "tensors": [t.to_dict() for t in self.tensors],
                "error": self.error}

    @classmethod
    def from_dict(cls, data: Any) -> StageLogits:
        return cls(_int(data, "step_id"), _tensors(data), _str(data, "error", optional=True))


@dataclass(frozen=True)
class StageExpect:
    """Stream this stage's layers of the request's KV to ``dest`` (a ``KVDestination.to_dict()``)."""

    OP: ClassVar[str] = "stage_expect"
    request_id: str
    dest: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "request_id": self.request_id, "dest": self.dest}

    @classmethod
    def from_dict(cls, data: Any) -> StageExpect:
        return cls(_str(data, "request_id"), _dest(data))


@dataclass(frozen=True)
class StageFinish:
    """Answer (``StageFinishReply``) once this stage's KV writes of the request have landed."""

    OP: ClassVar[str] = "stage_finish"
    request_id: str
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "request_id": self.request_id, "timeout_s": self.timeout_s}

    @classmethod
    def from_dict(cls, data: Any) -> StageFinish:
        return cls(_str(data, "request_id"), _number(data, "timeout_s"))


@dataclass(frozen=True)
class StageFinishReply:
    error: str | None = None  # why a write failed; None: all landed

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.error}

    @classmethod
    def from_dict(cls, data: Any) -> StageFinishReply:
        return cls(_str(data, "error", optional=True))


@dataclass(frozen=True)
class StagePoolLoad:
    """Read and verify this stage's layers of the pool objects ``leases`` (``PoolRead.leases()``)
    names, for the request's coming step."""

    OP: ClassVar[str] = "stage_pool_load"
    request_id: str
    leases: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "request_id": self.request_id, "leases": self.leases}

    @classmethod
    def from_dict(cls, data: Any) -> StagePoolLoad:
        return cls(_str(data, "request_id"), _dict(data, "leases"))


@dataclass(frozen=True)
class StagePoolLoadReply:
    good: int  # objects, from the first, that arrived intact

    def to_dict(self) -> dict[str, Any]:
        return {"good": self.good}

    @classmethod
    def from_dict(cls, data: Any) -> StagePoolLoadReply:
        return cls(_int(data, "good"))


@dataclass(frozen=True)
class StagePoolUnload:
    """Let go of the request's load once the steps sent before this have run (a ``notify``,
    routed down the pipeline behind them)."""

    OP: ClassVar[str] = "stage_pool_unload"
    request_id: str

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "request_id": self.request_id}

    @classmethod
    def from_dict(cls, data: Any) -> StagePoolUnload:
        return cls(_str(data, "request_id"))


@dataclass(frozen=True)
class StagePoolStore:
    """Write this stage's layers of the objects ``reservation`` (``PoolWrite.reservation()``)
    names as the prompt's last step computes them; ``first_blocks``: each object's first block."""

    OP: ClassVar[str] = "stage_pool_store"
    request_id: str
    reservation: dict[str, Any]
    first_blocks: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "request_id": self.request_id, "reservation": self.reservation,
                "first_blocks": self.first_blocks}

    @classmethod
    def from_dict(cls, data: Any) -> StagePoolStore:
        return cls(_str(data, "request_id"), _dict(data, "reservation"), _ints(data, "first_blocks"))


@dataclass(frozen=True)
class StagePoolStoreReply:
    ok: bool  # False: this stage has no pool staging free now

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok}

    @classmethod
    def from_dict(cls, data: Any) -> StagePoolStoreReply:
        return cls(_flag(data, "ok"))


@dataclass(frozen=True)
class StagePoolStoreEnd:
    """Answer (``StagePoolStoreEndReply``) once this stage's writes of the request have settled."""

    OP: ClassVar[str] = "stage_pool_store_end"
    request_id: str
    commit: bool

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP, "request_id": self.request_id, "commit": self.commit}

    @classmethod
    def from_dict(cls, data: Any) -> StagePoolStoreEnd:
        return cls(_str(data, "request_id"), _flag(data, "commit"))


@dataclass(frozen=True)
class StagePoolStoreEndReply:
    """With ``commit``, each object's checksums of this stage's parts; None: not every part was
    written (or a write failed), or no commit."""

    checksums: list[list[int]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"checksums": self.checksums}

    @classmethod
    def from_dict(cls, data: Any) -> StagePoolStoreEndReply:
        sums = _field(data, "checksums")
        if sums is not None and (not isinstance(sums, list) or not all(_naturals(s) for s in sums)):
            raise BadRequest("checksums must be a list of lists of non-negative integers")
        return cls(sums)


@dataclass(frozen=True)
class StagePing:
    """Each end of a pipeline group checks the other is alive with this call, every ``PING_S``."""

    OP: ClassVar[str] = "stage_ping"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.OP}

    @classmethod
    def from_dict(cls, data: Any) -> StagePing:
        if not isinstance(data, dict):
            raise BadRequest("the body must be a JSON object")
        return cls()
