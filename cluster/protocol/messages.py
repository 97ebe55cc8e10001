"""Conductor <-> instance: outputs on the wire, the requests and their answers, polls and
registration."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from cluster.protocol.errors import BadRequest, InstanceFailed, ProtocolError, error_from
from cluster.protocol.fields import (
    _bytes, _dest, _dict, _field, _flag, _int, _ints, _keys, _naturals, _number, _params, _salt, _str, _strings, _text, _unbytes, token_ids,
)
from engine.outputs import Logprobs, RequestOutput
from engine.sampling_params import SamplingParams
from engine.session import SessionHint


# -- outputs ------------------------------------------------------------------------------------------

def output_to_dict(out: RequestOutput) -> dict[str, Any]:
    d = dataclasses.asdict(out)
    d["sampler_state"] = _bytes(out.sampler_state)
    return d


def _logprobs(lp: dict[str, Any]) -> Logprobs:
    return Logprobs(lp["token_id"], lp["logprob"], [tuple(t) for t in lp["top"]])


def output_from_dict(d: Any) -> RequestOutput:
    """A ``RequestOutput`` from its JSON form; raises ``BadRequest`` for anything else."""
    try:
        d = dict(d)
        d["logprobs"] = [_logprobs(lp) for lp in d.get("logprobs", [])]
        if d.get("prompt_logprobs") is not None:
            d["prompt_logprobs"] = [None if lp is None else _logprobs(lp) for lp in d["prompt_logprobs"]]
        d["sampler_state"] = _unbytes(d.get("sampler_state"), "sampler_state")
        return RequestOutput(**d)
    except (KeyError, TypeError, ValueError) as e:
        raise BadRequest(f"malformed output: {e}") from None


def stream_line(item: RequestOutput | ProtocolError) -> bytes:
    """One line of a streamed answer: an output delta, or the error that ended the stream."""
    data = item.to_dict() if isinstance(item, ProtocolError) else output_to_dict(item)
    return (json.dumps(data) + "\n").encode()


def read_stream_line(line: str) -> RequestOutput:
    """The output delta on ``line``; raises the error the instance ended its stream with, or
    ``InstanceFailed`` for a line that is neither (the instance's fault, not the request's)."""
    try:
        data = json.loads(line)
    except ValueError:
        raise InstanceFailed(f"malformed stream line: {line[:100]!r}") from None
    if isinstance(data, dict) and "error" in data:
        raise error_from(InstanceFailed.status, data)
    try:
        return output_from_dict(data)
    except BadRequest as e:
        raise InstanceFailed(f"malformed stream line: {e}") from None


# -- Conductor -> instance: requests and their answers ------------------------------------------------

def _prompt(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            session: SessionHint | None) -> dict[str, Any]:
    """The fields every request about a prompt starts with (``session``: only when hinted)."""
    d = {"request_id": request_id, "prompt_token_ids": prompt_token_ids, "params": dataclasses.asdict(params)}
    if session is not None:
        d["session"] = session.to_dict()
    return d


def _session(data: Any) -> SessionHint | None:
    try:
        return SessionHint.from_dict(data.get("session"))
    except ValueError as e:
        raise BadRequest(f"session: {e}") from None


@dataclass(frozen=True)
class ReserveRequest:
    """``POST /instance/reserve``: hold blocks and receive staging for a prompt's KV (a lease)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session: SessionHint | None = None  # its KV is retained for the session's next turn

    def to_dict(self) -> dict[str, Any]:
        return _prompt(self.request_id, self.prompt_token_ids, self.params, self.session)

    @classmethod
    def from_dict(cls, data: Any) -> ReserveRequest:
        return cls(_str(data, "request_id"), token_ids(_field(data, "prompt_token_ids")), _params(data),
                   _session(data))


@dataclass(frozen=True)
class ReserveReply:
    """Where to write the prompt's KV: a ``KVDestination.to_dict()``, relayed by the Conductor."""

    dest: dict[str, Any]

    @property
    def num_blocks(self) -> int:
        return self.dest["num_blocks"]

    def to_dict(self) -> dict[str, Any]:
        return {"dest": self.dest}

    @classmethod
    def from_dict(cls, data: Any) -> ReserveReply:
        return cls(_dest(data))


