"""bench.faults: hostile signed control inputs (issue 40, item 7).

Every instance control endpoint is driven with calls signed with the cluster's key, as only a
Conductor (or whoever holds the secret) can send them, whose bodies are malformed: each field
of a valid message missing, null, of the wrong type, negative, huge (2**70, 1e308), nested where
a scalar goes; prompts and id lists of a million entries; bodies that are not objects; a
destination whose blocks, offsets, region or generation are foreign or out of range; a malformed
epoch header. A mutation that the protocol's own parser still takes (a request id that is
another string, say) is not malformed and is not sent, except in a destination, whose fields
the parser only types: those must be refused further on.

Every call must be answered, and with a 4xx: a 5xx is a crash of the instance's handling, no
answer a hang. What the instances hold afterwards is the run's final check (nothing held, none
down); the row's own: nothing held once its traffic is done.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from bench.faults.matrix import HOSTILE_PROMPT, ControlCall
from cluster.failpoints import Failpoints
from cluster.kv_stream import KVDestination
from cluster.protocol import (EPOCH_HEADER, AbortRequest, AdoptRequest, GenerateRequest, Prefilled, PrefillRequest,
                              PushRequest, RenewRequest, ReserveRequest, StageJoin, SwitchRoleRequest)
from engine.sampling_params import SamplingParams

# Values that no field of a control message takes (a few do take some: then the parser keeps
# the mutation out of the run, see the module docstring).
BAD_VALUES: tuple[tuple[str, Any], ...] = (
    ("null", None), ("a string", "x"), ("-1", -1), ("2**70", 2**70), ("1e308", 1e308), ("-0.5", -0.5),
    ("a list", [1, 2]), ("an object", {"a": 1}), ("true", True))
MILLION = 1_000_000


@dataclass(frozen=True)
class Case:
    label: str
    method: str
    path: str  # with its query
    body: Any  # JSON (None for a GET)
    epoch: str


def _mutations(base: dict[str, Any], depth: int = 2, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """``base`` with one field (or one field of a nested object, ``depth`` levels down) removed
    or replaced by each of ``BAD_VALUES``."""
    for key, value in base.items():
        yield f"{prefix}{key} missing", {k: v for k, v in base.items() if k != key}
        for name, bad in BAD_VALUES:
            if bad != value or type(bad) is not type(value):
                yield f"{prefix}{key} = {name}", {**base, key: bad}
        if isinstance(value, dict) and depth > 1:
            for label, inner in _mutations(value, depth - 1, f"{prefix}{key}."):
                yield label, {**base, key: inner}


def _parses(parse: Callable[[Any], Any], body: Any) -> bool:
    try:
        parse(body)
        return True
    except Exception:  # noqa: BLE001 -- whatever the parser refuses with, the body is malformed
        return False


def _with_dest(message: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A parser of a message that carries a destination, destination included."""
    def parse(body: Any) -> Any:
        message(body)
        return KVDestination.from_dict(body["dest"])

    return parse


def _arm(body: Any) -> None:
    if not isinstance(body, dict) or not isinstance(body.get("arm"), dict):
        raise ValueError("not an arm body")
    Failpoints(True).arm(body["arm"])


def cases(prefill_url: str, decode_url: str, dest: dict[str, Any], epoch: str) -> list[Case]:
    """Every malformed call: ``dest`` is a real reservation of the caller's on the decode
    instance (what a prefill or push is told to write into); ``epoch`` its fence header."""
    ids = HOSTILE_PROMPT
    params = SamplingParams(max_tokens=1)
    endpoints: list[tuple[str, str, dict[str, Any], Callable[[Any], Any]]] = [
        (decode_url, "/instance/reserve", ReserveRequest("fuzz-reserve", ids, params).to_dict(),
         ReserveRequest.from_dict),
        (decode_url, "/instance/renew", RenewRequest(["fuzz-renew"]).to_dict(), RenewRequest.from_dict),
        (prefill_url, "/instance/prefill", PrefillRequest("fuzz-prefill", ids, params, dest).to_dict(),
         _with_dest(PrefillRequest.from_dict)),
        (decode_url, "/instance/generate", GenerateRequest("fuzz-generate", ids, params, Prefilled(5)).to_dict(),
         GenerateRequest.from_dict),
        (decode_url, "/instance/abort", AbortRequest("fuzz-abort").to_dict(), AbortRequest.from_dict),
        (prefill_url, "/instance/push", PushRequest("fuzz-push", ids, dest).to_dict(),
         _with_dest(PushRequest.from_dict)),
        (decode_url, "/instance/adopt", AdoptRequest("fuzz-adopt", True).to_dict(), AdoptRequest.from_dict),
        (decode_url, "/instance/role", {"role": "prefill", "drain_s": 1.0}, SwitchRoleRequest.from_dict),
        (prefill_url, "/instance/stage/join", StageJoin("fuzz-group", 1, 2).to_dict(), StageJoin.from_dict),
        (decode_url, "/instance/failpoints", {"arm": {"kv.flip_bit": 0}}, _arm),
    ]
    out: list[Case] = []
    for url, path, base, parse in endpoints:
        bodies = [("a list at the top", [base]), ("null at the top", None), ("a string at the top", "x"),
                  ("an empty object", {}), *_mutations(base)]
        for field in ("prompt_token_ids", "request_ids"):
            if field in base:
                bodies.append((f"{field} of a million entries", {**base, field: [1] * MILLION}))
        for label, body in bodies:
            # The destination's fields are only typed by the parser: a foreign or out-of-range
            # value in one must be refused further on (except ``sums``, any value of which is a
            # truth value, and harmless).
            in_dest = label.startswith("dest.") and not label.startswith("dest.sums")
            if in_dest or not _parses(parse, body):
                out.append(Case(f"{path}: {label}", "POST", url + path, body, epoch))
    for label, query in (("since=-1", "-1"), ("since=abc", "abc"), ("since=10**30", "1" + "0" * 30),
                         ("since=1e3", "1e3")):
        out.append(Case(f"/instance/state: {label}", "GET", f"{decode_url}/instance/state?since={query}", None, epoch))
    for label, header in (("an epoch header that is not a fence", "nonsense"), ("a negative epoch", "fuzz/-1"),
                          ("an epoch of 10**30", "fuzz/" + "1" + "0" * 30), ("a Conductor id of 100 characters",
                                                                             "x" * 100 + "/1")):
        out.append(Case(f"/instance/abort: {label}", "POST", decode_url + "/instance/abort",
                        AbortRequest("fuzz-epoch").to_dict(), header))
    return out


async def drive(control: httpx.AsyncClient, todo: list[Case]) -> list[ControlCall]:
    """Send every case, one after another; each answer (or that there was none)."""
    answers = []
    for case in todo:
        answer = ControlCall(case.label)
        try:
            content = None if case.body is None and case.method == "GET" else json.dumps(case.body)
            r = await control.request(case.method, case.path, content=content,
                                      headers={EPOCH_HEADER: case.epoch, "Content-Type": "application/json"})
            answer.status, answer.answer = r.status_code, r.text[:200]
        except httpx.HTTPError as e:
            answer.answer = f"no answer: {type(e).__name__}: {e}"
        answers.append(answer)
    return answers
