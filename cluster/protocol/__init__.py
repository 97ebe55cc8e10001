"""What crosses between the Conductor and the instances (and between CPP stages), in one place.

Both sides use the same definitions, so a field cannot be named or typed differently on the two:

* the **messages**: one dataclass per request body and per answer, each with one
  ``to_dict`` / ``from_dict`` pair (``from_dict`` validates and raises ``BadRequest``, never a
  ``KeyError``). Prompts travel as token ids plus sampling parameters (the server's front end
  tokenizes once); outputs as ``RequestOutput`` deltas, one JSON object per line on a streaming answer.
  What other code owns travels as the plain dict its owner defines, so this package imports none
  of it (the Conductor relays such dicts untouched and never loads the torch-side code that
  reads them): a KV destination (``KVDestination.to_dict()``), a KV layout, a cost profile, a
  stage's peer, a pipeline step (``StageStep``), pool leases and reservations;
* the **errors** an answer can carry, in two kinds (below);
* the **signed envelope** every control request travels in (further below).

One module a part: ``errors.py``, ``fields.py`` (the checks ``from_dict`` makes), ``messages.py``
(Conductor <-> instance), ``stage.py`` (pipeline stages), ``signing.py`` (the envelope and the
Conductor's fence). Import from the package: every public name is here.

Errors. Every refusal is a ``ProtocolError`` with one HTTP status and one ``code``; the answer's
body is ``{"error": message, "code": code}`` (plus ``retry_after`` for ``InstanceBusy``), and the
Conductor's client turns it back into the same class (``error_from``):

=============================  ======  ==========================================================
``RequestError``: this request cannot go on (here); the instance is fine: never marked down
-------------------------------------------------------------------------------------------------
``BadRequest``                 400     a malformed or impossible request (also a ``ValueError``)
``UnknownReservation``         404     no reservation by that id: never made, released, expired
``NotOwner``                   403     the reservation or request is another Conductor's
``PrefixNotCached``            410     a push's prefix blocks are no longer (all) cached there
``TooLarge``                   413     the body is over the route's cap (read no further)
``KVWriteFailed``              424     a KV write to *another* instance failed
``RequestFailed``              500     its engine step failed because of this request alone
``InstanceBusy``               429     too many waiting, or no staging free now (Retry-After)
``NoKVRoom``                   507     no room for the request's KV now; the next one may have it
-------------------------------------------------------------------------------------------------
``InstanceUnavailable``: this instance is not healthy: the Conductor marks it down
-------------------------------------------------------------------------------------------------
``Unauthorized``               401     the call's signature was refused (a wrong cluster secret)
``WrongEpoch``                 409     the instance serves a newer Conductor than the caller
``InstanceFailed``             500     the engine failed while serving the request
``Unreachable``                502     no answer: connection refused or broken (client side)
``ForgedAnswer``               502     an answer not signed for the call (client side, counted)
``InstanceNotReady``           503     starting (``fatal``: its engine will never load)
``TimedOut``                   504     no answer in time (client side)
=============================  ======  ==========================================================

``Unreachable``, ``ForgedAnswer`` and ``TimedOut`` are raised by the client when no answer (that
it can trust) came; no instance sends them. A status without a known ``code`` maps by the status; an unknown status is an
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
starlette request inside a route.

Answers are signed too: an instance signs every answer to a control call with a key of its own
purpose (``"instance"``, ``AnswerSigner``), bound to the call's nonce and audience, a whole answer
in ``X-Mooncake-Answer-Signature`` (over its status and body), a streamed one line by line (each
line with its index). The Conductor's client checks each (``check_answer``, ``check_line``) and
takes one that fails for no answer (``ForgedAnswer``, counted): a process on the path, or one
listed by mistake, cannot put words in an instance's mouth (a fake once sent " Berlin." to 14
clients). Nothing is encrypted (prompts and outputs are readable on the wire), so
hosts should still talk over a trusted network or TLS.
"""

from __future__ import annotations

