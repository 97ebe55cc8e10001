"""The signed envelope of every control request, the signature of every answer to one, and the
Conductor's fence (the package docstring says how it works)."""

from __future__ import annotations

import hashlib
import heapq
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from cluster.protocol.errors import BadRequest, ProtocolError, TooLarge, Unauthorized

if TYPE_CHECKING:
    from starlette.requests import Request


# Every control call carries the calling Conductor's fence (``Fence``), signed.
EPOCH_HEADER = "X-Conductor-Epoch"
_CONDUCTOR_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-[]")
MAX_CONDUCTOR_ID = 64
# An epoch is an etcd revision (an int64) or a start time in nanoseconds (~1.8e18 now): past
# int64 it is no epoch at all.
MAX_EPOCH = (1 << 63) - 1


@dataclass(frozen=True)
class Fence:
    """Which Conductor makes a call, and which incarnation of it: header ``X-Conductor-Epoch`` is
    ``ID/EPOCH`` (a bare ``EPOCH`` is the Conductor with the empty id).

    Several Conductors front the same instances; each has an id of its own (``--conductor-id``,
    by default the address it serves at). An instance keeps each id's reservations apart and
    remembers the newest epoch each id has shown: a newer one (that Conductor restarted) releases
    only that id's older reservations at once, and a call from an older one is refused
    (``WrongEpoch``). The epoch is the revision of the Conductor's claim on its id in etcd
    (``cluster.metadata.membership``), else its start time in nanoseconds: either grows from one
    incarnation to the next."""

    conductor: str
    epoch: int

    def __post_init__(self) -> None:
        if len(self.conductor) > MAX_CONDUCTOR_ID or not set(self.conductor) <= _CONDUCTOR_ID_CHARS:
            raise ValueError(f"a Conductor id is at most {MAX_CONDUCTOR_ID} of the characters A-Z a-z 0-9 . _ : - "
                             f"[ ], got {self.conductor!r}")
        if not 0 <= self.epoch <= MAX_EPOCH:
            raise ValueError(f"an epoch is an integer from 0 to 2**63 - 1, got {self.epoch}")

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


CONTROL = "control"  # what Conductors sign: their calls to instances
INSTANCE = "instance"  # what instances sign: a registration with a Conductor, a stage joining its first
MESSENGER = "messenger"
MEMBERSHIP = "membership"  # the instances' records in etcd (cluster.metadata.membership)

TIMESTAMP_HEADER = "X-Mooncake-Timestamp"
NONCE_HEADER = "X-Mooncake-Nonce"
DIGEST_HEADER = "X-Mooncake-Content-SHA256"
AUDIENCE_HEADER = "X-Mooncake-Audience"
SIGNATURE_HEADER = "X-Mooncake-Signature"
ANSWER_SIGNATURE_HEADER = "X-Mooncake-Answer-Signature"

# Fixed, public salt: HKDF's extract step only needs it to be independent of the secret.
_SALT = b"mooncake-py/cluster-secret/v1"
# Versioned so a change of the signed fields cannot be confused with an earlier one (v2: the
# audience and the epoch are signed too).
_SIGNATURE_LABEL = b"mooncake-py/control-request/v2"
# An instance's answer to one signed call, and each line of a streamed one (``sign_answer``).
_ANSWER_LABEL = b"mooncake-py/instance-answer/v1"
_LINE_LABEL = b"mooncake-py/instance-answer-line/v1"
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
    """A 32-byte key for ``purpose`` (``CONTROL``, ``INSTANCE``, ``MESSENGER``, ``MEMBERSHIP``)
    derived from the cluster secret with HKDF-SHA256; different purposes give unrelated keys."""
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


# -- answers ----------------------------------------------------------------------------------------
#
# An instance signs what it answers a signed call with the instances' key (``INSTANCE``), bound to
# that call: its nonce (random, fresh per call: an answer captured for one call is worth nothing
# for another) and the audience the call was signed for (an instance takes only calls signed for
# its own address, so only it answers one with a 200). A whole answer carries
# ``ANSWER_SIGNATURE_HEADER`` over its status and body; a streamed answer signs each line
# instead, with its index, so that lines cannot be altered, dropped, reordered or spliced from
# another stream (a stream cut short is seen by its reader: the last line says it is the last).