@dataclass(frozen=True)
class RenewRequest:
    """``POST /instance/renew``: extend the leases of these reservations."""

    request_ids: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"request_ids": self.request_ids}

    @classmethod
    def from_dict(cls, data: Any) -> RenewRequest:
        return cls(_strings(data, "request_ids"))


@dataclass(frozen=True)
class RenewReply:
    """The ids the instance no longer holds (released or expired)."""

    gone: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"gone": self.gone}

    @classmethod
    def from_dict(cls, data: Any) -> RenewReply:
        return cls(_strings(data, "gone"))


@dataclass(frozen=True)
class AbortRequest:
    """``POST /instance/abort``: drop a request wherever it is (idempotent). ``writes_done``: no
    KV write into its reservation can still be in flight, so its staging is reused at once."""

    request_id: str
    writes_done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "writes_done": self.writes_done}

    @classmethod
    def from_dict(cls, data: Any) -> AbortRequest:
        return cls(_str(data, "request_id"), _flag(data, "writes_done"))


@dataclass(frozen=True)
class AbortReply:
    aborted: str

    def to_dict(self) -> dict[str, Any]:
        return {"aborted": self.aborted}

    @classmethod
    def from_dict(cls, data: Any) -> AbortReply:
        return cls(_str(data, "aborted"))


@dataclass(frozen=True)
class PrefillRequest:
    """``POST /instance/prefill``: compute the prompt and stream its KV into ``dest`` (a decode
    instance's reservation)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    dest: dict[str, Any]
    session: SessionHint | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**_prompt(self.request_id, self.prompt_token_ids, self.params, self.session), "dest": self.dest}

    @classmethod
    def from_dict(cls, data: Any) -> PrefillRequest:
        r = ReserveRequest.from_dict(data)
        return cls(r.request_id, r.prompt_token_ids, r.params, _dest(data), r.session)


@dataclass(frozen=True)
class PrefillReply:
    """The first token's output, once every layer's KV has been written (``finish_reason``
    ``"handoff"``: the decode instance goes on; anything else: the request ended here)."""

    output: RequestOutput

    def to_dict(self) -> dict[str, Any]:
        return {"output": output_to_dict(self.output)}

    @classmethod
    def from_dict(cls, data: Any) -> PrefillReply:
        return cls(output_from_dict(_dict(data, "output")))


@dataclass(frozen=True)
class Prefilled:
    """What a decode instance continues from: the first token its prefill sampled, how many prompt
    tokens were cached there, and the sampler's state (a seeded generator's, or None)."""

    first_token: int
    num_cached_tokens: int = 0
    sampler_state: bytes | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"first_token": self.first_token, "num_cached_tokens": self.num_cached_tokens,
                "sampler_state": _bytes(self.sampler_state)}

    @classmethod
    def from_dict(cls, data: Any) -> Prefilled:
        if not isinstance(data, dict):
            raise BadRequest("prefilled must be a JSON object")
        return cls(_int(data, "first_token"), _int(data, "num_cached_tokens", 0),
                   _unbytes(data.get("sampler_state"), "sampler_state"))


@dataclass(frozen=True)
class GenerateRequest:
    """``POST /instance/generate``: stream a request's outputs as NDJSON (``stream_line``). With
    ``prefilled``, a decode instance continues a reservation whose KV has landed; without, a
    ``both`` instance serves the whole request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefilled: Prefilled | None = None
    session: SessionHint | None = None

    def to_dict(self) -> dict[str, Any]:
        d = _prompt(self.request_id, self.prompt_token_ids, self.params, self.session)
        if self.prefilled is not None:
            d["prefilled"] = self.prefilled.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Any) -> GenerateRequest:
        r = ReserveRequest.from_dict(data)
        prefilled = _dict(data, "prefilled", optional=True)
        return cls(r.request_id, r.prompt_token_ids, r.params,
                   None if prefilled is None else Prefilled.from_dict(prefilled), r.session)


@dataclass(frozen=True)
class PushRequest:
    """``POST /instance/push`` (on a prefix's holder): write the cached blocks of this prefix that
    ``dest`` asks for into another instance's reservation (hot-prefix replication)."""

    request_id: str
    prompt_token_ids: list[int]
    dest: dict[str, Any]
    cache_salt: str | None = None  # the salt the prefix is cached under there

    def to_dict(self) -> dict[str, Any]:
        d = {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids, "dest": self.dest}
        return d if self.cache_salt is None else {**d, "cache_salt": self.cache_salt}

    @classmethod
    def from_dict(cls, data: Any) -> PushRequest:
        return cls(_str(data, "request_id"), token_ids(_field(data, "prompt_token_ids")), _dest(data), _salt(data))


