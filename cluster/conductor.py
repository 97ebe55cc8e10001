"""The Conductor (FAST'25 §4): the cluster's front door, an ``EngineClient`` over instances.

The OpenAI server (``server/app.py``) hands it each request. For one request it:

1. tokenizes the prompt and names its full blocks with the engine's chained prefix keys
   (``paged_kv.prefix_keys``), the keys the instances report as cached;
2. asks the policies of ``cluster/scheduling.py`` (the code the simulator runs) for a prefill
   instance (Algorithm 1: least predicted TTFT given each instance's cached prefix and queue)
   and a decode instance (least predicted TBT), and ``cluster/admission.py`` whether to accept;
   a refusal is ``EngineOverloaded``: HTTP 429 with Retry-After, before any prefill work;
3. when Algorithm 1 chose to pull a hot prefix from another prefill instance, has the blocks
   copied over the Messenger first (they stay cached there: hot-spot replication);
4. reserves the KV's blocks on the decode instance (one that answers 507, full, is skipped for
   the next best; none left is a 429), then has the prefill instance compute the prompt and
   stream the KV layer by layer into that reservation; the first token is yielded at once;
5. has the decode instance continue from the first token and relays its stream.

Instances that fail are marked down and skipped until they answer again; the requests they were
serving end with ``EngineError``. Leaving the iterator early aborts the request on every
instance that holds part of it. With only ``both`` instances the Conductor routes whole requests
to them (cache-aware), which is the colocated deployment behind the same front door.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cluster.admission import SLO, AcceptAll, AdmissionPolicy, EarlyRejection, PredictiveEarlyRejection
from cluster.cost_model import TransferModel
from cluster.instance_state import RequestInfo
from cluster.registry import InstanceRecord, Registry, RunningDecode
from cluster.scheduling import (
    DecodeLoadBalancer,
    GlobalCacheAwareScheduler,
    LoadBalancingScheduler,
    LocalCacheAwareScheduler,
    PrefillEstimator,
    PrefillPlan,
    PrefillScheduler,
    RandomScheduler,
)
from cluster.wire import auth_header, authorized, output_from_dict, params_to_dict
from engine.config import ModelConfig
from engine.default_model import resolve_model
from engine.llm_engine import RequestOutput
from engine.prompt import check_fits, prompt_token_ids
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from paged_kv.prefix_keys import chain_keys
from engine.async_engine import default_model_name
from engine.engine_client import EngineClient, EngineError, EngineNotReady, EngineOverloaded

log = logging.getLogger(__name__)

SCHEDULERS = ("random", "load", "local", "global")
ADMISSIONS = ("none", "early", "predictive")


@dataclass(frozen=True)
class ConductorConfig:
    secret: bytes
    model: str | None = None
    served_model_name: str | None = None
    instances: tuple[str, ...] = ()  # URLs to poll from the start; others register themselves
    scheduler: str = "global"
    kvcache_balancing_threshold: float = 2.0
    admission: str = "none"
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    predicted_decode_s: float = 5.0  # t_d of prediction-based early rejection
    transfer_bytes_per_s: float = 4e9  # what the TTFT estimate assumes for pulled prefixes
    poll_interval_s: float = 0.2
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.admission != "none" and (self.slo_ttft_s is None or self.slo_tbt_s is None):
            raise ValueError(f"admission {self.admission!r} needs both SLOs (TTFT and TBT seconds)")
        if self.kvcache_balancing_threshold < 1:
            raise ValueError("kvcache_balancing_threshold must be >= 1")
        for name in ("predicted_decode_s", "transfer_bytes_per_s", "poll_interval_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


@dataclass
class _Counters:
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    migrations: int = 0
    migrated_blocks: int = 0
    decode_retries: int = 0  # a decode instance was full (507) and the next one was tried
    per_reason: dict[str, int] = field(default_factory=dict)


class Conductor(EngineClient):
    def __init__(self, config: ConductorConfig) -> None:
        self.config = config
        self.registry = Registry(auth_header(config.secret), config.poll_interval_s)
        for url in config.instances:
            self.registry.add(url)
        self._model_name = config.served_model_name or default_model_name(config.model)
        self._tokenizer: Tokenizer | None = None
        self._vocab_size = 0
        self._load_error: str | None = None
        self._load_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._background: set[asyncio.Task] = set()
        self.counters = _Counters()
        self._max_running_seen = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._load_task is None:
            self._load_task = asyncio.create_task(self._load_tokenizer())
            self.registry.start()

    async def _load_tokenizer(self) -> None:
        def load() -> tuple[Tokenizer, int]:
            path = resolve_model(self.config.model)  # converts the default GGUF once if needed
            cfg = ModelConfig.from_folder(path)
            return Tokenizer(path, cfg.eos_token_ids), cfg.vocab_size

        try:
            self._tokenizer, self._vocab_size = await asyncio.get_running_loop().run_in_executor(None, load)
        except Exception as e:  # noqa: BLE001 -- reported through /health
            self._load_error = f"tokenizer failed to load: {type(e).__name__}: {e}"
            log.exception("tokenizer failed to load")

    async def shutdown(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.registry.close()

    @property
    def is_ready(self) -> bool:
        if self._tokenizer is None:
            return False
        return bool(self.registry.up("both")) or bool(
            self.registry.up("prefill") and self.registry.up("decode")
        )

    @property
    def load_error(self) -> str | None:
        if self._load_error or self.is_ready:
            return self._load_error
        broken = [f"{r.url} ({r.role or 'instance'}): {r.last_error}" for r in self.registry.records if r.failed_to_start]
        return "; ".join(broken) or None

    def readiness(self) -> str:
        if self._tokenizer is None:
            return self._load_error or "loading the tokenizer"
        up = {role: len(self.registry.up(role)) for role in ("prefill", "decode", "both")}
        return (f"waiting for instances: up prefill {up['prefill']}, decode {up['decode']}, "
                f"both {up['both']} of {len(self.registry.records)} known")

    # -- model facts -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineNotReady(self.readiness())
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        lens = [r.info["max_model_len"] for r in self.registry.records if r.up]
        if not lens:
            raise EngineNotReady(self.readiness())
        return min(lens)

    # -- registration (route on the Conductor's app) -----------------------------------------------
    async def register_route(self, request: Request) -> Response:
        if not authorized(request.headers.get("authorization"), self.config.secret):
            return JSONResponse({"error": "missing or wrong cluster secret"}, status_code=401)
        body = await request.json()
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return JSONResponse({"error": "url must be http(s)://host:port"}, status_code=400)
        rec = self.registry.add(url)
        if rec.instance_id != body.get("instance_id"):
            self.registry.mark_down(rec, "re-registered")  # re-read its info on the next poll
        await self.registry.poll(rec)
        return JSONResponse({"registered": url, "up": rec.up})

    # -- policies ----------------------------------------------------------------------------------
    def _estimator(self, prefills: list[InstanceRecord]) -> PrefillEstimator:
        ref = prefills[0]
        layout = ref.layout
        kv_per_token = layout.nbytes(1) // layout.block_size
        return PrefillEstimator(ref.profile.prefill, TransferModel(self.config.transfer_bytes_per_s, kv_per_token),
                                block_size=layout.block_size)

    def _scheduler(self, estimator: PrefillEstimator) -> PrefillScheduler:
        kind = self.config.scheduler
        if kind == "random":
            return RandomScheduler(estimator, seed=next(self._ids))
        if kind == "load":
            return LoadBalancingScheduler(estimator)
        if kind == "local":
            return LocalCacheAwareScheduler(estimator)
        return GlobalCacheAwareScheduler(estimator, self.config.kvcache_balancing_threshold)

    def _admission(self, decodes: list[InstanceRecord]) -> AdmissionPolicy:
        step = decodes[0].profile.decode
        if self.config.admission == "none":
            return AcceptAll(SLO(1.0, 1.0), step)
        slo = SLO(self.config.slo_ttft_s, self.config.slo_tbt_s)
        if self.config.admission == "early":
            return EarlyRejection(slo, step)
        return PredictiveEarlyRejection(slo, step, self.config.predicted_decode_s)

    def _validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        ids = prompt_token_ids(prompt, self.tokenizer, self._vocab_size)
        check_fits(len(ids), params.max_tokens, self.max_model_len, "the model's context")
        return ids

    # -- requests ----------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_ready:
            raise EngineNotReady(self.readiness())
        ids = self._validate(prompt, params)
        if self.registry.up("prefill") and self.registry.up("decode"):
            stream = self._disaggregated(request_id, ids, params)
        elif self.registry.up("both"):
            stream = self._colocated(request_id, ids, params)
        else:  # instances went down since the check above
            raise EngineNotReady(self.readiness())
        async for out in stream:
            yield out

    def _request_info(self, ids: list[int], block_size: int) -> RequestInfo:
        # As the engines' prefix cache: at most len-1 tokens can hit (the last is always computed).
        keys = chain_keys(ids[: (len(ids) - 1) // block_size * block_size], block_size)
        return RequestInfo(next(self._ids), len(ids), keys)

    def _reject(self, reason: str, retry_after: float) -> EngineOverloaded:
        self.counters.rejected += 1
        self.counters.per_reason[reason] = self.counters.per_reason.get(reason, 0) + 1
        return EngineOverloaded(reason, retry_after=max(1.0, retry_after))

    async def _disaggregated(
        self, rid: str, ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        prefills, decodes = self.registry.up("prefill"), self.registry.up("decode")
        estimator = self._estimator(prefills)
        info = self._request_info(ids, estimator.block_size)
        now = time.monotonic()
        plan = self._scheduler(estimator).select(info, [r.prefill_state(i, now) for i, r in enumerate(prefills)])
        decode_states = [r.decode_state(i) for i, r in enumerate(decodes)]
        admission = self._admission(decodes)
        dplan = DecodeLoadBalancer(admission.step).select(info, decode_states)
        decision = admission.on_arrival(now, info, plan, dplan, decode_states)
        if not decision.accept:
            raise self._reject(
                f"overloaded: predicted prefill load {decision.prefill_load:.2f}, decode load "
                f"{decision.decode_load:.2f} (1.0 = at the SLO)", plan.queue_s)
        prefill = prefills[plan.instance]
        # Decode instances in order of preference: the planned one, then by predicted TBT.
        order = sorted(range(len(decodes)), key=lambda i: (i != dplan.instance, admission.tbt_with(info, decode_states[i])))
        holding: set[InstanceRecord] = set()  # instances holding part of this request
        try:
            decode, dest = await self._reserve(rid, ids, params, [decodes[i] for i in order], holding)
            self.counters.accepted += 1
            if plan.source is not None and prefills[plan.source] is not prefill:
                await self._migrate(rid, ids, plan, prefills[plan.source], prefill)
            decode.incoming[rid] = (now + plan.ttft_s, len(ids))
            prefill.prefilling[rid] = (time.monotonic(), plan.prefill_s)
            holding.add(prefill)
            try:
                first = await self._prefill(prefill, rid, ids, params, dest)
            finally:
                prefill.prefilling.pop(rid, None)
                decode.incoming.pop(rid, None)
            holding.discard(prefill)
            handoff = first.finish_reason == "handoff"
            if handoff:
                first.finished, first.finish_reason = False, None
            # else: done at its first token; the decode reservation is released below
            sampler_state, first.sampler_state = first.sampler_state, None
            yield first
            if not handoff:
                return
            async for out in self._decode(decode, rid, ids, params, first, sampler_state, holding):
                yield out
        except EngineError:
            self.counters.failed += 1
            raise
        finally:
            # Once the prefill has answered, no KV write into the reservation is in flight.
            settled = prefill not in holding
            for rec in holding:
                self._spawn(self._abort_on(rec, rid, settled))

    async def _reserve(self, rid, ids, params, decodes, holding) -> tuple[InstanceRecord, dict]:
        body = {"request_id": rid, "prompt_token_ids": ids, "params": params_to_dict(params)}
        full = []
        for rec in decodes:
            try:
                r = await self.registry.http.post(rec.url + "/instance/reserve", json=body)
            except httpx.HTTPError as e:
                self.registry.mark_down(rec, f"reserve: {type(e).__name__}: {e}")
                continue
            if r.status_code == 200:
                holding.add(rec)
                return rec, r.json()["dest"]
            if r.status_code == 507:
                full.append(rec.url)
                self.counters.decode_retries += 1
                continue
            if r.status_code == 400:
                raise ValueError(r.json().get("error", r.text))
            self.registry.mark_down(rec, f"reserve: HTTP {r.status_code} {r.text[:200]}")
        if full:
            raise self._reject(f"no decode instance has room for the KV ({len(full)} full)", 1.0)
        raise EngineError("no decode instance answered")

    async def _prefill(self, rec: InstanceRecord, rid, ids, params, dest) -> RequestOutput:
        body = {"request_id": rid, "prompt_token_ids": ids, "params": params_to_dict(params), "dest": dest}
        try:
            r = await self.registry.http.post(rec.url + "/instance/prefill", json=body,
                                              timeout=self.config.request_timeout_s)
        except httpx.HTTPError as e:
            self.registry.mark_down(rec, f"prefill: {type(e).__name__}: {e}")
            raise EngineError(f"prefill instance {rec.url} failed: {type(e).__name__}") from None
        if r.status_code == 400:
            raise ValueError(r.json().get("error", r.text))
        if r.status_code != 200:
            raise EngineError(f"prefill instance {rec.url} failed: HTTP {r.status_code} {r.text[:300]}")
        return output_from_dict(r.json()["output"])

    async def _decode(self, rec, rid, ids, params, first, sampler_state, holding) -> AsyncIterator[RequestOutput]:
        body = {
            "request_id": rid, "prompt_token_ids": ids, "params": params_to_dict(params),
            "prefilled": {
                "first_token": first.new_token_ids[0],
                "sampler_state": None if sampler_state is None else base64.b64encode(sampler_state).decode(),
                "num_cached_tokens": first.num_cached_tokens,
            },
        }
        entry = rec.running[rid] = RunningDecode(time.monotonic(), len(ids))
        self._max_running_seen = max(self._max_running_seen, sum(len(r.running) for r in self.registry.records))
        try:
            async for out in self._relay(rec, body, entry):
                yield out
            holding.discard(rec)  # finished there: nothing to abort
        finally:
            rec.running.pop(rid, None)

    async def _relay(self, rec: InstanceRecord, body: dict, entry: RunningDecode | None) -> AsyncIterator[RequestOutput]:
        """POST /instance/generate and yield its NDJSON deltas until the finished one."""
        try:
            async with self.registry.http.stream("POST", rec.url + "/instance/generate", json=body,
                                                 timeout=httpx.Timeout(10.0, read=self.config.request_timeout_s)) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")[:300]
                    if r.status_code == 400:
                        raise ValueError(text)
                    raise EngineError(f"instance {rec.url} refused the request: HTTP {r.status_code} {text}")
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    data = json.loads(line)
                    if "error" in data:
                        raise EngineError(f"instance {rec.url}: {data['error']}")
                    out = output_from_dict(data)
                    if entry is not None:
                        entry.generated += len(out.new_token_ids)
                    yield out
                    if out.finished:
                        return
        except httpx.HTTPError as e:
            self.registry.mark_down(rec, f"generate: {type(e).__name__}: {e}")
            raise EngineError(f"instance {rec.url} failed mid-stream: {type(e).__name__}") from None
        raise EngineError(f"instance {rec.url} ended the stream before the request finished")

    async def _colocated(self, rid: str, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        boths = self.registry.up("both")
        estimator = self._estimator(boths)
        info = self._request_info(ids, estimator.block_size)
        now = time.monotonic()
        plan = self._scheduler(estimator).select(info, [r.prefill_state(i, now) for i, r in enumerate(boths)])
        rec = boths[plan.instance]
        body = {"request_id": rid, "prompt_token_ids": ids, "params": params_to_dict(params)}
        rec.prefilling[rid] = (now, plan.prefill_s)
        finished = False
        try:
            async for out in self._relay(rec, body, None):
                rec.prefilling.pop(rid, None)
                finished = out.finished
                yield out
        except EngineError:
            self.counters.failed += 1
            raise
        finally:
            rec.prefilling.pop(rid, None)
            if not finished:
                self._spawn(self._abort_on(rec, rid))

    async def _migrate(self, rid: str, ids: list[int], plan: PrefillPlan, source: InstanceRecord,
                       target: InstanceRecord) -> None:
        """Hot-spot replication: copy the prefix blocks ``plan`` pulls from ``source`` into
        ``target``'s cache over the Messenger before the prefill there."""
        block_size = target.layout.block_size
        prefix = ids[: plan.prefix_tokens // block_size * block_size]
        if not prefix:
            return
        mid = f"{rid}:migrate"
        body = {"request_id": mid, "prompt_token_ids": prefix}
        try:
            r = await self.registry.http.post(target.url + "/instance/reserve", json={
                **body, "params": params_to_dict(SamplingParams(max_tokens=1))})
            if r.status_code != 200:
                log.info("migration to %s skipped: HTTP %s", target.url, r.status_code)
                return
            dest = r.json()["dest"]
            r = await self.registry.http.post(source.url + "/instance/push", json={**body, "dest": dest})
            ok = r.status_code == 200
            r2 = await self.registry.http.post(target.url + "/instance/adopt", json={"request_id": mid, "ok": ok})
            if ok and r2.status_code == 200:
                self.counters.migrations += 1
                self.counters.migrated_blocks += dest["num_blocks"]
            else:
                log.info("migration from %s to %s failed: %s / %s", source.url, target.url, r.text[:200], r2.text[:200])
        except httpx.HTTPError as e:
            # The request still prefills; it just recomputes the prefix it meant to pull.
            log.info("migration from %s to %s failed: %s", source.url, target.url, e)
            self._spawn(self._abort_on(target, mid))

    async def _abort_on(self, rec: InstanceRecord, rid: str, writes_done: bool = False) -> None:
        try:
            await self.registry.http.post(rec.url + "/instance/abort", json={"request_id": rid, "writes_done": writes_done},
                                          timeout=5.0)
        except httpx.HTTPError as e:
            self.registry.mark_down(rec, f"abort: {type(e).__name__}: {e}")

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, request_id: str) -> None:
        for rec in self.registry.records:
            if request_id in rec.prefilling or request_id in rec.running or request_id in rec.incoming:
                await self._abort_on(rec, request_id)

    # -- statistics --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        up = [r for r in self.registry.records if r.up and r.state]
        totals: dict[str, Any] = {}
        for rec in up:
            for k, v in rec.state.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "cache_version":
                    totals[k] = totals.get(k, 0) + v
        if up:
            # What one request can use is one instance's cache, not the sum.
            totals["num_blocks"] = min(r.state.get("num_blocks", 0) for r in up)
            totals["block_size"] = up[0].state.get("block_size", 0)
            totals["kv_cache_usage"] = sum(r.state.get("kv_cache_usage", 0.0) for r in up) / len(up)
        c = self.counters
        totals.update({
            "ready": self.is_ready,
            "mode": "disaggregated" if self.registry.up("prefill") else "colocated",
            "requests_accepted": c.accepted, "requests_rejected": c.rejected,
            "requests_failed": c.failed, "rejections_by_reason": dict(c.per_reason),
            "decode_reservation_retries": c.decode_retries,
            "migrations": c.migrations, "migrated_blocks": c.migrated_blocks,
            "max_num_running_seen": max(self._max_running_seen, totals.get("max_num_running_seen", 0)),
            "instances": [r.describe() for r in self.registry.records],
        })
        return totals
