"""The engine: requests in, tokens out, one ``step()`` at a time.

``step()`` is three calls (as in nano-vllm): the scheduler picks this step's chunks, the model
runner computes logits for them, and postprocessing samples, detokenizes, checks stop
conditions and frees finished sequences.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.config import EngineConfig, ModelConfig
from engine.cpu_runtime import configure_cpu_runtime
from engine.default_model import resolve_model
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_layout import unpack_layer
from engine.model_runner import ModelRunner
from engine.prompt import check_fits, prompt_token_ids
from engine.outputs import Logprobs, RequestOutput
from engine.sampler import Sampler, score_tokens
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import Tokenizer
from paged_kv import BlockManager

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptChunk:
    """Prompt tokens ``[start, end)`` of request ``request_id`` computed in this step (``start``
    past its cached prefix on the first chunk), with the blocks the prompt holds now. Plain data:
    a pipeline's first stage hands its steps' chunks on to the stages after it. ``last``: the
    chunk that completes the prompt."""

    request_id: str
    block_ids: list[int]
    start: int
    end: int
    num_prompt_tokens: int

    @property
    def last(self) -> bool:
        return self.end == self.num_prompt_tokens

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> PromptChunk:
        return cls(str(data["request_id"]), [int(b) for b in data["block_ids"]], int(data["start"]),
                   int(data["end"]), int(data["num_prompt_tokens"]))


class KVSink(Protocol):
    """Where a prefill instance's engine sends the KV of the prompts it computes: the stream to a
    decode instance (cluster/instance/kv_stream.py), the KVCache pool (cluster/instance/pool_io.py).

    ``layer_done`` runs on the engine thread after each layer of every step in which prompts the
    sink ``wants`` compute a chunk (``chunks``: the step's chunks of those prompts, before any
    output token; a prompt preempted meanwhile starts over from its cached prefix); once it
    returns for layer ``l``, layer ``l`` of every block up to ``chunk.end`` is final. It must not block on the
    transfer (the next layer is waiting).
    """

    def wants(self, request_id: str) -> bool: ...

    def layer_done(self, layer: int, kv_cache: torch.Tensor, chunks: list[PromptChunk]) -> None: ...


def sinks_on_layer(sinks: list[KVSink], kv_cache: torch.Tensor,
                   chunks: list[PromptChunk]) -> Callable[[int], None] | None:
    """A step's ``on_layer``: each sink's ``layer_done`` with the chunks it wants; None when no
    sink wants any (an engine's step, and a later pipeline stage's)."""
    wanted = [(sink, [c for c in chunks if sink.wants(c.request_id)]) for sink in sinks]
    wanted = [(sink, mine) for sink, mine in wanted if mine]
    if not wanted:
        return None

    def send_layer(layer: int) -> None:
        for sink, mine in wanted:
            sink.layer_done(layer, kv_cache, mine)

    return send_layer


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    num_reserved: int


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.device == "cpu":
            configure_cpu_runtime(config.threads)
        else:
            torch.set_num_threads(config.threads)
        path = resolve_model(config.model)
        model_config = ModelConfig.from_folder(path)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context of "
                f"{model_config.max_position_embeddings} tokens"
            )
        self.model_path = path
        self.tokenizer = Tokenizer(path, model_config.eos_token_ids)
        self.runner = ModelRunner(config, path, self.max_model_len)
        self.model_config = self.runner.model_config
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler()
        self.seqs: dict[str, Sequence] = {}
        self.kv_sinks: list[KVSink] = []  # each gets the layers of the prompts it wants
        self._ids = itertools.count()
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        log.info("engine ready: %s, max_model_len %d", path, self.max_model_len)

    # -- requests ---------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Validate a prompt (text or token ids) and return its token ids."""
        return prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError (and changes nothing) when it cannot be served."""
        seq = self.new_sequence(prompt, params, request_id)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def new_sequence(
        self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None
    ) -> Sequence:
        """A validated sequence for a request, not yet queued (``add_request`` queues it;
        ``engine.disaggregation`` reserves blocks for it). Raises ValueError."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        check_fits(len(ids), params.max_tokens, self.max_model_len, "the model's context")
        check_fits(len(ids), params.max_tokens, self.block_manager.num_blocks * self.config.block_size,
                   "the KV cache capacity")
        detok = IncrementalDetokenizer(self.tokenizer.hf, ids, params.stop, params.skip_special_tokens)
        return Sequence(request_id, ids, params, detok, self.config.device)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is unknown or already finished."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        on_layer = None
        chunks: list[PromptChunk] = []
        if self.kv_sinks or self.runner.downstream is not None:
            # Prompts computing a chunk now: its KV is final layer by layer as the step runs.
            chunks = [PromptChunk(s.seq.request_id, list(s.seq.block_table.block_ids), s.seq.num_computed_tokens,
                                  s.seq.num_computed_tokens + s.num_new_tokens, s.seq.num_prompt_tokens)
                      for s in batch if s.seq.num_output_tokens == 0]
            on_layer = sinks_on_layer(self.kv_sinks, self.runner.kv_cache, chunks)
        loading = [s.seq for s in batch if s.seq.kv_load is not None]
        failed: set[Sequence] = set()
        before_layer = self._loader(loading, failed) if loading else None

        handed_on = None
        if self.runner.downstream is not None:
            # A first pipeline stage hands on its chunks (for the later stages' KV sinks) and its
            # loads (each later stage loaded its layers of them beforehand: ``PoolIO``).
            handed_on = ([c.to_dict() for c in chunks],
                         [{"request_id": seq.request_id, "block_ids": seq.kv_load.block_ids, "skip": seq.kv_load.skip}
                          for seq in loading])
        logits, sampling, scores = self.runner.run(batch, on_layer, before_layer, handed_on)
        outputs = []
        for seq in loading:
            if seq in failed:
                outputs.append(self._end(seq, "kv_load_failed"))
            else:
                seq.kv_load.source.close(used=True)
                seq.kv_load = None
        for s in batch:
            seq = s.seq
            if seq in failed:
                continue  # its KV past the failed layer is garbage: never published
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(
                    s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens
                )
            seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.commit(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        for seq, positions, rows in scores:
            if seq not in failed:
                seq.prompt_logprobs.extend(score_tokens(rows, [seq.token_ids[p + 1] for p in positions],
                                                        seq.params.prompt_logprobs))
        if failed:
            keep = [i for i, s in enumerate(sampling) if s.seq not in failed]
            logits, sampling = logits[keep], [sampling[i] for i in keep]
        if sampling:
            sampled = self.sampler(logits, [s.seq.sampling for s in sampling])
            for s, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs):
                outputs.append(self._postprocess(s.seq, token, lp))
        return outputs

    def _loader(self, loading: list[Sequence], failed: set[Sequence]) -> Callable[[int], None]:
        """``before_layer`` of a step with KV loads: layer ``i`` of each load goes into its
        blocks just before layer ``i`` computes. A load that fails stops there; its sequence's
        step output is discarded (see ``step``)."""
        kv_cache = self.runner.kv_cache

        def load_layer(i: int) -> None:
            for seq in loading:
                if seq in failed:
                    continue
                pending = seq.kv_load
                objects = pending.source.layer(i)
                if objects is None:
                    failed.add(seq)
                    continue
                unpack_layer(kv_cache, i, objects, pending.block_ids, pending.skip)

        return load_layer

    def _end(self, seq: Sequence, reason: str) -> RequestOutput:
        """Finish ``seq`` with no new token (its step did not produce one)."""
        self.scheduler.finish(seq, reason)
        del self.seqs[seq.request_id]
        return RequestOutput(seq.request_id, [], "", True, reason, seq.num_prompt_tokens, seq.num_output_tokens,
                             seq.num_cached_tokens)

    def _postprocess(self, seq: Sequence, token: int, logprobs: Logprobs | None) -> RequestOutput:
        params = seq.params
        seq.append_token(token)
        self.num_generated_tokens += 1
        reason = None
        text = ""
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason = "stop"
        else:
            text = seq.detokenizer.add(token)
            if seq.detokenizer.stopped:
                reason = "stop"
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        sampler_state = None
        if reason is None and self.config.role == "prefill":
            # Not flushing the detokenizer: text it holds back (half a character, a possible
            # stop string) is emitted by the decode instance, which replays this token.
            reason = "handoff"
            if seq.sampling.generator is not None:
                sampler_state = bytes(seq.sampling.generator.get_state().numpy())
        elif reason is not None and not seq.detokenizer.stopped:
            text += seq.detokenizer.finish()
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.seqs[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=[logprobs] if logprobs is not None else [],
            prompt_logprobs=seq.prompt_logprobs if seq.num_output_tokens == 1 else None,
            sampler_state=sampler_state,
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.pool.num_free,
            kv_cache_usage=bm.pool.usage(),
            prefix_cache_hit_rate=self.scheduler.prefix_cache_hit_rate(),
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens,
            num_reserved=sum(s.status is SequenceStatus.RESERVED for s in self.seqs.values()),
        )
