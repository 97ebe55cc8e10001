"""The errors an answer can carry, in two kinds: a request that cannot go on, an instance that is
not healthy (the table in the package docstring)."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.engine_client import NotStarted


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


class NotOwner(RequestError):
    """The call names a reservation or request that another Conductor made: only its owner may
    abort, release, adopt or continue it."""

    status, code = 403, "not_owner"


class PrefixNotCached(RequestError):
    """A push asked for prefix blocks the holder no longer (all) caches."""

    status, code = 410, "prefix_not_cached"


class TooLarge(RequestError):
    """The body is larger than the route takes (refused without reading it all)."""

    status, code = 413, "too_large"


class KVWriteFailed(RequestError, NotStarted):
    """A KV write to another instance failed, or what it wrote arrived corrupt: nothing against
    the instance that answers this (nor, raised where the request starts, against its engine)."""

    status, code = 424, "kv_write_failed"


class RequestFailed(RequestError):
    """This request failed inside the engine (its step raised with it alone); the engine and the
    other requests go on. Not moved elsewhere: it would fail there too."""

    status, code = 500, "request_failed"


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


class ForgedAnswer(InstanceUnavailable):
    """An answer that is not signed for the call with the instances' key: ignored (raised by the
    client; a process without the cluster secret, or an answer altered on the way)."""

    status, code = 502, "forged_answer"


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
    # RequestFailed before InstanceFailed: a 500 without a known code is the instance's failure;
    # ForgedAnswer before Unreachable: a 502 without one is no answer.
    BadRequest, UnknownReservation, NotOwner, PrefixNotCached, TooLarge, KVWriteFailed, RequestFailed, InstanceBusy,
    NoKVRoom, Unauthorized, WrongEpoch, InstanceFailed, ForgedAnswer, Unreachable, InstanceNotReady, TimedOut)
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