class AnswerAuthError(Exception):
    """An answer is not signed with the cluster's instance key for the call it answers (altered
    on the way, from a process without the secret, or meant for another call)."""


def _answer_mac(key: bytes, nonce: str, audience: str, status: int, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    return _mac(key, b"\n".join([_ANSWER_LABEL, nonce.encode(), audience.encode(), str(status).encode(),
                                 digest.encode()]))


def _line_mac(key: bytes, nonce: str, audience: str, index: int, line: bytes) -> str:
    return _mac(key, b"\n".join([_LINE_LABEL, nonce.encode(), audience.encode(), str(index).encode()]) + b"\n" + line)


def _call_of(request: httpx.Request) -> tuple[str, str]:
    """The nonce and audience a call was signed with (``ControlAuth`` put them there)."""
    nonce = request.headers.get(NONCE_HEADER)
    if not nonce:
        raise AnswerAuthError("the call was not signed, so its answer cannot be checked")
    return nonce, request.headers.get(AUDIENCE_HEADER, "")


class AnswerSigner:
    """What an instance signs its answers with: ``derive_key(secret, INSTANCE)``."""

    def __init__(self, key: bytes) -> None:
        if not key:
            raise ValueError("the instance key is empty")
        self._key = key

    @staticmethod
    def _call(headers: Mapping[str, str]) -> tuple[str, str]:
        # The nonce and audience as the call carried them; malformed ones still get a signature,
        # which no caller's check takes (a caller checks against what it sent itself).
        nonce = headers.get(NONCE_HEADER) or ""
        audience = headers.get(AUDIENCE_HEADER) or ""
        return (nonce if _is_hex(nonce, 2 * _NONCE_BYTES) else "",
                audience if len(audience) <= _MAX_AUDIENCE and _no_newline(audience) else "")

    def answer(self, call_headers: Mapping[str, str], status: int, body: bytes) -> str:
        """``ANSWER_SIGNATURE_HEADER``'s value for the answer ``status`` / ``body`` to the call
        that had ``call_headers``."""
        return _answer_mac(self._key, *self._call(call_headers), status, body)

    def line(self, call_headers: Mapping[str, str], index: int, line: bytes) -> bytes:
        """Line ``index`` (from 0) of a streamed answer, signed: ``MAC SPACE LINE NEWLINE``
        (``line`` without its newline)."""
        mac = _line_mac(self._key, *self._call(call_headers), index, line)
        return mac.encode() + b" " + line + b"\n"


def check_answer(key: bytes, response: httpx.Response) -> None:
    """Raise ``AnswerAuthError`` unless ``response`` (read whole) is signed with the instance
    ``key`` for the call it answers."""
    nonce, audience = _call_of(response.request)
    got = response.headers.get(ANSWER_SIGNATURE_HEADER, "")
    if not _is_hex(got, 64):
        raise AnswerAuthError(f"the answer (HTTP {response.status_code}) carries no signature")
    if not hmac.compare_digest(got, _answer_mac(key, nonce, audience, response.status_code, response.content)):
        raise AnswerAuthError(f"the answer (HTTP {response.status_code}) does not match its signature")


def check_line(key: bytes, request: httpx.Request, index: int, line: str) -> str:
    """Line ``index`` of a streamed answer to ``request`` without its signature; raises
    ``AnswerAuthError`` unless it was signed for that call at that place."""
    nonce, audience = _call_of(request)
    mac, _, payload = line.partition(" ")
    if not _is_hex(mac, 64):
        raise AnswerAuthError(f"line {index} of the stream carries no signature")
    if not hmac.compare_digest(mac, _line_mac(key, nonce, audience, index, payload.encode())):
        raise AnswerAuthError(f"line {index} of the stream does not match its signature")
    return payload
