"""What crosses between the Conductor and the instances (and between CPP stages), in one place.

Both sides use the same definitions, so a field cannot be named or typed differently on the two:

* the **messages**: one dataclass per request body and per answer, each with one
  ``to_dict`` / ``from_dict`` pair (``from_dict`` validates and raises ``BadRequest``, never a
  ``KeyError``). Prompts travel as token ids plus sampling parameters (the Conductor tokenizes
  once); outputs as ``RequestOutput`` deltas, one JSON object per line on a streaming answer.
  What other code owns travels as the plain dict its owner defines, so this module imports none
  of it (the Conductor relays such dicts untouched and never loads the torch-side code that
  reads them): a KV destination (``KVDestination.to_dict()``), a KV layout, a cost profile, a
  stage's peer, a pipeline step (``StageStep``), pool leases and reservations;
* the **errors** an answer can carry, in two kinds (below);
* the **signed envelope** every control request travels in (further below).

Errors. Every refusal is a ``ProtocolError`` with one HTTP status and one ``code``; the answer's
body is ``{"error": message, "code": code}`` (plus ``retry_after`` for ``InstanceBusy``), and the
Conductor's client turns it back into the same class (``error_from``):

=============================  ======  ==========================================================
``RequestError``: this request cannot go on (here); the instance is fine: never marked down
-------------------------------------------------------------------------------------------------
``BadRequest``                 400     a malformed or impossible request (also a ``ValueError``)
``UnknownReservation``         404     no reservation by that id: never made, released, expired
``PrefixNotCached``            410     a push's prefix blocks are no longer (all) cached there
``TooLarge``                   413     the body is over the route's cap (read no further)
``KVWriteFailed``              424     a KV write to *another* instance failed
``InstanceBusy``               429     too many waiting, or no staging free now (Retry-After)
``NoKVRoom``                   507     no room for the request's KV now; the next one may have it
-------------------------------------------------------------------------------------------------
``InstanceUnavailable``: this instance is not healthy: the Conductor marks it down
-------------------------------------------------------------------------------------------------
``Unauthorized``               401     the call's signature was refused (a wrong cluster secret)
``WrongEpoch``                 409     the instance serves a newer Conductor than the caller
``InstanceFailed``             500     the engine failed while serving the request
``Unreachable``                502     no answer: connection refused or broken (client side)
``InstanceNotReady``           503     starting (``fatal``: its engine will never load)
``TimedOut``                   504     no answer in time (client side)
=============================  ======  ==========================================================

``Unreachable`` and ``TimedOut`` are raised by the client when no answer came; no instance sends
them. A status without a known ``code`` maps by the status; an unknown status is an
``InstanceFailed``.

Signed control requests: the cluster secret proves who sent a request without travelling.

The cluster secret used to go on every control call as a bearer token, so anyone who could read
control traffic between hosts learned the key of the KV Messenger as well. Now the secret never
leaves the process:

* ``derive_key`` turns it into one key per purpose (HKDF-SHA256, RFC 5869): ``"control"`` signs
  HTTP control requests, ``"messenger"`` keys the transfer engine's handshake. A key seen or
  broken in one role tells nothing about the other, nor about the secret.
* ``sign`` adds headers to a request: a timestamp, a random nonce, the SHA-256 of the body, the
  audience (the ``host:port`` the request is sent to), and an HMAC-SHA256 over the method, the
  request target (path and query, as sent), the timestamp, the nonce, the body digest, the
  audience and the Conductor's epoch (``X-Conductor-Epoch``, empty when the call carries none).
* ``ControlVerifier`` checks them on the receiving side and refuses a request that was altered
  (its epoch included), is older or newer than ``max_skew_s``, was already seen (a replay), or was
  signed for another audience than the addresses the verifier is reached by (a call captured on
  its way to one instance and replayed to another).

Everything but the body's bytes is in the headers, so ``verify_request`` checks the signature
*before* reading any body: an unsigned request is refused (401) without a byte of its body read,
and a signed one is read, streaming, only up to its route's cap (413 ``TooLarge`` for a
Content-Length above it at once, or as soon as more arrives), then checked against its digest.

``ControlAuth`` signs every request an ``httpx`` client sends; ``verify_request`` checks a
starlette request inside a route. Only requests are authenticated; responses are not, and nothing
is encrypted (prompts and outputs are readable on the wire), so hosts should still talk over a
trusted network or TLS.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import heapq
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import httpx

from engine.outputs import Logprobs, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from starlette.requests import Request


# -- errors -------------------------------------------------------------------------------------------

class ProtocolError(Exception):
    """An answer that is not a result: its class names why, ``status`` and ``code`` how it travels."""

    status: ClassVar[int]
    code: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {"error": str(self), "code": self.code}


class RequestError(ProtocolError):
    """This request cannot go on (on this instance); says nothing against the instance."""


class InstanceUnavailable(ProtocolError):
    """This instance is not healthy (no answer, no answer in time, failing, or serving another
    Conductor): the caller marks it down."""


class BadRequest(RequestError, ValueError):
    """Malformed or impossible; a ``ValueError`` too, so the client of the cluster gets a 400."""

    status, code = 400, "bad_request"


class UnknownReservation(RequestError, LookupError):
    """No reservation by that id here: never made, already taken over, released or expired."""

    status, code = 404, "unknown_reservation"


class PrefixNotCached(RequestError):
    """A push asked for prefix blocks the holder no longer (all) caches."""

    status, code = 410, "prefix_not_cached"


class TooLarge(RequestError):
    """The body is larger than the route takes (refused without reading it all)."""

    status, code = 413, "too_large"


class KVWriteFailed(RequestError):
    """A KV write to another instance failed: nothing against the one that answers this."""

    status, code = 424, "kv_write_failed"


class InstanceBusy(RequestError):
    """Too many requests waiting, or no staging free, right now: try again after ``retry_after``."""

    status, code = 429, "busy"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "retry_after": self.retry_after}


class NoKVRoom(RequestError):
    """No room for the request's KV on the instance now; another instance may have it."""

    status, code = 507, "no_kv_room"


