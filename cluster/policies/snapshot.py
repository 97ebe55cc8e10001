"""Plain descriptions of a request and of each instance, as the Conductor's policies read them.

The simulator fills these from its model of the cluster; a live Conductor fills them from the
instances' reports. Policies see nothing else, so both call them identically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cluster.policies.prefix_index import BlockKey, PrefixView


@dataclass(frozen=True)
class RequestInfo:
    """What the Conductor knows about a new request: its length, its prompt's block keys, and
    how many of those blocks (a prefix) the KVCache pool holds.

    The output length is not known in advance, so it is not here.
    """

    request_id: int
    input_length: int
    block_keys: Sequence[BlockKey]
    pool_blocks: int = 0

    def __post_init__(self) -> None:
        if self.input_length <= 0:
            raise ValueError(f"input_length must be positive, got {self.input_length}")
        if not 0 <= self.pool_blocks <= len(self.block_keys):
            raise ValueError(f"pool_blocks must be in [0, {len(self.block_keys)}], got {self.pool_blocks}")


@dataclass(frozen=True)
class PrefillInstanceState:
    """One prefill instance: how long until it could start a new request, and its cache."""

    index: int
    queue_s: float  # predicted prefill time of everything queued or running on it
    cache: PrefixView

    def __post_init__(self) -> None:
        if self.queue_s < 0:
            raise ValueError(f"queue_s must be >= 0, got {self.queue_s}")


@dataclass(frozen=True)
class DecodeInstanceState:
    """One decode instance: its running batch and the requests already routed to it.

    ``running_start_s[i]`` is when running sequence *i* joined the batch and
    ``running_prompt[i]`` its prompt length (its context when it joined); ``context_tokens`` is
    the batch's current total context, generated tokens included. ``incoming_*`` describe
    requests whose prefill is queued or running, with the time their KV is predicted to arrive.
    ``local_prefill_s``: the predicted compute left of prompts it prefills itself
    (``cluster/policies/local_prefill.py``; those requests count as running already); ``cache``:
    the prefix blocks it holds, where known.
    """

    index: int
    running_start_s: Sequence[float]
    running_prompt: Sequence[int]
    context_tokens: int
    incoming_ready_s: Sequence[float]
    incoming_prompt: Sequence[int]
    local_prefill_s: float = 0.0
    cache: PrefixView | None = None

    def __post_init__(self) -> None:
        if len(self.running_start_s) != len(self.running_prompt):
            raise ValueError("running_start_s and running_prompt must be aligned")
        if len(self.incoming_ready_s) != len(self.incoming_prompt):
            raise ValueError("incoming_ready_s and incoming_prompt must be aligned")
        if self.context_tokens < 0:
            raise ValueError("context_tokens must be >= 0")
        if self.local_prefill_s < 0:
            raise ValueError(f"local_prefill_s must be >= 0, got {self.local_prefill_s}")

    @property
    def batch_size(self) -> int:
        return len(self.running_start_s)
