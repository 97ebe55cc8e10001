"""A request as the engine sees it: its tokens, how many have KV, its block table and its state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import Logprobs
from engine.sampler import SamplingState
from engine.sampling_params import SamplingParams
from engine.session import SessionHint
from engine.structured_output import Matcher
from paged_kv import BlockTable
from paged_kv.prefix_keys import salt_root


class KVLoad(Protocol):
    """KV of a run of a prompt's blocks computed elsewhere (the KVCache pool), arriving layer by
    layer while the sequence's first step computes (the paper's layer-wise prefill).

    ``layer(i)`` runs on the engine thread just before layer ``i`` of that step: it waits for
    layer ``i`` and returns it as ``[1, 2, blocks, heads, block_size, head_dim]`` chunks, in
    block order, covering the run; or None when it cannot (a failed read or checksum): the step
    then ends the request with finish reason ``kv_load_failed`` and its caller computes it
    without the load. ``close(used)`` runs once, when the engine is done with the load.
    """

    def layer(self, i: int) -> list[torch.Tensor] | None: ...

    def close(self, used: bool) -> None: ...


@dataclass
class PendingKVLoad:
    source: KVLoad
    block_ids: list[int]  # the blocks the load fills, in order
    skip: int  # leading blocks of the load's first chunk that were cached here already


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RESERVED = "reserved"  # blocks held for KV a prefill instance is sending (decode role)
    FINISHED = "finished"


class Sequence:
    """Invariant: ``num_computed_tokens < num_tokens`` while unfinished, i.e. there is always at
    least one token (the last prompt token or the newest sampled one) still to run."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        device: str = "cpu",
        session: SessionHint | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        matcher: Matcher | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.session = session  # its blocks are retained when it finishes
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        # A salted request's blocks are keyed apart from everyone else's (their chain's root).
        self.block_table = BlockTable(root=salt_root(params.cache_salt))
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        # The generator lives where the logits are sampled.
        self.sampling = SamplingState.for_request(params, prompt_token_ids, device, eos_token_ids, matcher)
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        # KV for some prompt blocks that arrives while the first step runs (engine.llm_engine.KVLoad)
        self.kv_load: PendingKVLoad | None = None
        # Prompt token i's logprob at index i, as the chunks compute them (the first token has none).
        self.prompt_logprobs: list[Logprobs | None] | None = [None] if params.prompt_logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still to compute: every prompt position
        must run here, none may come from a cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """The positions of a chunk ``[start, end)`` whose logits score a prompt token not
        scored yet (position ``p``'s logits score token ``p + 1``)."""
        if self.prompt_logprobs is None:
            return range(0)
        lo = max(start, len(self.prompt_logprobs) - 1)
        return range(lo, max(lo, min(end, self.num_prompt_tokens - 1)))

    def drop_kv_load(self) -> None:
        """The blocks a load was to fill are given back: the load is not needed any more."""
        if self.kv_load is not None:
            self.kv_load.source.close(used=False)
            self.kv_load = None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.sampling.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
