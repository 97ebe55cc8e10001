"""What crosses between the Conductor and the instances (and between CPP stages), in one place.

* the **messages**: JSON forms of requests (token ids plus sampling parameters: the Conductor
  tokenizes once) and of outputs (``RequestOutput`` deltas, one JSON object per line on a
  streaming response); prefix keys travel as hex;
* the **signed envelope** every control request travels in (below).

Signed control requests: the cluster secret proves who sent a request without travelling.

The cluster secret used to go on every control call as a bearer token, so anyone who could read
control traffic between hosts learned the key of the KV Messenger as well. Now the secret never
leaves the process:

* ``derive_key`` turns it into one key per purpose (HKDF-SHA256, RFC 5869): ``"control"`` signs
  HTTP control requests, ``"messenger"`` keys the transfer engine's handshake. A key seen or
  broken in one role tells nothing about the other, nor about the secret.
* ``sign`` adds four headers to a request: a timestamp, a random nonce, the SHA-256 of the body,
  and an HMAC-SHA256 over the method, the request target (path and query, as sent), the
  timestamp, the nonce and the body digest.
* ``ControlVerifier`` checks them on the receiving side and refuses a request that was altered,
  is older or newer than ``max_skew_s``, or was already seen (a replay).

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
import secrets
import threading
import time
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any

import httpx

from engine.outputs import RequestOutput
from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from starlette.requests import Request


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def params_from_dict(data: Any) -> SamplingParams:
    return SamplingParams.from_dict(data)


def output_to_dict(out: RequestOutput) -> dict[str, Any]:
    d = dataclasses.asdict(out)
    d["sampler_state"] = None if out.sampler_state is None else base64.b64encode(out.sampler_state).decode()
    return d


def _logprobs(lp: dict[str, Any]) -> Logprobs:
    return Logprobs(lp["token_id"], lp["logprob"], [tuple(t) for t in lp["top"]])


def output_from_dict(d: dict[str, Any]) -> RequestOutput:
    d = dict(d)
    d["logprobs"] = [_logprobs(lp) for lp in d.get("logprobs", [])]
    if d.get("prompt_logprobs") is not None:
        d["prompt_logprobs"] = [None if lp is None else _logprobs(lp) for lp in d["prompt_logprobs"]]
    state = d.get("sampler_state")
    d["sampler_state"] = None if state is None else base64.b64decode(state)
    return RequestOutput(**d)


def token_ids(value: Any, name: str = "prompt_token_ids") -> list[int]:
    if not isinstance(value, list) or not value or not all(type(t) is int and t >= 0 for t in value):
        raise ValueError(f"{name} must be a non-empty list of non-negative integers")
    return value


# Every control call carries the Conductor's epoch: its start time in nanoseconds, so a Conductor
# started later (a restart) is newer, and instances release what an older one reserved.
EPOCH_HEADER = "X-Conductor-Epoch"


CONTROL = "control"
MESSENGER = "messenger"

TIMESTAMP_HEADER = "X-Mooncake-Timestamp"
NONCE_HEADER = "X-Mooncake-Nonce"
DIGEST_HEADER = "X-Mooncake-Content-SHA256"
SIGNATURE_HEADER = "X-Mooncake-Signature"

# Fixed, public salt: HKDF's extract step only needs it to be independent of the secret.
_SALT = b"mooncake-py/cluster-secret/v1"
# Versioned so a future change of the signed fields cannot be confused with this one.
_SIGNATURE_LABEL = b"mooncake-py/control-request/v1"
_NONCE_BYTES = 16


class ControlAuthError(Exception):
    """A control request is not signed with the cluster's control key (or is stale, or a replay)."""


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


def _canonical(method: str, target: str, timestamp: str, nonce: str, digest: str) -> bytes:
    # Newline-joined: the timestamp, nonce and digest are validated to hold none, and neither can
    # an HTTP method or request target, so every field list has exactly one encoding.
    return b"\n".join(
        [_SIGNATURE_LABEL, method.upper().encode(), target.encode(), timestamp.encode(),
         nonce.encode(), digest.encode()]
    )


