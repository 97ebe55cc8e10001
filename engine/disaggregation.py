"""The engine's side of disaggregation: what a prefill or decode instance asks of its engine.

``LLMEngine`` runs steps; this module is the protocol around them, behind one narrow API that
``cluster/instance`` calls (on the engine thread, through ``AsyncLLMEngine.call``):

* ``reserve``: a decode instance holds blocks for a prompt whose KV another instance computes
  (a ``RESERVED`` sequence the scheduler does not run); full blocks it already caches are reused;
* ``admit``: the received KV is unpacked into the reservation and the request starts decoding
  from the first token the prefill instance sampled;
* ``adopt``: the received KV is kept as cached prefix blocks (hot-spot replication);
* ``drop``: a reservation nobody took over is released (a live request is left alone);
* ``export_prefix``: cached prefix blocks are packed into a buffer for another instance (or for
  the KVCache pool); ``add_loading``: a request whose prefix arrives from the pool layer by layer
  during its first step;
* ``switch_role``: a prefill engine becomes a decode one or back, once it holds nothing;
* ``layout`` / ``cache_report``: the KV page geometry, and what the prefix cache holds (as
  changes since a version the caller saw).

Invariant: a reservation is exactly one ``RESERVED`` sequence in ``engine.seqs``; every exit
(admit, adopt, drop, abort) leaves it and returns its blocks to the pool or hands them over.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import mooncake_kernels as kernels
from engine.kv_layout import pack
from engine.hooks import KVSink
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.session import SessionHint
from engine.sequence import KVLoad, PendingKVLoad, Sequence, SequenceStatus
from paged_kv.prefix_keys import chain_keys, salt_root


class KVCapacityError(RuntimeError):
    """Not enough free KV blocks to take a request's KV now (a decode instance is full)."""


@dataclass(frozen=True)
class Reservation:
    """Blocks held for a request's prompt KV. The first ``cached_blocks`` were already in the
    prefix cache; the prefill instance sends the rest into ``block_ids[cached_blocks:]``."""

    block_ids: list[int]
    cached_blocks: int

    @property
    def num_sent_blocks(self) -> int:
        return len(self.block_ids) - self.cached_blocks


@dataclass(frozen=True)
class CacheReport:
    """The prefix cache's keys at ``version``: either all of them (``full``) or the changes since
    the version the caller gave (``added``, then ``removed``)."""

    version: int
    full: list[bytes] | None
    added: list[bytes]
    removed: list[bytes]


