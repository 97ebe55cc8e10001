"""What the engine hands back for a request: plain data, no torch, so the Conductor and the
wire (``cluster/protocol/``) use it without loading the model code."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprobs:
    """Logprob of the sampled token plus the `params.logprobs` most likely alternatives,
    highest first (see the module docstring for which distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]



@dataclass
class RequestOutput:
    """What one step produced for one request (a delta: new tokens and text only)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[Logprobs] = field(default_factory=list)
    # With the first token of a request that asked for them: prompt token i's logprob at index i
    # (None for the first token, which nothing precedes).
    prompt_logprobs: list[Logprobs | None] | None = None
    # Set when a prefill instance hands the request off (finish_reason "handoff"): the state of
    # its seeded generator after the first token, so the decode instance samples as we would.
    sampler_state: bytes | None = None
    # With finish_reason "stop": the stop string or stop token id that ended it (None for EOS).
    stop_reason: int | str | None = None
