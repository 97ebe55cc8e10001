"""Owns the model and the paged KV cache; turns a scheduled batch into tensors and runs it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

import mooncake_kernels as kernels
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.hooks import PromptChunk, StageLoad
from engine.kv_layout import KVLayout
from engine.loader import load_model
from engine.model import AttentionMetadata, stage_layers
from engine.kernel_choice import integer_rows
from engine.quantization import check_batch_invariant, model_bytes, pack_model, prefill_copy_bytes, quantize_model
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

log = logging.getLogger(__name__)

_GIB = 1 << 30
# The deterministic mode's attention spans: a context is cut every this many tokens from its start
# (the threads share the spans), so a row's sums depend on its own context alone. Long enough that
# a span's work dwarfs its merge, short enough that one long decode still spreads over the threads.
DETERMINISTIC_SPAN_TOKENS = 256


def num_kv_blocks(cfg: ModelConfig, config: EngineConfig) -> int:
    """How many KV blocks the budget buys (``kv_cache_gib``, or most of free GPU memory). A
    pipeline stage counts the layers of the largest stage, so every stage of a group holds the
    same blocks (the first stage's block ids are every stage's)."""
    layers = cfg.num_layers
    if config.stage is not None:
        _, stages = config.stage
        layers = max(len(stage_layers(cfg.num_layers, i, stages)) for i in range(stages))
    block_bytes = config.block_size * cfg.kv_bytes_per_token(config.kv_cache_dtype) * layers // cfg.num_layers
    if config.kv_cache_gib is not None:
        budget = int(config.kv_cache_gib * _GIB)
    elif config.device == "cpu":
        budget = _GIB
    else:
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        # Weights are already resident; keep 10% of what is left for activations.
        budget = int(free * 0.9)
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(
            f"KV budget of {budget / _GIB:.3f} GiB holds no block ({block_bytes} bytes each)"
        )
    return blocks


@dataclass(frozen=True)
class StageStep:
    """One step as the pipeline stages after the first run it: what the first stage prepared
    (``ModelRunner.prepare``), as plain data that can cross to another process. ``rows``: the
    token rows whose logits the last stage computes (the sequences that sample)."""

    step_id: int
    positions: list[int]
    slot_mapping: list[int]
    num_decodes: int
    decode_block_tables: list[list[int]]
    decode_seq_lens: list[int]
    prefill_block_tables: list[list[int]]
    prefill_seq_lens: list[int]
    prefill_query_start_loc: list[int]
    rows: list[int]
    chunks: list[PromptChunk] = field(default_factory=list)  # the step's prompt chunks
    loads: list[StageLoad] = field(default_factory=list)  # its KV loads; each stage loaded its layers beforehand

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # the chunks and loads as their ``to_dict``s

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageStep:
        fields = {k: data[k] for k in cls.__dataclass_fields__}
        fields["chunks"] = [PromptChunk.from_dict(c) for c in fields["chunks"]]
        fields["loads"] = [StageLoad.from_dict(d) for d in fields["loads"]]
        return cls(**fields)


class StageDownstream(Protocol):
    """Where the first stage of a pipeline sends each step's hidden states; the stages after it
    run their layers on them in the order sent. ``send`` returns at once; its future resolves
    to the logits of ``step.rows`` (fp32, ``[len(rows), vocab]``) once the last stage has them,
    or to None when no row samples; or fails, at once when the step could not be handed on."""

    def send(self, step: StageStep, hidden: tuple[torch.Tensor, torch.Tensor]) -> Future: ...


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, max_model_len: int):
        self.config = config
        self.device = torch.device(config.device)
        cfg = ModelConfig.from_folder(Path(model_path))
        layers = None if config.stage is None else stage_layers(cfg.num_layers, *config.stage)
        self.model = load_model(model_path, config.torch_dtype, config.device, max_model_len, layers)
        # The native CPU kernels (built once per machine kind, cached on disk) unless
        # MOONCAKE_KERNELS says otherwise; built here so that a missing compiler fails the start.
        self.native = self.device.type == "cpu" and kernels.native_cpu()
        if self.native:
            kernels.load_native()
        # With the native kernels the integer GEMM takes every row count, unless the mode that is
        # not deterministic measured a dense matmul faster past some rows here (engine.kernel_choice).
        int_rows = None
        if config.quantization != "none":
            if self.native and not config.deterministic:
                int_rows = integer_rows(config.torch_dtype)
            quantize_model(self.model, config.quantization, int_rows)
        # A float model's matmuls through oneDNN on weights packed once (kernels/dense_linear.py).
        packed = config.quantization == "none" and pack_model(self.model)
        if config.deterministic:
            check_batch_invariant(self.model)
        native_layers = self.native and self.model.enable_native_decode(
            DETERMINISTIC_SPAN_TOKENS if config.deterministic else 0)
        if config.deterministic:
            if not native_layers:
                raise ValueError("the deterministic mode needs the native decode layers: int4 projections "
                                 "(--quantization int4, the default on CPU) and the native CPU kernels")
            self.model.batch_invariant = True
        # Which kernel multiplies which rows of the projections, as the start log and /stats say.
        self.linear_path = (None if config.quantization == "none" or not self.native else
                            f"integer GEMM ({kernels.load_native().int_gemm_path()}) "
                            + ("at every row count" if int_rows is None else
                               f"up to {int_rows} rows, oneDNN {config.dtype} past them"))
        self.model_config = self.model.cfg
        weight_bytes = model_bytes(self.model)
        self.num_blocks = num_kv_blocks(self.model_config, config)
        self.kv_cache = torch.zeros(
            len(self.model.layer_range), 2, self.num_blocks, cfg.num_kv_heads, config.block_size, cfg.head_dim,
            dtype=config.kv_torch_dtype, device=self.device,
        )
        self.model.kv_cache = self.kv_cache
        # A first stage before others: where its steps go on (set by the cluster's stage link).
        self.downstream: StageDownstream | None = None
        self._steps = 0
        # The Triton kernels (CUDA) or their torch twins (CPU) run this model's attention and KV ops.
        self.triton = kernels.use_triton(self.kv_cache)
        # Which kernels run this model's ops, as /stats reports it.
        self.kernels = "triton" if self.triton else "native CPU" if self.native else "torch twins"
        # Allocated once so decode attention allocates nothing per step (CUDA-graph friendly).
        self.decode_workspace = (
            kernels.DecodeWorkspace(config.max_num_seqs, cfg.num_heads, cfg.head_dim, device=self.device)
            if self.triton
            else None
        )
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); weights %.2f GiB (%s), "
            "their dense copy %.2f GiB; kernels: %s%s%s",
            self.num_blocks, config.block_size, self.num_blocks * config.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / _GIB, config.kv_cache_dtype,
            weight_bytes / _GIB, config.quantization if config.quantization != "none" else config.dtype,
            prefill_copy_bytes(self.model) / _GIB,
            self.kernels if not self.native else
            f"{self.kernels} (decode layers: {self._native_layers_said() if native_layers else 'eager'})",
            "; projections packed for oneDNN" if packed else "",
            f"; projections: {self.linear_path}" if self.linear_path else "",
        )

    def _native_layers_said(self) -> str:
        rows = self.model.native_rows
        return "every batch" if rows >= self.config.max_num_seqs else f"up to {rows} rows"

    @property
    def wire_layout(self) -> KVLayout:
        """The page geometry of every layer of the model, as a decode instance receives a
        prompt's KV (a pipeline stage's cache holds only its own layers)."""
        return replace(KVLayout.of_cache(self.kv_cache), num_layers=self.model_config.num_layers)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[ScheduledSeq]]:
        """Flatten a batch (decodes first) into input ids, positions and attention metadata.

        Returns the reordered batch too: row order of everything the step produces.
        """
        bs = self.config.block_size
        # Any one-token chunk can use the decode kernel (its context is already in the cache).
        decodes = [s for s in batch if s.num_new_tokens == 1]
        prefills = [s for s in batch if s.num_new_tokens > 1]
        workspace = self.decode_workspace
        if workspace is not None and len(decodes) > workspace.max_batch:
            # Caught here rather than as "workspace too small" from inside the split-K kernel.
            raise RuntimeError(
                f"{len(decodes)} decodes in one step, but the decode workspace holds "
                f"max_num_seqs = {workspace.max_batch}: the scheduler must cap each step"
            )
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        for s in ordered:
            seq = s.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.num_new_tokens > 1:
                query_start.append(query_start[-1] + s.num_new_tokens)

        def tables(block_ids: list[list[int]]) -> torch.Tensor:
            width = max(map(len, block_ids), default=0)
            # Padding entries point at block 0: never read, since seq_lens masks them out.
            rows = [ids + [0] * (width - len(ids)) for ids in block_ids]
            return self._tensor(rows, torch.int32).view(len(block_ids), width)

        def lens(group: list[ScheduledSeq]) -> list[int]:
            return [s.seq.num_computed_tokens + s.num_new_tokens for s in group]

        if self.model.batch_invariant:
            # Every token is a decode row of its own, its context its sequence's up to and with it:
            # the layer writes the step's KV before any row attends, so a prompt's token is computed
            # exactly as a decode of it would be, whatever the step holds or the cache held before.
            rows = [(s.seq.block_table.block_ids, p + 1) for s in ordered
                    for p in range(s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens)]
            meta = self._metadata(slots, len(rows), tables([ids for ids, _ in rows]), [n for _, n in rows],
                                  tables([]), [], [0])
        else:
            meta = self._metadata(slots, len(decodes), tables([s.seq.block_table.block_ids for s in decodes]),
                                  lens(decodes), tables([s.seq.block_table.block_ids for s in prefills]),
                                  lens(prefills), query_start)
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta, ordered

    def _metadata(self, slots: list[int], num_decodes: int, decode_tables: torch.Tensor, decode_lens: list[int],
                  prefill_tables: torch.Tensor, prefill_lens: list[int], query_start: list[int]) -> AttentionMetadata:
        """A step's attention metadata, with what every layer would otherwise work out again:
        on the torch twins' path, the step's cache slots and its plan for reading the decode
        contexts (``kernels.CacheSlots``, ``kernels.DecodeContext``)."""
        slot_mapping = self._tensor(slots, torch.int64)
        decode_seq_lens = self._tensor(decode_lens, torch.int32)
        cache_slots = context = None
        if not self.triton:
            cache_slots = kernels.CacheSlots.of(slot_mapping, self.config.block_size)
            if num_decodes and not self.native:  # the plan is the twin's; the native kernel reads in place
                context = kernels.DecodeContext.build(decode_tables, decode_seq_lens,
                                                      self.model_config.num_kv_heads, self.config.block_size)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            decode_block_tables=decode_tables,
            decode_seq_lens=decode_seq_lens,
            prefill_block_tables=prefill_tables,
            prefill_seq_lens=self._tensor(prefill_lens, torch.int32),
            prefill_query_start_loc=self._tensor(query_start, torch.int32),
            decode_workspace=self.decode_workspace,
            cache_slots=cache_slots,
            decode_context=context,
        )

    @torch.inference_mode()
    def run(
        self, batch: list[ScheduledSeq], on_layer: Callable[[int], None] | None = None,
        before_layer: Callable[[int], None] | None = None,
        handed_on: tuple[list[PromptChunk], list[StageLoad]] | None = None,
    ) -> tuple[torch.Tensor, list[ScheduledSeq], list[tuple[Sequence, range, torch.Tensor]]]:
        """Run one step; returns logits for the sequences that sample, those sequences, and the
        prompt positions scored (sequences that asked for prompt logprobs: each with the
        positions of its chunk still unscored and their logits, ``Sequence.prompt_logprob_positions``).

        ``on_layer`` and ``before_layer`` are passed to the model (called after each layer's KV
        is written, and before each layer runs). A first pipeline stage hands the step on with
        ``handed_on``: its prompt chunks and its KV loads (``StageStep.chunks``, ``.loads``)."""
        input_ids, positions, meta, ordered = self.prepare(batch)
        last, rows, sampling = -1, [], []
        scoring, score_rows = [], []
        for s in ordered:
            start = s.seq.num_computed_tokens
            scored = s.seq.prompt_logprob_positions(start, start + s.num_new_tokens)
            if scored:
                scoring.append((s.seq, scored))
                score_rows.extend(last + 1 + p - start for p in scored)
            last += s.num_new_tokens
            if s.samples:
                rows.append(last)
                sampling.append(s)
        n_sampling = len(rows)
        # Only the sequences that asked pay for the LM head over their prompt positions.
        rows += score_rows
        if not self.model.last and self.downstream is None:
            raise RuntimeError("a first pipeline stage has no stage after it to send its steps to")
        step = None if self.model.last else self._stage_step(positions, meta, rows, *(handed_on or ([], [])))
        out = self.model(input_ids, positions, meta, self._tensor(rows, torch.int64), on_layer, before_layer)
        if step is None:
            logits = out
        else:
            sent = self.downstream.send(step, out)
            # A step without a sampling sequence does not wait: the next chunk computes here while
            # the stages after this one take this one. One the next stage refused fails at once.
            logits = sent.result() if rows or sent.done() else None
            if logits is None:
                logits = torch.empty(0, self.model_config.vocab_size, device=self.device)
            logits = logits.to(self.device)
        scores, at = [], n_sampling
        for seq, scored in scoring:
            scores.append((seq, scored, logits[at : at + len(scored)]))
            at += len(scored)
        return logits[:n_sampling], sampling, scores

    def _stage_step(self, positions: torch.Tensor, meta: AttentionMetadata, rows: list[int],
                    chunks: list[PromptChunk], loads: list[StageLoad]) -> StageStep:
        self._steps += 1
        return StageStep(
            self._steps, positions.tolist(), meta.slot_mapping.tolist(), meta.num_decodes,
            meta.decode_block_tables.tolist(), meta.decode_seq_lens.tolist(), meta.prefill_block_tables.tolist(),
            meta.prefill_seq_lens.tolist(), meta.prefill_query_start_loc.tolist(), rows, chunks, loads)

    @torch.inference_mode()
    def run_stage(self, step: StageStep, hidden: tuple[torch.Tensor, torch.Tensor],
                  on_layer: Callable[[int], None] | None = None,
                  before_layer: Callable[[int], None] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A stage after the first: run this stage's layers on the hidden states of ``step``;
        returns the next stage's hidden states, or on the last stage the logits of its rows.
        ``on_layer`` / ``before_layer``: as in ``run`` (this stage's layer indices)."""
        if self.model.first:
            raise RuntimeError("the first stage runs batches, not steps")

        def tables(rows: list[list[int]], n: int) -> torch.Tensor:
            width = len(rows[0]) if rows else 0
            return self._tensor(rows, torch.int32).view(n, width)

        meta = self._metadata(step.slot_mapping, step.num_decodes,
                              tables(step.decode_block_tables, len(step.decode_seq_lens)), step.decode_seq_lens,
                              tables(step.prefill_block_tables, len(step.prefill_seq_lens)), step.prefill_seq_lens,
                              step.prefill_query_start_loc)
        x, residual = (t.to(self.device) for t in hidden)
        return self.model(None, self._tensor(step.positions, torch.int64), meta,
                          self._tensor(step.rows, torch.int64), on_layer, before_layer, (x, residual))
