"""Offline API: ``LLM(model=...).generate(prompts, params)`` runs a batch to completion."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None  # when ``SamplingParams.prompt_logprobs`` asked


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (continuous batching); results in prompt order.

        If any prompt is invalid this raises before generating anything, and if generation
        fails or is interrupted it raises too: either way none of this call's requests is left
        queued to run inside a later call.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        token_ids = [self.engine.tokenize(p) for p in prompts]
        results: dict[str, GenerationResult] = {}
        try:
            # add_request validates each prompt as it queues it (e.g. whether max_tokens fits),
            # so a bad prompt is only found once the ones before it are queued.
            for ids, p in zip(token_ids, params_list):
                rid = self.engine.add_request(ids, p)
                results[rid] = GenerationResult(rid, ids)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    r = results.get(out.request_id)
                    if r is None:
                        continue  # someone else's request on a shared engine
                    r.text += out.new_text
                    r.token_ids.extend(out.new_token_ids)
                    r.logprobs.extend(out.logprobs)
                    if out.prompt_logprobs is not None:
                        r.prompt_logprobs = out.prompt_logprobs
                    r.num_cached_tokens = out.num_cached_tokens
                    if out.finished:
                        r.finish_reason = out.finish_reason
        except BaseException:
            for rid in results:
                self.engine.abort(rid)  # a no-op for the ones already finished
            raise
        return list(results.values())
