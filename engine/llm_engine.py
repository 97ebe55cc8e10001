"""The engine: requests in, tokens out, one ``step()`` at a time.

``step()`` is three calls (as in nano-vllm): the scheduler picks this step's chunks, the model
runner computes logits for them, and postprocessing samples, detokenizes, checks stop
conditions and frees finished sequences. What the cluster hooks into a step (KV sinks, KV loads,
a pipeline stage's hand-on) is built in one place beside it: ``engine/hooks.py``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.cpu_runtime import HeapBound, configure_cpu_runtime
from engine.default_model import resolve_model
from engine.detokenizer import IncrementalDetokenizer
from engine.hooks import KVSink, StepHooks
from engine.model_runner import ModelRunner
from engine.outputs import Logprobs, RequestOutput
from engine.prompt import check_fits, prompt_token_ids
from engine.sampler import Sampler, score_tokens
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.session import SessionHint
from engine.tokenizer import Tokenizer
from paged_kv import BlockManager

log = logging.getLogger(__name__)


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


class StepFailed(Exception):
    """A step's forward pass raised; ``request_ids``: the requests of its batch, none advanced.
    ``retryable``: the step touched nothing outside the engine (no KV streamed or loaded, no
    pipeline stage told), so its requests may step again."""

    def __init__(self, request_ids: list[str], retryable: bool) -> None:
        super().__init__(f"a step of {len(request_ids)} request(s) failed")
        self.request_ids = request_ids
        self.retryable = retryable


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        # What a prompt's first token ends: here the engine's ``role``, not the config's, because
        # an elastic instance changes it between steps once it holds nothing (``KVHandoff.switch_role``).
        self.role = config.role
        # On CPU, how far the heap's kept memory grows while busy is bounded (``HeapBound``);
        # None elsewhere, or with the bound off.
        self.heap: HeapBound | None = None
        if config.device == "cpu":
            configure_cpu_runtime(config.threads)
            if config.busy_heap_free_mib is not None:
                self.heap = HeapBound(int(config.busy_heap_free_mib * (1 << 20)))
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
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, config.session_retention_share
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler()
        self.seqs: dict[str, Sequence] = {}
        self.last_batch: list[str] = []  # the request ids the last step scheduled
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
        session: SessionHint | None = None,
    ) -> str:
        """Queue a request; raises ValueError (and changes nothing) when it cannot be served.
        ``session``: its KV is retained after it ends (``EngineConfig.session_retention_s``)."""
        seq = self.new_sequence(prompt, params, request_id, session)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def new_sequence(
        self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
        session: SessionHint | None = None,
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
        if params.logit_bias and max(params.logit_bias) >= self.tokenizer.vocab_size:
            raise ValueError(f"logit_bias names token id {max(params.logit_bias)}, outside the vocabulary "
                             f"[0, {self.tokenizer.vocab_size})")
        detok = IncrementalDetokenizer(self.tokenizer.hf, ids, params.stop, params.skip_special_tokens,
                                       params.min_tokens)
        matcher = self.tokenizer.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
        return Sequence(request_id, ids, params, detok, self.config.device, session, self.tokenizer.eos_token_ids,
                        matcher)

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
    def step(self, only: Collection[str] | None = None) -> list[RequestOutput]:
        """One step of the batch the scheduler forms; ``only``: of these requests alone (the rest
        wait). Raises ``StepFailed`` when the forward pass raised: no sequence has advanced, and
        where the step reached nothing outside the engine (``retryable``) the same requests can
        step again, e.g. without the one that made it fail."""
        only_seqs = None if only is None else {self.seqs[r] for r in only if r in self.seqs}
        batch = self.scheduler.schedule(only_seqs)
        self.last_batch = [s.seq.request_id for s in batch]
        if not batch:
            return []
        hooks = StepHooks(batch, self.kv_sinks, self.runner.kv_cache, self.runner.downstream is not None)
        try:
            logits, sampling, scores = self.runner.run(batch, hooks.on_layer, hooks.before_layer, hooks.handed_on)
        except Exception as e:
            # Blocks were grown and KV written past what each sequence has computed, nothing more:
            # the next step computes (and writes) the same tokens again.
            raise StepFailed([s.seq.request_id for s in batch], not hooks.reaches_out) from e
        outputs = self._postprocess_step(batch, hooks, logits, sampling, scores)
        if self.heap is not None:
            del logits, sampling, scores  # the step's temporaries are free before the heap is measured
            self.heap.after_step()
        return outputs

    def _postprocess_step(self, batch: list[ScheduledSeq], hooks: StepHooks, logits: torch.Tensor,
                          sampling: list[ScheduledSeq], scores: list[tuple[Sequence, range, torch.Tensor]]
                          ) -> list[RequestOutput]:
        """Advance every sequence of the step by what it computed, score the prompts that asked,
        then sample and postprocess each sampling row. A sequence whose KV load failed is ended
        (``kv_load_failed``) instead: its KV past the failed layer is garbage, never published."""
        failed = hooks.settle_loads()
        outputs = [self._end(seq, "kv_load_failed") for seq in failed]
        for s in batch:
            seq = s.seq
            if seq in failed:
                continue
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
        stop_reason: int | str | None = None  # what stopped it, as vLLM reports (None: EOS, length)
        text = ""
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        else:
            text = seq.detokenizer.add(token)
            if seq.detokenizer.stopped:
                reason, stop_reason = "stop", seq.detokenizer.stopped_by
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        sampler_state = None
        if reason is None and self.role == "prefill":
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
            stop_reason=stop_reason,
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