def _mac(key: bytes, canonical: bytes) -> str:
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path_with_query: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """Headers that authenticate one request: ``path_with_query`` is the request target exactly
    as it goes on the wire (percent-encoded path, then ``?query`` if any)."""
    if "\n" in method or "\n" in path_with_query:
        raise ValueError("a method or request target cannot contain a newline")
    timestamp = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(_NONCE_BYTES)
    digest = hashlib.sha256(body).hexdigest()
    return {
        TIMESTAMP_HEADER: timestamp,
        NONCE_HEADER: nonce,
        DIGEST_HEADER: digest,
        SIGNATURE_HEADER: _mac(key, _canonical(method, path_with_query, timestamp, nonce, digest)),
    }


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


class ControlVerifier:
    """Checks signed control requests and remembers their nonces to refuse replays.

    A nonce is remembered until its timestamp leaves the ``±max_skew_s`` window (after which the
    timestamp check alone refuses it), so memory is bounded by the request rate times twice the
    window. Only requests whose signature verified are remembered: a sender without the key
    cannot fill the table. Safe to share between threads.
    """

    def __init__(self, key: bytes, max_skew_s: float = 30.0, clock: Callable[[], float] = time.time):
        if not key:
            raise ValueError("the control key is empty")
        if max_skew_s <= 0:
            raise ValueError(f"max_skew_s must be positive, got {max_skew_s}")
        self._key = key
        self.max_skew_s = max_skew_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap of (forget at, nonce)

    def verify(self, method: str, path_with_query: str, headers: Mapping[str, str], body: bytes) -> None:
        """Raise ``ControlAuthError`` unless the request is signed with the key, unaltered, fresh
        and not seen before. ``headers``: a case-insensitive mapping (starlette or httpx
        ``Headers``) or the dict ``sign`` returned."""
        fields = {name: headers.get(name) for name in
                  (TIMESTAMP_HEADER, NONCE_HEADER, DIGEST_HEADER, SIGNATURE_HEADER)}
        missing = [name for name, value in fields.items() if not value]
        if missing:
            raise ControlAuthError(f"unsigned control request: missing {', '.join(missing)}")
        timestamp, nonce = fields[TIMESTAMP_HEADER], fields[NONCE_HEADER]
        digest, signature = fields[DIGEST_HEADER], fields[SIGNATURE_HEADER]
        if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
            raise ControlAuthError(f"malformed {TIMESTAMP_HEADER}: expected integer Unix seconds")
        if not _is_hex(nonce, 2 * _NONCE_BYTES):
            raise ControlAuthError(f"malformed {NONCE_HEADER}: expected {2 * _NONCE_BYTES} hex digits")
        if not _is_hex(digest, 64) or not _is_hex(signature, 64):
            raise ControlAuthError("malformed body digest or signature: expected 64 hex digits")
        if "\n" in method or "\n" in path_with_query:
            raise ControlAuthError("a method or request target cannot contain a newline")

        expected = _mac(self._key, _canonical(method, path_with_query, timestamp, nonce, digest))
        if not hmac.compare_digest(signature, expected):
            raise ControlAuthError("bad signature: the request was not signed with the cluster's "
                                   "control key, or was altered on the way")
        if not hmac.compare_digest(digest, hashlib.sha256(body).hexdigest()):
            raise ControlAuthError("the body does not match its signed SHA-256 digest")
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

    @property
    def remembered_nonces(self) -> int:
        """How many nonces are held for replay detection (for tests and stats)."""
        return len(self._seen)


class ControlAuth(httpx.Auth):
    """Signs every request of an ``httpx.Client`` / ``httpx.AsyncClient`` with the control key:
    ``httpx.AsyncClient(auth=ControlAuth(derive_key(secret, CONTROL)))``."""

    # httpx reads a streamed body into memory before calling auth_flow, so its digest can be signed.
    requires_request_body = True

    def __init__(self, key: bytes):
        if not key:
            raise ValueError("the control key is empty")
        self._key = key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        target = request.url.raw_path.decode("ascii")
        request.headers.update(sign(self._key, request.method, target, request.content))
        yield request


def request_target(scope: Mapping) -> str:
    """The request target of an ASGI ``scope`` as the client sent it (raw path, then query)."""
    raw = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return (raw + b"?" + query if query else raw).decode("latin-1")


async def verify_request(verifier: ControlVerifier, request: Request) -> str | None:
    """Why ``request`` is refused, or None when it is properly signed. Call it inside the route
    with the route's own ``Request``: the body read here is cached on it for the route to read
    again (a middleware's ``Request`` is another object and would consume the body)."""
    body = await request.body()
    try:
        verifier.verify(request.method, request_target(request.scope), request.headers, body)
    except ControlAuthError as e:
        return str(e)
    return None