@dataclass(frozen=True)
class PushReply:
    pushed: int  # blocks written

    def to_dict(self) -> dict[str, Any]:
        return {"pushed": self.pushed}

    @classmethod
    def from_dict(cls, data: Any) -> PushReply:
        return cls(_int(data, "pushed"))


@dataclass(frozen=True)
class AdoptRequest:
    """``POST /instance/adopt`` (on the push's target): keep the received blocks as cached prefix
    (``ok``), or drop the reservation (the push failed)."""

    request_id: str
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "ok": self.ok}

    @classmethod
    def from_dict(cls, data: Any) -> AdoptRequest:
        return cls(_str(data, "request_id"), _flag(data, "ok"))


@dataclass(frozen=True)
class AdoptReply:
    adopted: int  # blocks now cached under the prompt's keys

    def to_dict(self) -> dict[str, Any]:
        return {"adopted": self.adopted}

    @classmethod
    def from_dict(cls, data: Any) -> AdoptReply:
        return cls(_int(data, "adopted"))


@dataclass(frozen=True)
class PrestageRequest:
    """``POST /instance/prestage``: bring a session's last turn (its prompt and output) up from
    the pool's SSD tiers to DRAM before its next turn (``PoolIO.prestage``)."""

    token_ids: list[int]
    session: SessionHint
    cache_salt: str | None = None  # the salt the turn was cached under

    def to_dict(self) -> dict[str, Any]:
        d = {"token_ids": self.token_ids, "session": self.session.to_dict()}
        return d if self.cache_salt is None else {**d, "cache_salt": self.cache_salt}

    @classmethod
    def from_dict(cls, data: Any) -> PrestageRequest:
        session = _session(data)
        if session is None:
            raise BadRequest("session is required")
        return cls(token_ids(_field(data, "token_ids")), session, _salt(data))


@dataclass(frozen=True)
class PrestageReply:
    promoted: int  # pool objects brought up to DRAM

    def to_dict(self) -> dict[str, Any]:
        return {"promoted": self.promoted}

    @classmethod
    def from_dict(cls, data: Any) -> PrestageReply:
        return cls(_int(data, "promoted"))


# -- polls and registration -------------------------------------------------------------------------

_ROLES = ("prefill", "decode", "both")
SWITCHABLE_ROLES = ("prefill", "decode")  # the roles an elastic instance moves between


@dataclass(frozen=True)
class SwitchRoleRequest:
    """``POST /instance/role`` (a Conductor started with ``--elastic-roles``): serve ``role`` from
    now on. The instance stops taking new work, drains what it holds, then changes role; a drain
    longer than ``drain_s`` gives up and it serves its old role again."""

    role: str
    drain_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "drain_s": self.drain_s}

    @classmethod
    def from_dict(cls, data: Any) -> SwitchRoleRequest:
        role, drain_s = _str(data, "role"), _number(data, "drain_s")
        if role not in SWITCHABLE_ROLES:
            raise BadRequest(f"an instance switches to one of {', '.join(SWITCHABLE_ROLES)}, not {role!r}")
        if not drain_s > 0:
            raise BadRequest(f"drain_s must be positive, got {drain_s}")
        return cls(role, drain_s)


@dataclass(frozen=True)
class SwitchRoleReply:
    """The instance's role now and, while it drains, the role it is switching to (else None)."""

    role: str
    switching_to: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "switching_to": self.switching_to}

    @classmethod
    def from_dict(cls, data: Any) -> SwitchRoleReply:
        return cls(_str(data, "role"), _str(data, "switching_to", optional=True))


@dataclass(frozen=True)
class PoolNaming:
    """How an instance names a prompt's KVCache pool objects, for the Conductor to look them up.
    ``namespace`` (``PoolGeometry.namespace``) hashes the weights' digest, their precision and
    quantization, and the KV layout: instances that would compute different KV never share it."""

    namespace: str
    blocks_per_object: int

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "blocks_per_object": self.blocks_per_object}

    @classmethod
    def from_dict(cls, data: Any) -> PoolNaming:
        return cls(_str(data, "namespace"), _int(data, "blocks_per_object"))