from cluster.protocol.errors import (
    BadRequest, ERRORS, ForgedAnswer, InstanceBusy, InstanceFailed, InstanceNotReady, InstanceUnavailable,
    KVWriteFailed, NoKVRoom, NotOwner, PrefixNotCached, ProtocolError, RequestError, RequestFailed, TimedOut,
    TooLarge, Unauthorized, UnknownReservation, Unreachable, WrongEpoch, error_from
)
from cluster.protocol.fields import (
    token_ids
)
from cluster.protocol.messages import (
    AbortReply, AbortRequest, AdoptReply, AdoptRequest, CacheDelta, ConductorWork, GenerateRequest, InstanceInfo,
    InstanceState, PoolNaming, PrefillReply, PrefillRequest, Prefilled, PrestageReply, PrestageRequest, PushReply,
    PushRequest,
    RegisterReply, RegisterRequest, RenewReply, RenewRequest, ReserveReply, ReserveRequest, SWITCHABLE_ROLES,
    SwitchRoleReply, SwitchRoleRequest,
    output_from_dict, output_to_dict, read_stream_line, stream_line
)
from cluster.protocol.stage import (
    StageExpect, StageFinish, StageFinishReply, StageJoin, StageLinks, StageLogits, StagePing,
    StagePoolLoad, StagePoolLoadReply, StagePoolStore, StagePoolStoreEnd, StagePoolStoreEndReply,
    StagePoolStoreReply, StagePoolUnload, StageSpec, StageSpecReply, StageStepCall, TensorSlot
)
from cluster.protocol.signing import (
    ANSWER_SIGNATURE_HEADER, AUDIENCE_HEADER, AnswerAuthError, AnswerSigner, CONTROL, ControlAuth, ControlAuthError, ControlVerifier, DIGEST_HEADER,
    EPOCH_HEADER, Fence, INSTANCE, MAX_CONDUCTOR_ID, MAX_EPOCH, MEMBERSHIP, MESSENGER, NONCE_HEADER, NO_BODY,
    PROMPT_BODY, SIGNATURE_HEADER, SMALL_BODY, TIMESTAMP_HEADER, audience_of, check_answer, check_line, derive_key,
    request_target, sign, verify_request
)

__all__ = [
    "ANSWER_SIGNATURE_HEADER", "AUDIENCE_HEADER", "AnswerAuthError", "AnswerSigner", "AbortReply", "AbortRequest", "AdoptReply", "AdoptRequest", "BadRequest", "CONTROL",
    "CacheDelta", "ConductorWork", "ControlAuth", "ControlAuthError", "ControlVerifier", "DIGEST_HEADER", "EPOCH_HEADER",
    "ERRORS", "Fence", "ForgedAnswer", "GenerateRequest", "INSTANCE", "InstanceBusy", "InstanceFailed", "InstanceInfo",
    "InstanceNotReady", "InstanceState", "InstanceUnavailable", "KVWriteFailed", "MAX_CONDUCTOR_ID", "MAX_EPOCH",
    "MEMBERSHIP", "MESSENGER", "NONCE_HEADER", "NO_BODY", "NoKVRoom", "NotOwner", "PROMPT_BODY", "PoolNaming",
    "PrefillReply", "PrefillRequest", "Prefilled", "PrefixNotCached", "PrestageReply", "PrestageRequest", "ProtocolError", "PushReply", "PushRequest",
    "RegisterReply", "RegisterRequest", "RenewReply", "RenewRequest", "RequestError", "RequestFailed", "ReserveReply",
    "ReserveRequest", "SIGNATURE_HEADER", "SMALL_BODY", "SWITCHABLE_ROLES", "SwitchRoleReply", "SwitchRoleRequest",
    "StageExpect", "StageFinish", "StageFinishReply",
    "StageJoin", "StageLinks", "StageLogits", "StagePing", "StagePoolLoad", "StagePoolLoadReply",
    "StagePoolStore", "StagePoolStoreEnd", "StagePoolStoreEndReply", "StagePoolStoreReply",
    "StagePoolUnload", "StageSpec", "StageSpecReply", "StageStepCall", "TIMESTAMP_HEADER", "TensorSlot",
    "TimedOut", "TooLarge", "Unauthorized", "UnknownReservation", "Unreachable", "WrongEpoch", "audience_of",
    "check_answer", "check_line", "derive_key", "error_from", "output_from_dict", "output_to_dict", "read_stream_line", "request_target",
    "sign", "stream_line", "token_ids", "verify_request",
]