class Unauthorized(InstanceUnavailable):
    """The instance refused the call's signature: it holds another cluster secret."""

    status, code = 401, "unauthorized"


class WrongEpoch(InstanceUnavailable):
    """The instance has seen a newer Conductor than the caller and serves only that one."""

    status, code = 409, "wrong_epoch"


class InstanceFailed(InstanceUnavailable):
    """The instance's engine failed while serving the request."""

    status, code = 500, "instance_failed"


class Unreachable(InstanceUnavailable):
    """No answer: the connection was refused or broke (raised by the client)."""

    status, code = 502, "unreachable"


class InstanceNotReady(InstanceUnavailable):
    """The instance answers but is starting; ``fatal``: its engine could not load, and it never will."""

    status, code = 503, "not_ready"

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "fatal": self.fatal}


class TimedOut(InstanceUnavailable):
    """No answer within the call's timeout (raised by the client)."""

    status, code = 504, "timed_out"


ERRORS: tuple[type[ProtocolError], ...] = (
    BadRequest, UnknownReservation, PrefixNotCached, TooLarge, KVWriteFailed, InstanceBusy, NoKVRoom,
    Unauthorized, WrongEpoch, InstanceFailed, Unreachable, InstanceNotReady, TimedOut)
_BY_CODE = {cls.code: cls for cls in ERRORS}
_BY_STATUS = {cls.status: cls for cls in ERRORS}


def error_from(status: int, body: Any, retry_after: str | None = None, context: str = "") -> ProtocolError:
    """The error an answer with ``status`` and JSON ``body`` (None when it was not JSON) carries:
    by its ``code``, else by the status, else ``InstanceFailed``. ``retry_after``: the header;
    ``context``: what the message starts with (the call)."""
    body = body if isinstance(body, dict) else {}
    cls = _BY_CODE.get(body.get("code")) or _BY_STATUS.get(status) or InstanceFailed
    message = context + str(body.get("error") or f"HTTP {status}")
    if cls is InstanceBusy:
        try:
            return InstanceBusy(message, float(body.get("retry_after", retry_after or 1.0)))
        except (TypeError, ValueError):
            return InstanceBusy(message)
    if cls is InstanceNotReady:
        return InstanceNotReady(message, fatal=body.get("fatal") is True)
    return cls(message)


# -- field checks (each raises BadRequest naming the field) ------------------------------------------

def _field(data: Any, name: str) -> Any:
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    return data.get(name)