@dataclass(frozen=True)
class InstanceInfo:
    """``GET /instance/info`` (polled once per incarnation): who the instance is and what does
    not change while it runs. ``layout``: its ``KVLayout.to_dict()``; ``profile``: its calibrated
    ``InstanceProfile.to_dict()``; ``pool``: None outside a KVCache pool. ``weights``: the digest
    of the model's weights (``cluster.pool.config.weights_digest``); ``dtype`` and
    ``quantization``: the precision it computes in (``EngineConfig``'s, resolved);
    ``deterministic``: whether it runs the engine's deterministic mode (whose answers hold only over
    KV computed that way). Instances that differ in any of these, or in their KV layout, must not
    exchange KV (``misfit``)."""

    instance_id: str
    role: str
    pid: int
    max_model_len: int
    layout: dict[str, Any]
    profile: dict[str, Any]
    pool: PoolNaming | None = None
    weights: str = ""
    dtype: str = ""
    quantization: str = ""
    deterministic: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "role": self.role, "pid": self.pid,
                "max_model_len": self.max_model_len, "layout": self.layout, "profile": self.profile,
                "pool": None if self.pool is None else self.pool.to_dict(), "weights": self.weights,
                "dtype": self.dtype, "quantization": self.quantization, "deterministic": self.deterministic}

    @classmethod
    def from_dict(cls, data: Any) -> InstanceInfo:
        role = _str(data, "role")
        if role not in _ROLES:
            raise BadRequest(f"role must be one of {', '.join(_ROLES)}")
        pool = _dict(data, "pool", optional=True)
        return cls(_str(data, "instance_id"), role, _int(data, "pid"), _int(data, "max_model_len"),
                   _dict(data, "layout"), _dict(data, "profile"), None if pool is None else PoolNaming.from_dict(pool),
                   *(_text(data, name) for name in ("weights", "dtype", "quantization")),
                   _flag(data, "deterministic"))

    def misfit(self, other: InstanceInfo) -> str | None:
        """Why this instance cannot serve in one cluster with ``other`` (its KV would be
        meaningless there, or its pool objects another model's), or None when it fits."""
        why = [f"{name} {mine!r} (the cluster's: {theirs!r})" for name, mine, theirs in
               [("weights", self.weights, other.weights), ("dtype", self.dtype, other.dtype),
                ("quantization", self.quantization, other.quantization),
                ("deterministic", self.deterministic, other.deterministic)] if mine != theirs]
        keys = sorted(set(self.layout) | set(other.layout))
        why += [f"KV layout {k} {self.layout.get(k)!r} (the cluster's: {other.layout.get(k)!r})"
                for k in keys if self.layout.get(k) != other.layout.get(k)]
        if self.pool is not None and other.pool is not None and self.pool != other.pool:
            why.append(f"pool naming {self.pool.to_dict()} (the cluster's: {other.pool.to_dict()})")
        return "; ".join(why) or None


@dataclass(frozen=True)
class CacheDelta:
    """An instance's cached prefix keys at ``version``: all of them (``full``) for a poller that
    is new or too far behind, else the changes since the poller's version (``added``, then
    ``removed``). Keys travel as hex."""

    version: int
    full: list[bytes] | None = None
    added: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        if self.full is not None:
            return {"cache_version": self.version, "cached_keys": [k.hex() for k in self.full]}
        return {"cache_version": self.version, "cached_added": [k.hex() for k in self.added],
                "cached_removed": [k.hex() for k in self.removed]}

    @classmethod
    def from_dict(cls, data: Any) -> CacheDelta:
        version = _int(data, "cache_version")
        if _field(data, "cached_keys") is not None:
            return cls(version, _keys(data, "cached_keys"))
        return cls(version, None, _keys(data, "cached_added"), _keys(data, "cached_removed"))


