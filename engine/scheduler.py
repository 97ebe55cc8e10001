"""Continuous batching with chunked prefill and recompute preemption.

Each step fills a token budget (``max_num_batched_tokens``) with at most ``max_num_seqs``
sequences: first running sequences get their next chunk (one token for a decode, up to the rest
of the prompt for a prefill still in progress), then waiting sequences are admitted while the
budget, ``max_num_seqs`` and free KV blocks allow. Running decodes go first so that admitting
new prompts never stalls them (Sarathi-style stall-free batching).

When the running sequences do not all fit in one step (the budget runs out, or a decode instance
joined received requests past ``max_num_seqs`` through ``add_running``), they take turns,
round-robin: each step starts with the first one the previous step left out.

When a running sequence needs a block and none is free, the most recently admitted running
sequence not yet in this step's batch is preempted: its blocks are released and it goes back to
the head of the queue to be recomputed from its tokens (prompt + output so far). Its output is
unchanged because sampling state (the per-request generator) only advances when a token is
actually sampled.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus
from paged_kv import BlockManager
from paged_kv.block_pool import Retention


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so its logits pick the next."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefill_chunk_tokens = config.prefill_chunk_tokens
        self.chunk_min_prompt_tokens = config.chunk_min_prompt_tokens
        self.max_num_seqs = config.max_num_seqs
        self.session_retention_s = config.session_retention_s
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        # The running sequence the last step left out first (None: it took them all).
        self._next_turn: Sequence | None = None
        self.num_preemptions = 0
        # Prompt tokens of admitted requests, and how many of them the prefix cache served.
        self.num_prompt_tokens_admitted = 0
        self.num_prompt_tokens_hit = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in its blocks (sent by a prefill instance) to
        the running batch: its next step is a decode."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, only: set[Sequence] | None = None) -> list[ScheduledSeq]:
        """The next step's batch. ``only``: schedule none but these (the others wait a step; a
        waiting one not among them stops admission), as the engine does to find which request
        made a step fail (``LLMEngine.step``)."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        in_batch: set[Sequence] = set()
        preempted = False
        turns = self._turn_order()
        self._next_turn = None
        for seq in turns:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an earlier one this step
            if only is not None and seq not in only:
                continue
            if budget == 0 or len(batch) == self.max_num_seqs:
                self._next_turn = seq
                break
            n = self._chunk(seq, budget)
            target = seq.num_computed_tokens + n
            while not self.block_manager.can_grow(seq.block_table, target):
                victim = next(s for s in reversed(self.running) if s not in in_batch)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # every other running sequence is in the batch or preempted
            self.block_manager.grow(seq.block_table, target)
            batch.append(ScheduledSeq(seq, n))
            in_batch.add(seq)
            budget -= n

        # While memory is short (someone was just preempted) admitting more would only thrash.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and (only is None or self.waiting[0] in only)
        ):
            seq = self.waiting[0]
            if not seq.block_table.block_ids and not seq.needs_prompt_logprobs:
                seq.num_computed_tokens = self.block_manager.match_prefix(
                    seq.block_table, seq.token_ids
                )
            n = self._chunk(seq, budget)
            target = seq.num_computed_tokens + n
            if not self.block_manager.can_grow(seq.block_table, target):
                # Do not sit on prefix-hit blocks while waiting: others may need them.
                self.block_manager.free(seq.block_table)
                seq.drop_kv_load()
                seq.num_computed_tokens = 0
                break
            self.block_manager.grow(seq.block_table, target)
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                self.num_prompt_tokens_admitted += seq.num_prompt_tokens
                self.num_prompt_tokens_hit += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens ``seq`` computes this step."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if self.prefill_chunk_tokens is not None and seq.num_prompt_tokens >= self.chunk_min_prompt_tokens:
            n = min(n, self.prefill_chunk_tokens)
        return n

    def _turn_order(self) -> list[Sequence]:
        """The running sequences in admission order, rotated to start at the one whose turn it is."""
        start = next((i for i, s in enumerate(self.running) if s is self._next_turn), 0)
        return self.running[start:] + self.running[:start]

    def prefix_cache_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served from the prefix cache."""
        admitted = self.num_prompt_tokens_admitted
        return self.num_prompt_tokens_hit / admitted if admitted else 0.0

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def retention(self, seq: Sequence) -> Retention | None:
        """How a finished sequence's cached blocks are kept: a session's, for its next turn."""
        if seq.session is None or not self.session_retention_s:
            return None
        return Retention(time.monotonic() + self.session_retention_s, seq.session.priority)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished (or aborted) and give its blocks back, wherever it is queued."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table, self.retention(seq))
        seq.drop_kv_load()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