def _str(data: Any, name: str, optional: bool = False) -> str | None:
    value = _field(data, name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name} must be a non-empty string")
    return value


def _text(data: Any, name: str) -> str:
    """A string that may be empty or missing (then empty)."""
    value = _field(data, name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string")
    return value


def _int(data: Any, name: str, default: int | None = None) -> int:
    value = _field(data, name)
    if value is None and default is not None:
        return default
    if type(value) is not int:
        raise BadRequest(f"{name} must be an integer")
    return value


def _number(data: Any, name: str) -> float:
    value = _field(data, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"{name} must be a number")
    return float(value)


def _dict(data: Any, name: str, optional: bool = False) -> dict[str, Any] | None:
    value = _field(data, name)
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be a JSON object")
    return value


def _strings(data: Any, name: str) -> list[str]:
    value = _field(data, name)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{name} must be a list of strings")
    return value


def _keys(data: Any, name: str) -> list[bytes]:
    """Prefix keys, which travel as hex strings."""
    try:
        return [bytes.fromhex(k) for k in _strings(data, name)]
    except ValueError:
        raise BadRequest(f"{name} must be a list of hex strings") from None


def _naturals(value: Any) -> bool:
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def _ints(data: Any, name: str) -> list[int]:
    value = _field(data, name)
    if not _naturals(value):
        raise BadRequest(f"{name} must be a list of non-negative integers")
    return value


def _flag(data: Any, name: str) -> bool:
    value = _field(data, name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


def token_ids(value: Any, name: str = "prompt_token_ids") -> list[int]:
    if not value or not _naturals(value):
        raise BadRequest(f"{name} must be a non-empty list of non-negative integers")
    return value


def _params(data: Any) -> SamplingParams:
    try:
        return SamplingParams.from_dict(_field(data, "params"))
    except (TypeError, ValueError) as e:
        raise BadRequest(f"params: {e}") from None


def _dest(data: Any) -> dict[str, Any]:
    dest = _dict(data, "dest")
    if type(dest.get("num_blocks")) is not int or type(dest.get("skip_blocks")) is not int:
        raise BadRequest("dest must be a KV destination (with num_blocks and skip_blocks)")
    return dest


def _bytes(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _unbytes(value: Any, name: str) -> bytes | None:
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (TypeError, ValueError):
        raise BadRequest(f"{name} must be base64") from None


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

def _prompt(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The fields every request about a prompt starts with."""
    return {"request_id": request_id, "prompt_token_ids": prompt_token_ids, "params": dataclasses.asdict(params)}


@dataclass(frozen=True)
class ReserveRequest:
    """``POST /instance/reserve``: hold blocks and receive staging for a prompt's KV (a lease)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams

    def to_dict(self) -> dict[str, Any]:
        return _prompt(self.request_id, self.prompt_token_ids, self.params)

    @classmethod
    def from_dict(cls, data: Any) -> ReserveRequest:
        return cls(_str(data, "request_id"), token_ids(_field(data, "prompt_token_ids")), _params(data))


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

    def to_dict(self) -> dict[str, Any]:
        return {**_prompt(self.request_id, self.prompt_token_ids, self.params), "dest": self.dest}

    @classmethod
    def from_dict(cls, data: Any) -> PrefillRequest:
        r = ReserveRequest.from_dict(data)
        return cls(r.request_id, r.prompt_token_ids, r.params, _dest(data))


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

    def to_dict(self) -> dict[str, Any]:
        d = _prompt(self.request_id, self.prompt_token_ids, self.params)
        if self.prefilled is not None:
            d["prefilled"] = self.prefilled.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Any) -> GenerateRequest:
        r = ReserveRequest.from_dict(data)
        prefilled = _dict(data, "prefilled", optional=True)
        return cls(r.request_id, r.prompt_token_ids, r.params,
                   None if prefilled is None else Prefilled.from_dict(prefilled))


@dataclass(frozen=True)
class PushRequest:
    """``POST /instance/push`` (on a prefix's holder): write the cached blocks of this prefix that
    ``dest`` asks for into another instance's reservation (hot-prefix replication)."""

    request_id: str
    prompt_token_ids: list[int]
    dest: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids, "dest": self.dest}

    @classmethod
    def from_dict(cls, data: Any) -> PushRequest:
        return cls(_str(data, "request_id"), token_ids(_field(data, "prompt_token_ids")), _dest(data))


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


# -- polls and registration -------------------------------------------------------------------------

_ROLES = ("prefill", "decode", "both")


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
    ``quantization``: the precision it computes in (``EngineConfig``'s, resolved). Instances that
    differ in any of these, or in their KV layout, must not exchange KV (``misfit``)."""

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

    def to_dict(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "role": self.role, "pid": self.pid,
                "max_model_len": self.max_model_len, "layout": self.layout, "profile": self.profile,
                "pool": None if self.pool is None else self.pool.to_dict(), "weights": self.weights,
                "dtype": self.dtype, "quantization": self.quantization}

    @classmethod
    def from_dict(cls, data: Any) -> InstanceInfo:
        role = _str(data, "role")
        if role not in _ROLES:
            raise BadRequest(f"role must be one of {', '.join(_ROLES)}")
        pool = _dict(data, "pool", optional=True)
        return cls(_str(data, "instance_id"), role, _int(data, "pid"), _int(data, "max_model_len"),
                   _dict(data, "layout"), _dict(data, "profile"), None if pool is None else PoolNaming.from_dict(pool),
                   *(_text(data, name) for name in ("weights", "dtype", "quantization")))

    def misfit(self, other: InstanceInfo) -> str | None:
        """Why this instance cannot serve in one cluster with ``other`` (its KV would be
        meaningless there, or its pool objects another model's), or None when it fits."""
        why = [f"{name} {mine!r} (the cluster's: {theirs!r})" for name, mine, theirs in
               [("weights", self.weights, other.weights), ("dtype", self.dtype, other.dtype),
                ("quantization", self.quantization, other.quantization)] if mine != theirs]
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


_STATE_FIELDS = frozenset({"instance_id", "cache_version", "cached_keys", "cached_added", "cached_removed"})


@dataclass(frozen=True)
class InstanceState:
    """``GET /instance/state?since=VERSION`` (polled every ``poll_interval_s``): the cached prefix
    keys as changes since ``VERSION``, and ``stats``, the instance's own ``/stats`` (engine load,
    blocks, reservations, staging, pool counters). The Conductor shows and totals ``stats`` in its
    ``/stats`` but places by its ledger, never by them, so their keys stay the engine's to name.
    On the wire one flat object, ``stats`` beside the other fields, as an instance's ``/stats``."""

    instance_id: str
    cache: CacheDelta
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, **self.stats, **self.cache.to_dict()}

    @classmethod
    def from_dict(cls, data: Any) -> InstanceState:
        instance_id, cache = _str(data, "instance_id"), CacheDelta.from_dict(data)
        return cls(instance_id, cache, {k: v for k, v in data.items() if k not in _STATE_FIELDS})


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


# Every control call carries the calling Conductor's fence (``Fence``), signed.
EPOCH_HEADER = "X-Conductor-Epoch"
_CONDUCTOR_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-[]")
MAX_CONDUCTOR_ID = 64


@dataclass(frozen=True)
class Fence:
    """Which Conductor makes a call, and which incarnation of it: header ``X-Conductor-Epoch`` is
    ``ID/EPOCH`` (a bare ``EPOCH`` is the Conductor with the empty id).

    Several Conductors front the same instances; each has an id of its own (``--conductor-id``,
    by default the address it serves at). An instance keeps each id's reservations apart and
    remembers the newest epoch each id has shown: a newer one (that Conductor restarted) releases
    only that id's older reservations at once, and a call from an older one is refused
    (``WrongEpoch``). The epoch is the revision of the Conductor's claim on its id in etcd
    (``cluster.pool.metadata.membership``), else its start time in nanoseconds: either grows from one
    incarnation to the next."""

    conductor: str
    epoch: int

    def __post_init__(self) -> None:
        if len(self.conductor) > MAX_CONDUCTOR_ID or not set(self.conductor) <= _CONDUCTOR_ID_CHARS:
            raise ValueError(f"a Conductor id is at most {MAX_CONDUCTOR_ID} of the characters A-Z a-z 0-9 . _ : - "
                             f"[ ], got {self.conductor!r}")
        if self.epoch < 0:
            raise ValueError(f"an epoch is >= 0, got {self.epoch}")

    def header(self) -> str:
        return f"{self.conductor}/{self.epoch}" if self.conductor else str(self.epoch)

    @classmethod
    def parse(cls, value: str) -> Fence:
        """The fence a header names; ``BadRequest`` when it is malformed."""
        conductor, _, epoch = value.rpartition("/")
        try:
            if not (epoch.isascii() and epoch.isdigit()):
                raise ValueError("the epoch must be a non-negative integer")
            return cls(conductor, int(epoch))
        except ValueError as e:
            raise BadRequest(f"malformed {EPOCH_HEADER} {value[:100]!r}: {e}") from None


CONTROL = "control"
MESSENGER = "messenger"

TIMESTAMP_HEADER = "X-Mooncake-Timestamp"
NONCE_HEADER = "X-Mooncake-Nonce"
DIGEST_HEADER = "X-Mooncake-Content-SHA256"
AUDIENCE_HEADER = "X-Mooncake-Audience"
SIGNATURE_HEADER = "X-Mooncake-Signature"

# Fixed, public salt: HKDF's extract step only needs it to be independent of the secret.
_SALT = b"mooncake-py/cluster-secret/v1"
# Versioned so a change of the signed fields cannot be confused with an earlier one (v2: the
# audience and the epoch are signed too).
_SIGNATURE_LABEL = b"mooncake-py/control-request/v2"
_NONCE_BYTES = 16
_MAX_AUDIENCE = 300

# Body caps of control routes (``verify_request``'s ``max_body``): a call without a body (a
# poll), a small one (ids, flags), one that carries a prompt (token ids, sampling parameters).
NO_BODY = 4 << 10
SMALL_BODY = 1 << 20
PROMPT_BODY = 32 << 20


class ControlAuthError(Exception):
    """A control request is not signed with the cluster's control key (or is stale, or a replay,
    or signed for another audience)."""


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for ``purpose`` (``CONTROL``, ``MESSENGER``) derived from the cluster secret
    with HKDF-SHA256; different purposes give unrelated keys."""
    if not secret:
        raise ValueError("the cluster secret is empty")
    if not purpose:
        raise ValueError("a key needs a purpose")
    prk = hmac.new(_SALT, secret, hashlib.sha256).digest()  # extract
    info = b"mooncake-py/" + purpose.encode()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()  # expand: one 32-byte block


def audience_of(url: str | httpx.URL) -> str:
    """The audience a request to ``url`` is signed for: its ``host:port``, lower-case, with the
    scheme's default port spelled out (``http://Box`` and ``http://box:80/x`` are one audience)."""
    u = httpx.URL(url) if isinstance(url, str) else url
    if not u.host:
        raise ValueError(f"{str(u)!r} names no host")
    port = u.port or (443 if u.scheme == "https" else 80)
    host = u.host.lower()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _canonical(method: str, target: str, timestamp: str, nonce: str, digest: str, audience: str,
               epoch: str) -> bytes:
    # Newline-joined: the timestamp, nonce, digest, audience and epoch are validated to hold
    # none, and neither can an HTTP method or request target, so every field list has exactly
    # one encoding.
    return b"\n".join(
        [_SIGNATURE_LABEL, method.upper().encode(), target.encode(), timestamp.encode(),
         nonce.encode(), digest.encode(), audience.encode(), epoch.encode()]
    )


def _mac(key: bytes, canonical: bytes) -> str:
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def _no_newline(*fields: str) -> bool:
    return not any("\n" in f or "\r" in f for f in fields)


def sign(key: bytes, method: str, path_with_query: str, body: bytes, now: float | None = None, *,
         audience: str = "", epoch: str = "") -> dict[str, str]:
    """Headers that authenticate one request: ``path_with_query`` is the request target exactly
    as it goes on the wire (percent-encoded path, then ``?query`` if any); ``audience`` the
    ``audience_of`` the URL it is sent to (empty: none, which only a verifier that checks no
    audience takes); ``epoch`` the value of its ``X-Conductor-Epoch`` header (empty: none)."""
    if not _no_newline(method, path_with_query, audience, epoch):
        raise ValueError("a method, request target, audience or epoch cannot contain a newline")
    timestamp = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(_NONCE_BYTES)
    digest = hashlib.sha256(body).hexdigest()
    headers = {TIMESTAMP_HEADER: timestamp, NONCE_HEADER: nonce, DIGEST_HEADER: digest}
    if audience:
        headers[AUDIENCE_HEADER] = audience
    headers[SIGNATURE_HEADER] = _mac(key, _canonical(method, path_with_query, timestamp, nonce, digest,
                                                     audience, epoch))
    return headers


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


class ControlVerifier:
    """Checks signed control requests and remembers their nonces to refuse replays.

    ``audiences``: the addresses this verifier's process is reached by (``audience_of`` its
    advertised URLs, or the URLs themselves); a request signed for any other is refused, so one
    captured on its way to another instance cannot be replayed here. None: no audience is
    checked (only for a service that alone holds its key, like the pool's metadata server).

    A nonce is remembered until its timestamp leaves the ``±max_skew_s`` window (after which the
    timestamp check alone refuses it), so memory is bounded by the request rate times twice the
    window. Only requests whose signature verified are remembered: a sender without the key
    cannot fill the table. Safe to share between threads.
    """

    def __init__(self, key: bytes, max_skew_s: float = 30.0, clock: Callable[[], float] = time.time,
                 audiences: Iterable[str] | None = None):
        if not key:
            raise ValueError("the control key is empty")
        if max_skew_s <= 0:
            raise ValueError(f"max_skew_s must be positive, got {max_skew_s}")
        self._key = key
        self.max_skew_s = max_skew_s
        self._clock = clock
        self.audiences = None if audiences is None else frozenset(
            a if "://" not in a else audience_of(a) for a in audiences)
        if self.audiences is not None and not self.audiences:
            raise ValueError("a verifier bound to audiences needs at least one")
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap of (forget at, nonce)

    def check_headers(self, method: str, path_with_query: str, headers: Mapping[str, str]) -> str:
        """Everything but the body: raise ``ControlAuthError`` unless the headers are signed with
        the key for this audience, fresh and not seen before (the nonce is remembered from here
        on). Returns the body's signed SHA-256 (hex), for ``check_body``. ``headers``: a
        case-insensitive mapping (starlette or httpx ``Headers``) or the dict ``sign`` returned."""
        signed = (TIMESTAMP_HEADER, NONCE_HEADER, DIGEST_HEADER, SIGNATURE_HEADER, AUDIENCE_HEADER, EPOCH_HEADER)
        every = (getattr(headers, "getlist", None) or getattr(headers, "get_list", None)
                 or getattr(headers, "get_all", None))
        if every is not None:
            twice = [name for name in signed if len(every(name) or ()) > 1]
            if twice:  # which one a reader takes is up to it: none is taken
                raise ControlAuthError(f"malformed control request: {', '.join(twice)} more than once")
        fields = {name: headers.get(name) for name in signed[:4]}
        missing = [name for name, value in fields.items() if not value]
        if missing:
            raise ControlAuthError(f"unsigned control request: missing {', '.join(missing)}")
        timestamp, nonce = fields[TIMESTAMP_HEADER], fields[NONCE_HEADER]
        digest, signature = fields[DIGEST_HEADER], fields[SIGNATURE_HEADER]
        audience = headers.get(AUDIENCE_HEADER) or ""
        epoch = headers.get(EPOCH_HEADER) or ""
        if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
            raise ControlAuthError(f"malformed {TIMESTAMP_HEADER}: expected integer Unix seconds")
        if not _is_hex(nonce, 2 * _NONCE_BYTES):
            raise ControlAuthError(f"malformed {NONCE_HEADER}: expected {2 * _NONCE_BYTES} hex digits")
        if not _is_hex(digest, 64) or not _is_hex(signature, 64):
            raise ControlAuthError("malformed body digest or signature: expected 64 hex digits")
        if len(audience) > _MAX_AUDIENCE or len(epoch) > MAX_CONDUCTOR_ID + 30:
            raise ControlAuthError(f"malformed {AUDIENCE_HEADER} or {EPOCH_HEADER}: too long")
        if not _no_newline(method, path_with_query, audience, epoch):
            raise ControlAuthError("a method, request target, audience or epoch cannot contain a newline")

        expected = _mac(self._key, _canonical(method, path_with_query, timestamp, nonce, digest, audience, epoch))
        if not hmac.compare_digest(signature, expected):
            raise ControlAuthError("bad signature: the request was not signed with the cluster's "
                                   "control key, or was altered on the way (its epoch included)")
        if self.audiences is not None and audience not in self.audiences:
            raise ControlAuthError(
                f"signed for another audience: {audience or 'none'!r}, while this is "
                f"{', '.join(sorted(self.audiences))} (a request meant for another process, or "
                "this one is reached by an address it does not advertise)")
        now = self._clock()
        skew = int(timestamp) - now
        if abs(skew) > self.max_skew_s:
            raise ControlAuthError(f"stale or future-dated request: timestamp is {skew:+.0f} s from this "
                                   f"host's clock (allowed ±{self.max_skew_s:g} s); check clock sync")
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._seen:
                raise ControlAuthError("replayed request: this nonce was already used")
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (int(timestamp) + self.max_skew_s, nonce))
        return digest

    @staticmethod
    def check_body(signed_digest: str, body_digest: str) -> None:
        """Raise ``ControlAuthError`` unless the body's SHA-256 (hex) is the signed one."""
        if not hmac.compare_digest(signed_digest, body_digest):
            raise ControlAuthError("the body does not match its signed SHA-256 digest")

    def verify(self, method: str, path_with_query: str, headers: Mapping[str, str], body: bytes) -> None:
        """``check_headers`` then ``check_body`` for a body already in hand."""
        digest = self.check_headers(method, path_with_query, headers)
        self.check_body(digest, hashlib.sha256(body).hexdigest())

    @property
    def remembered_nonces(self) -> int:
        """How many nonces are held for replay detection (for tests and stats)."""
        return len(self._seen)


class ControlAuth(httpx.Auth):
    """Signs every request of an ``httpx.Client`` / ``httpx.AsyncClient`` with the control key:
    ``httpx.AsyncClient(auth=ControlAuth(derive_key(secret, CONTROL)))``. Each request is signed
    for the ``host:port`` it is sent to and with its ``X-Conductor-Epoch`` header (the client's
    default headers included), so neither can be changed on the way."""

    # httpx reads a streamed body into memory before calling auth_flow, so its digest can be signed.
    requires_request_body = True

    def __init__(self, key: bytes):
        if not key:
            raise ValueError("the control key is empty")
        self._key = key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        target = request.url.raw_path.decode("ascii")
        request.headers.update(sign(self._key, request.method, target, request.content,
                                    audience=audience_of(request.url),
                                    epoch=request.headers.get(EPOCH_HEADER, "")))
        yield request


def request_target(scope: Mapping) -> str:
    """The request target of an ASGI ``scope`` as the client sent it (raw path, then query)."""
    raw = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return (raw + b"?" + query if query else raw).decode("latin-1")


async def verify_request(verifier: ControlVerifier, request: Request, max_body: int = SMALL_BODY) -> ProtocolError | None:
    """Why ``request`` is refused (``Unauthorized``; ``TooLarge`` for a body over ``max_body``
    bytes; ``BadRequest`` for a broken Content-Length or a client that left), or None when it is
    properly signed. The signature is checked from the headers before a byte of the body is
    read; then the body is read, streaming, up to ``max_body`` and checked against its signed
    digest. Call it inside the route with the route's own ``Request``: the body read here is
    cached on it for the route to read again (``request.json()``; a middleware's ``Request`` is
    another object and would consume the body)."""
    from starlette.requests import ClientDisconnect

    try:
        digest = verifier.check_headers(request.method, request_target(request.scope), request.headers)
    except ControlAuthError as e:
        return Unauthorized(str(e))
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isascii() or not declared.isdigit():
            return BadRequest("invalid Content-Length header")
        if int(declared) > max_body:
            return TooLarge(f"a body of {declared} bytes is over this route's {max_body} bytes")
    sha, chunks, size = hashlib.sha256(), [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                return TooLarge(f"the body is over this route's {max_body} bytes")
            sha.update(chunk)
            chunks.append(chunk)
    except ClientDisconnect:
        return BadRequest("the client disconnected before sending the whole body")
    try:
        verifier.check_body(digest, sha.hexdigest())
    except ControlAuthError as e:
        return Unauthorized(str(e))
    request._body = b"".join(chunks)  # what ``request.body()`` / ``request.json()`` read from now on
    return None