@dataclass(frozen=True)
class ConductorWork:
    """What one Conductor's requests make an instance do now, as the instance counts it: the
    prefills queued or running there as (age s, prompt tokens, of them cached), the decodes
    running there as (age s, prompt tokens, context tokens now), and the prompts of the KV
    reservations whose KV is still on its way. Every Conductor books its own requests exactly
    (``cluster/conductor/ledger.py``) and adds what the instance reports of the others':
    so N Conductors in front of one instance see its whole load, not 1/N of it."""

    prefills: list[tuple[float, int, int]] = field(default_factory=list)
    decodes: list[tuple[float, int, int]] = field(default_factory=list)
    incoming: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"prefills": [list(p) for p in self.prefills], "decodes": [list(d) for d in self.decodes],
                "incoming": list(self.incoming)}

    @classmethod
    def from_dict(cls, data: Any) -> ConductorWork:
        return cls(_triples(data, "prefills"), _triples(data, "decodes"), _ints(data, "incoming"))


def _triples(data: Any, name: str) -> list[tuple[float, int, int]]:
    """(seconds, count, count) triples, every one non-negative."""
    value = _field(data, name)
    if not isinstance(value, list) or not all(
            isinstance(t, list) and len(t) == 3 and isinstance(t[0], (int, float)) and not isinstance(t[0], bool)
            and t[0] >= 0 and _naturals(t[1:]) for t in value):
        raise BadRequest(f"{name} must be a list of [seconds, count, count] with none negative")
    return [(float(a), b, c) for a, b, c in value]


_STATE_FIELDS = frozenset({"instance_id", "cache_version", "cached_keys", "cached_added", "cached_removed", "work"})


@dataclass(frozen=True)
class InstanceState:
    """``GET /instance/state?since=VERSION`` (polled every ``poll_interval_s``): the cached prefix
    keys as changes since ``VERSION``, and ``stats``, the instance's own ``/stats`` (engine load,
    blocks, reservations, staging, pool counters). The Conductor shows and totals ``stats`` in its
    ``/stats`` but places by its ledger, never by them, so their keys stay the engine's to name.
    On the wire one flat object, ``stats`` beside the other fields, as an instance's ``/stats``.
    Two of its keys are read by name (``from_dict`` checks them): ``role``, the role it serves now
    (an elastic instance's changes), and ``switching_to``, the role it drains toward.
    Elastic roles also reads the engine's decode step counters (``decode_steps`` and its three
    sums, ``cluster/conductor/elastic.py`` ``StepSlowdown``) where they are there."""

    instance_id: str
    cache: CacheDelta
    stats: dict[str, Any] = field(default_factory=dict)
    work: dict[str, ConductorWork] = field(default_factory=dict)  # by Conductor id (``ConductorWork``)

    @property
    def role(self) -> str | None:
        return self.stats.get("role")

    @property
    def switching_to(self) -> str | None:
        return self.stats.get("switching_to")

    def to_dict(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, **self.stats, **self.cache.to_dict(),
                "work": {conductor: w.to_dict() for conductor, w in self.work.items()}}

    @classmethod
    def from_dict(cls, data: Any) -> InstanceState:
        instance_id, cache = _str(data, "instance_id"), CacheDelta.from_dict(data)
        for name in ("role", "switching_to"):
            if (value := _str(data, name, optional=True)) is not None and value not in _ROLES:
                raise BadRequest(f"{name} must be one of {', '.join(_ROLES)}")
        work = _dict(data, "work", optional=True) or {}
        return cls(instance_id, cache, {k: v for k, v in data.items() if k not in _STATE_FIELDS},
                   {conductor: ConductorWork.from_dict(w) for conductor, w in work.items()})


@dataclass(frozen=True)
class RegisterRequest:
    """``POST /cluster/register`` (on the Conductor), from an instance started with
    ``--conductor`` whenever the Conductor has not polled it for a while: poll me at ``url``.
    An ``instance_id`` the Conductor does not know there is a new incarnation."""

    url: str
    instance_id: str

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "instance_id": self.instance_id}

    @classmethod
    def from_dict(cls, data: Any) -> RegisterRequest:
        url = _str(data, "url")
        if not url.startswith(("http://", "https://")):
            raise BadRequest("url must be http(s)://host:port")
        return cls(url, _str(data, "instance_id"))


@dataclass(frozen=True)
class RegisterReply:
    registered: str  # the url
    up: bool  # the Conductor's poll right after found it up

    def to_dict(self) -> dict[str, Any]:
        return {"registered": self.registered, "up": self.up}

    @classmethod
    def from_dict(cls, data: Any) -> RegisterReply:
        return cls(_str(data, "registered"), _flag(data, "up"))
