"""JSON forms of what the Conductor and the instances exchange over HTTP.

Requests travel as token ids plus sampling parameters (the Conductor tokenizes once); outputs
travel as ``RequestOutput`` deltas, one JSON object per line on a streaming response. Prefix keys
travel as hex. Control calls are signed (``cluster/control_auth.py``).
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

from engine.llm_engine import RequestOutput
from engine.sampler import Logprobs
from engine.sampling_params import SamplingParams


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