class KVHandoff:
    """Disaggregation operations on one engine. Not thread-safe: call on the engine thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.layout = engine.runner.wire_layout

    def _whole_model(self, what: str) -> None:
        if self._engine.config.stage is not None and self._engine.config.stage[1] > 1:
            # Its cache holds only this stage's layers: whole-model KV is not here to move.
            raise ValueError(f"a pipeline stage cannot {what} (its cache holds only its own layers)")

    def add_sink(self, sink: KVSink) -> None:
        """One more place the engine streams the KV of prompts it finishes to, layer by layer (a
        prefill instance's sender, its pool writer)."""
        self._engine.kv_sinks.append(sink)

    # -- receiving ----------------------------------------------------------------------------------
    def reserve(self, request_id: str, token_ids: list[int], params: SamplingParams,
                session: SessionHint | None = None) -> Reservation:
        """Hold blocks for the KV of a prompt that another instance computes.

        Raises ``KVCapacityError`` when the blocks are not free now, ``ValueError`` for a request
        that could never be served. Ended by ``admit``, ``adopt``, ``drop`` or ``LLMEngine.abort``.
        """
        e = self._engine
        seq = e.new_sequence(token_ids, params, request_id, session)
        bm = e.block_manager
        cached = bm.match_prefix(seq.block_table, seq.token_ids)
        if not bm.can_grow(seq.block_table, seq.num_prompt_tokens):
            bm.free(seq.block_table)
            raise KVCapacityError(
                f"{bm.blocks_needed(seq.block_table, seq.num_prompt_tokens)} KV blocks needed, "
                f"{bm.pool.num_free} free"
            )
        bm.grow(seq.block_table, seq.num_prompt_tokens)
        seq.status = SequenceStatus.RESERVED
        seq.num_cached_tokens = cached
        e.seqs[request_id] = seq
        return Reservation(list(seq.block_table.block_ids), cached // e.config.block_size)

    def admit(
        self,
        request_id: str,
        kv: torch.Tensor | None,
        first_token: int,
        sampler_state: bytes | None,
        num_cached_tokens: int,
    ) -> None:
        """Start decoding a reserved request from its received prompt KV and first token.

        ``kv`` is a ``KVLayout.shape`` buffer of every layer for ``block_ids[cached_blocks:]``
        (None when every block was cached here). The first token was already streamed by the
        prefill instance; it is replayed into the detokenizer so later text continues from it.
        On any error the reservation is released.
        """
        with self._releasing_on_error(request_id):
            seq = self._receive(request_id, kv)
            if sampler_state is not None:
                if seq.sampling.generator is None:
                    raise ValueError("sampler_state given for a request without a seed")
                seq.sampling.generator.set_state(torch.frombuffer(bytearray(sampler_state), dtype=torch.uint8))
            seq.append_token(first_token)
            seq.detokenizer.add(first_token)
            seq.num_cached_tokens = num_cached_tokens  # what the client's usage reports: the prefill's hit
            self._engine.scheduler.add_running(seq)

    def adopt(self, request_id: str, kv: torch.Tensor | None) -> int:
        """Keep a reserved prompt's received KV as cached prefix blocks and end the reservation
        (hot-spot replication). Returns the number of blocks now cached under the prompt's keys."""
        with self._releasing_on_error(request_id):
            self._whole_model("adopt a prefix")
            seq = self._receive(request_id, kv)
            cached = len(seq.block_table.keys)
            self._engine.scheduler.finish(seq, "adopted")  # the blocks stay cached under their keys
            del self._engine.seqs[request_id]
            return cached

    def drop(self, request_id: str) -> bool:
        """Release a reservation that was not taken over; False (and nothing done) when
        ``request_id`` is not a reservation here (unknown, or already a live request)."""
        seq = self._engine.seqs.get(request_id)
        if seq is None or seq.status is not SequenceStatus.RESERVED:
            return False
        return self._engine.abort(request_id)

    def is_reserved(self, request_id: str) -> bool:
        seq = self._engine.seqs.get(request_id)
        return seq is not None and seq.status is SequenceStatus.RESERVED

    def _receive(self, request_id: str, kv: torch.Tensor | None) -> Sequence:
        """Unpack received KV into a reservation's blocks after the ones it found cached, and
        publish its full blocks in the prefix cache."""
        e = self._engine
        if not self.is_reserved(request_id):
            raise ValueError(f"request {request_id!r} has no KV reservation here")
        seq = e.seqs[request_id]
        table = seq.block_table
        skip = seq.num_cached_tokens // e.config.block_size
        if kv is not None:
            cache = e.runner.kv_cache
            # Received KV sits in host staging; a GPU cache takes it through one upload.
            kernels.scatter_kv(kv.to(cache.device), cache, table.block_ids[skip:])
        seq.num_computed_tokens = seq.num_prompt_tokens
        e.block_manager.commit(table, seq.token_ids, seq.num_computed_tokens)
        return seq

    @contextmanager
    def _releasing_on_error(self, request_id: str) -> Iterator[None]:
        # A take-over that fails half-way must not leave the blocks held by nobody.
        try:
            yield
        except BaseException:
            self._engine.abort(request_id)
            raise

    # -- sending ------------------------------------------------------------------------------------
    def export_prefix(self, token_ids: list[int], skip_blocks: int, num_blocks: int, out: torch.Tensor,
                      salt: str | None = None) -> None:
        """Pack the cached blocks ``[skip_blocks, skip_blocks + num_blocks)`` of ``token_ids``'s
        prefix (cached under ``salt``) into ``out`` (``layout.shape(num_blocks)``). One
        engine-thread call, so nothing can evict them between lookup and copy. Raises ValueError
        when they are not all cached."""
        self._whole_model("export a prefix")
        e = self._engine
        blocks = e.block_manager.pool.lookup(chain_keys(token_ids, self.layout.block_size, salt_root(salt)))
        wanted = blocks[skip_blocks : skip_blocks + num_blocks]
        if len(wanted) != num_blocks:
            raise ValueError(f"only {len(blocks)} of the prefix blocks are cached here now")
        pack(e.runner.kv_cache, wanted, None, out)

    def cached_prefix_blocks(self, token_ids: list[int], salt: str | None = None) -> int:
        """How many leading full blocks of ``token_ids`` the prefix cache holds now (under ``salt``)."""
        keys = chain_keys(token_ids, self.layout.block_size, salt_root(salt))
        return len(self._engine.block_manager.pool.lookup(keys))

    def add_loading(self, request_id: str, token_ids: list[int], params: SamplingParams, start_block: int,
                    num_blocks: int, load: KVLoad, session: SessionHint | None = None) -> None:
        """Queue a request whose prompt blocks ``[start_block, start_block + num_blocks)`` come
        from ``load`` (the KVCache pool) layer by layer during its first step, so loading
        overlaps computing. The blocks before ``start_block`` must be cached here; if they are
        not (evicted meanwhile), or there is no room, the load is closed unused and the request
        is queued like any other. Raises ValueError (and closes the load) for a bad request.
        """
        e = self._engine
        bs = self.layout.block_size
        end = start_block + num_blocks
        try:
            seq = e.new_sequence(token_ids, params, request_id, session)
            if end * bs >= len(token_ids):
                raise ValueError("a load never supplies the last prompt token's block: it must be computed")
        except BaseException:
            load.close(used=False)
            raise
        bm = e.block_manager
        if seq.needs_prompt_logprobs:  # every prompt position computes here
            load.close(used=False)
            e.seqs[request_id] = seq
            e.scheduler.add(seq)
            return
        cached = bm.match_prefix(seq.block_table, seq.token_ids) // bs
        if start_block <= cached < end and bm.can_grow(seq.block_table, end * bs):
            bm.grow(seq.block_table, end * bs)
            seq.num_computed_tokens = end * bs
            seq.kv_load = PendingKVLoad(load, seq.block_table.block_ids[cached:end], cached - start_block)
        else:
            load.close(used=False)
            seq.num_computed_tokens = cached * bs
        e.seqs[request_id] = seq
        e.scheduler.add(seq)

    # -- role -----------------------------------------------------------------------------------------
    def switch_role(self, role: str) -> bool:
        """Serve ``role`` ("prefill" or "decode") from the next step on, when the engine holds no
        sequence (none waiting, running or reserved); False, and nothing changed, otherwise. The
        prefix cache and the KV pool are the same for both roles and stay as they are."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"an engine switches between prefill and decode, not to {role!r}")
        e = self._engine
        if e.seqs or e.has_unfinished():
            return False
        e.role = role
        return True

    # -- reporting ----------------------------------------------------------------------------------
    def cache_report(self, since: int | None) -> CacheReport:
        """The cached prefix keys as changes since version ``since`` (all of them when ``since``
        is None or too old)."""
        pool = self._engine.block_manager.pool
        changes = None if since is None else pool.changes_since(since)
        if changes is None:
            return CacheReport(pool.version, list(pool.cached_keys()), [], [])
        return CacheReport(pool.version, None, *changes)
