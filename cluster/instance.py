"""A prefill, decode or colocated ("both") instance: one engine process the Conductor drives.

``python -m server --role prefill|decode|both --conductor URL`` runs this. The engine is the
same ``AsyncLLMEngine`` the single-process server uses; around it the instance adds a Messenger
(``TransferEngine``), staging memory for KV in flight, and control routes for the Conductor
(all under ``/instance``, all needing ``Authorization: Bearer <cluster secret hex>``):

* ``GET  /instance/info``     role, model facts, KV page layout, Messenger address, measured profile
* ``GET  /instance/state``    load, free blocks, and the cached prefix keys (only when changed)
* ``POST /instance/reserve``  hold blocks + a receive-staging range for a prompt's KV (decode;
  or a pulled prefix on a prefill instance); 507 when there is no room now
* ``POST /instance/prefill``  (prefill) compute a prompt, stream its KV layer by layer into the
  given destination, answer the first token once the last layer has been written
* ``POST /instance/generate`` (decode/both) stream the rest of a request as NDJSON
  ``RequestOutput`` deltas: from a reservation whose KV has landed, or (both) from the prompt
* ``POST /instance/abort``    drop a request wherever it is (idempotent)
* ``POST /instance/push``     (prefill) send cached prefix blocks into another instance's
  reservation; ``POST /instance/adopt`` there keeps them as cached blocks (hot-spot replication)

At start the instance loads the model, calibrates its cost models (``cluster/calibration.py``),
and registers with the Conductor; it registers again whenever the Conductor has not polled it
for a while (the Conductor restarted, or lost it). Reservations never taken over within
``reservation_ttl_s`` are released, so a vanished Conductor cannot leak blocks.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cluster.calibration import InstanceProfile, profile
from cluster.kv_stream import KVDestination, KVLayout, KVSender, pack, settle
from cluster.staging import StagingArea, StagingFull, StagingRange
from cluster.transfer import TransferConfig, TransferEngine, TransferError
from cluster.wire import auth_header, authorized, output_to_dict, params_from_dict, token_ids
from engine.config import EngineConfig
from engine.llm_engine import KVCapacityError, LLMEngine
from engine.sequence import SequenceStatus
from paged_kv.prefix_keys import chain_keys
from engine.async_engine import AsyncLLMEngine
from engine.engine_client import EngineError, EngineNotReady

log = logging.getLogger(__name__)

_GIB = 1 << 30


@dataclass(frozen=True)
class InstanceConfig:
    engine: EngineConfig
    url: str  # how the Conductor reaches this instance, e.g. http://127.0.0.1:8101
    secret: bytes  # the cluster secret: Messenger authentication and the control routes
    conductor: str | None = None  # the Conductor's URL to register with; None: it polls us
    staging_gib: float = 0.5  # send and receive staging, each (raised to one max-length prompt's KV)
    reservation_ttl_s: float = 600.0  # the Conductor gives up on a request after 600 s too
    transfer_timeout_s: float = 30.0
    calibration_seed: int = 0

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be positive, got {self.transfer_timeout_s}")
        if not self.staging_gib > 0:
            raise ValueError(f"staging_gib must be positive, got {self.staging_gib}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"instance url must be http(s)://host:port, got {self.url!r}")

    @property
    def role(self) -> str:
        return self.engine.role


@dataclass
class _Reservation:
    staging: StagingRange | None
    num_blocks: int  # blocks the prefill sends
    created: float


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class Instance:
    def __init__(self, config: InstanceConfig) -> None:
        self.config = config
        self.client = AsyncLLMEngine(config.engine, max_waiting=1 << 30)  # the Conductor does admission
        self.transfer: TransferEngine | None = None
        self.layout: KVLayout | None = None
        self.profile: InstanceProfile | None = None
        self.send: StagingArea | None = None
        self.recv: StagingArea | None = None
        self.sender: KVSender | None = None
        self.reservations: dict[str, _Reservation] = {}
        self.ready = False
        self.error: str | None = None
        self.last_polled = 0.0
        self.instance_id = secrets.token_hex(6)  # a restarted instance is a new one
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.client.start()
        self._tasks.append(asyncio.create_task(self._bring_up()))

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.client.shutdown()
        if self.transfer is not None:
            self.transfer.close()

    async def _bring_up(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            if not await loop.run_in_executor(None, self.client.wait_ready):
                self.error = self.client.load_error or "the engine stopped while loading"
                return
            cfg = self.config
            host = cfg.url.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
            self.transfer = TransferEngine(TransferConfig(secret=cfg.secret, host=host, timeout_s=cfg.transfer_timeout_s))
            self.layout = await self.client.call(lambda e: KVLayout.of_cache(e.runner.kv_cache))
            max_len = await self.client.call(lambda e: e.max_model_len)
            # At least one longest-possible prompt's KV fits, so a valid request never finds the
            # staging too small for good, only busy for a moment.
            staging = max(int(cfg.staging_gib * _GIB), self.layout.nbytes(-(-max_len // self.layout.block_size)))
            if cfg.role in ("prefill", "both"):
                self.send = StagingArea(self.transfer, staging)
                sender = self.sender = KVSender(self.transfer, self.send, self.layout)
                await self.client.call(lambda e: setattr(e, "kv_sink", sender))
            # Every role receives: decode instances a prompt's KV, prefill ones pulled hot prefixes.
            self.recv = StagingArea(self.transfer, staging)
            started = time.perf_counter()
            self.profile = await self.client.call(lambda e: profile(e, cfg.calibration_seed))
            log.info("calibrated in %.1f s: %s", time.perf_counter() - started, self.profile)
            self.ready = True
            self._tasks.append(asyncio.create_task(self._reap_reservations()))
            if cfg.conductor:
                self._tasks.append(asyncio.create_task(self._register_loop()))
        except Exception as e:  # noqa: BLE001 -- reported through /health
            self.error = f"instance failed to start: {type(e).__name__}: {e}"
            log.exception("instance failed to start")

    async def _register_loop(self) -> None:
        url = self.config.conductor.rstrip("/") + "/cluster/register"
        body = {"url": self.config.url, "instance_id": self.instance_id}
        async with httpx.AsyncClient(timeout=5.0, headers=auth_header(self.config.secret)) as http:
            while True:
                if time.monotonic() - self.last_polled > 5.0:
                    try:
                        r = await http.post(url, json=body)
                        if r.status_code != 200:
                            log.warning("conductor refused registration: %s %s", r.status_code, r.text)
                    except httpx.HTTPError as e:
                        log.info("conductor %s not reachable yet (%s)", self.config.conductor, e)
                await asyncio.sleep(1.0)

    async def _reap_reservations(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.config.reservation_ttl_s))
            now = time.monotonic()
            for rid in [r for r, v in self.reservations.items() if now - v.created > self.config.reservation_ttl_s]:
                log.warning("releasing reservation %s: not taken over in %.0f s", rid, self.config.reservation_ttl_s)
                await self._abort(rid)

    # -- routes -----------------------------------------------------------------------------------
    def _check(self, request: Request, roles: tuple[str, ...] | None = None) -> Response | None:
        if not authorized(request.headers.get("authorization"), self.config.secret):
            return _error(401, "missing or wrong cluster secret")
        if not self.ready:
            # "fatal": the engine could not start and will not by itself (a bad model, say).
            return JSONResponse({"error": self.error or "instance is starting", "fatal": self.error is not None},
                                status_code=503)
        if roles is not None and self.config.role not in roles:
            return _error(400, f"a {self.config.role} instance does not do this")
        return None

    async def health(self, request: Request) -> Response:
        if self.ready and self.client.is_ready:
            return JSONResponse({"status": "ok", "role": self.config.role})
        return JSONResponse({"status": "error" if self.error else "starting", "error": self.error}, status_code=503)

    async def info(self, request: Request) -> Response:
        if (denied := self._check(request)) is not None:
            return denied
        self.last_polled = time.monotonic()
        engine_facts = await self.client.call(
            lambda e: {"max_model_len": e.max_model_len, "vocab_size": e.model_config.vocab_size,
                       "num_blocks": e.block_manager.num_blocks, "model_path": str(e.model_path)}
        )
        return JSONResponse({
            "instance_id": self.instance_id,
            "pid": os.getpid(),
            "role": self.config.role,
            "url": self.config.url,
            "transfer_address": self.transfer.address,
            "layout": self.layout.to_dict(),
            "profile": self.profile.to_dict(),
            **engine_facts,
        })

    async def state(self, request: Request) -> Response:
        if (denied := self._check(request)) is not None:
            return denied
        self.last_polled = time.monotonic()
        since = request.query_params.get("since")

        def snapshot(e: LLMEngine) -> dict[str, Any]:
            pool = e.block_manager.pool
            keys = None if since is not None and since == str(pool.version) else [k.hex() for k in pool.cached_keys()]
            return {"cache_version": pool.version, "cached_keys": keys}

        return JSONResponse({"instance_id": self.instance_id, **self.stats(), **(await self.client.call(snapshot))})

    def stats(self) -> dict[str, Any]:
        s = self.client.stats()
        s["role"] = self.config.role
        s["num_reservations"] = len(self.reservations)
        for name, area in (("send", self.send), ("recv", self.recv)):
            if area is not None:
                s[f"staging_{name}_free_bytes"] = area.num_free_bytes
                s[f"staging_{name}_bytes"] = area.nbytes
                s[f"staging_{name}_ranges"] = area.num_allocated
        return s

    async def stats_route(self, request: Request) -> Response:
        return JSONResponse(self.stats())

    async def _body(self, request: Request) -> tuple[str, list[int], Any, dict]:
        body = await request.json()
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise ValueError("request_id must be a non-empty string")
        return rid, token_ids(body.get("prompt_token_ids")), params_from_dict(body.get("params")), body

    async def reserve(self, request: Request) -> Response:
        if (denied := self._check(request)) is not None:
            return denied
        try:
            rid, ids, params, _ = await self._body(request)
            res = await self.client.call(lambda e: e.reserve(rid, ids, params))
        except KVCapacityError as e:
            return _error(507, f"no room for the KV: {e}")
        except (ValueError, json.JSONDecodeError) as e:
            return _error(400, str(e))
        n = len(res.block_ids) - res.cached_blocks
        staging = None
        if n:
            try:
                staging = self.recv.allocate(self.layout.nbytes(n))
            except (StagingFull, ValueError) as e:
                await self.client.call(lambda eng: eng.abort(rid))
                return _error(507, f"no room for the KV: {e}")
        self.reservations[rid] = _Reservation(staging, n, time.monotonic())
        dest = KVDestination(self.transfer.address, self.recv.handle, staging.offset if staging else 0,
                             res.cached_blocks, n)
        return JSONResponse({"dest": dest.to_dict()})

    async def prefill(self, request: Request) -> Response:
        if (denied := self._check(request, ("prefill",))) is not None:
            return denied
        try:
            rid, ids, params, body = await self._body(request)
            dest = KVDestination.from_dict(body.get("dest"))
        except (ValueError, json.JSONDecodeError) as e:
            return _error(400, str(e))
        if dest.skip_blocks + dest.num_blocks != -(-len(ids) // self.layout.block_size):
            return _error(400, "destination block count does not match the prompt")
        try:
            await self._until_staged(lambda: self.sender.expect(rid, dest))
        except (ValueError, asyncio.TimeoutError) as e:
            return _error(503 if isinstance(e, asyncio.TimeoutError) else 400, str(e) or "send staging stayed full")
        output = None
        failure: Response | None = None
        try:
            async for out in self.client.generate(rid, ids, params):
                output = out
        except ValueError as e:
            failure = _error(400, str(e))
        except (EngineError, EngineNotReady) as e:
            failure = _error(500, str(e))
        try:
            # Always: frees the send staging once no write can still read it.
            await self.sender.finish(rid, self.config.transfer_timeout_s)
        except TransferError as e:
            if failure is None and output is not None and output.finish_reason != "abort":
                failure = _error(502, f"KV transfer to {dest.address} failed: {e}")
        if failure is not None:
            return failure
        return JSONResponse({"output": output_to_dict(output)})

    async def _until_staged(self, allocate):
        """``allocate()``, retried while the send staging is full (for at most the transfer timeout:
        earlier requests free theirs as their writes complete)."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while True:
            try:
                return allocate()
            except StagingFull:
                if time.monotonic() > deadline:
                    raise asyncio.TimeoutError("send staging stayed full") from None
                await asyncio.sleep(0.005)

    async def push(self, request: Request) -> Response:
        """Send cached prefix blocks to another instance's reservation (hot-spot replication)."""
        if (denied := self._check(request, ("prefill", "both"))) is not None:
            return denied
        try:
            body = await request.json()
            rid, ids = body.get("request_id"), token_ids(body.get("prompt_token_ids"))
            dest = KVDestination.from_dict(body.get("dest"))
        except (ValueError, json.JSONDecodeError, AttributeError) as e:
            return _error(400, str(e))
        layout, send = self.layout, self.send
        if not dest.num_blocks:
            return JSONResponse({"pushed": 0})
        try:
            staging = await self._until_staged(lambda: send.allocate(layout.nbytes(dest.num_blocks)))
        except (ValueError, asyncio.TimeoutError) as e:
            return _error(503, str(e) or "send staging stayed full")
        batch = None
        try:
            def gather(e: LLMEngine) -> None:
                # One engine-thread call: nothing can evict the blocks between lookup and copy.
                blocks = e.block_manager.pool.lookup(chain_keys(ids, layout.block_size))
                wanted = blocks[dest.skip_blocks : dest.skip_blocks + dest.num_blocks]
                if len(wanted) != dest.num_blocks:
                    raise ValueError(f"{rid}: only {len(blocks)} of the prefix blocks are cached here now")
                pack(e.runner.kv_cache, wanted, None, send.view(staging, e.runner.kv_cache.dtype, layout.shape(dest.num_blocks)))

            await self.client.call(gather)
            batch = self.transfer.write(dest.address, [(send.handle, staging.offset, dest.region, dest.offset, staging.nbytes)])
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(batch)), self.config.transfer_timeout_s)
        except ValueError as e:
            return _error(409, str(e))
        except (TransferError, asyncio.TimeoutError) as e:
            return _error(502, f"push to {dest.address} failed: {e}")
        finally:
            if batch is not None:  # a timed-out write may still read the staging
                await asyncio.get_running_loop().run_in_executor(None, settle, [batch], self.config.transfer_timeout_s)
            send.release(staging)
        return JSONResponse({"pushed": dest.num_blocks})

    async def adopt(self, request: Request) -> Response:
        """Keep a reservation's received blocks as cached prefix (``ok``) or drop it."""
        if (denied := self._check(request)) is not None:
            return denied
        try:
            body = await request.json()
            rid = body["request_id"]
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            return _error(400, f"request_id needed: {e}")
        if rid not in self.reservations:
            return _error(404, f"no KV reservation for {rid!r}")
        if body.get("ok") is not True:
            # The push failed, perhaps by timing out: a late write could still land in the
            # staging, so it is held back like any abandoned reservation's.
            await self._abort(rid)
            return JSONResponse({"adopted": 0})
        res = self.reservations.pop(rid)
        try:
            adopted = await self.client.call(lambda e: self._take_over(e, rid, res, lambda kv: e.adopt_prefix(rid, kv)))
            return JSONResponse({"adopted": adopted})
        finally:
            if res.staging is not None:
                self.recv.release(res.staging)

    async def generate(self, request: Request) -> Response:
        if (denied := self._check(request, ("decode", "both"))) is not None:
            return denied
        try:
            rid, ids, params, body = await self._body(request)
        except (ValueError, json.JSONDecodeError) as e:
            return _error(400, str(e))
        prefilled = body.get("prefilled")
        if prefilled is None:
            if self.config.role != "both":
                return _error(400, "a decode instance only continues requests whose KV it received")
            stream = self.client.generate(rid, ids, params)
        else:
            res = self.reservations.pop(rid, None)
            if res is None:
                return _error(404, f"no KV reservation for {rid!r}")
            stream = self.client.stream(rid, self._admitter(rid, res, prefilled))
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return _error(500, "the engine ended the request without output")
        except ValueError as e:
            return _error(400, str(e))
        except (EngineError, EngineNotReady) as e:
            return _error(500, str(e))
        return StreamingResponse(_ndjson(first, stream), media_type="application/x-ndjson")

    def _admitter(self, rid: str, res: _Reservation, prefilled: dict):
        first = prefilled.get("first_token")
        state = prefilled.get("sampler_state")
        cached = prefilled.get("num_cached_tokens", 0)

        def admit(engine: LLMEngine, kv: torch.Tensor | None) -> None:
            if type(first) is not int or type(cached) is not int:
                raise ValueError("prefilled needs first_token and num_cached_tokens integers")
            engine.admit_prefilled(rid, kv, first, None if state is None else base64.b64decode(state), cached)

        def start(engine: LLMEngine) -> None:
            try:
                self._take_over(engine, rid, res, lambda kv: admit(engine, kv))
            finally:
                if res.staging is not None:
                    self.recv.release(res.staging)

        return start

    def _take_over(self, engine: LLMEngine, rid: str, res: _Reservation, use):
        """On the engine thread: give ``use`` the reservation's received KV (a view of its staging;
        None when every block was cached here). If that fails, the reservation's blocks go back."""
        try:
            kv = None
            if res.staging is not None:
                kv = self.recv.view(res.staging, engine.runner.kv_cache.dtype, self.layout.shape(res.num_blocks))
            return use(kv)
        except BaseException:
            engine.abort(rid)
            raise

    async def abort(self, request: Request) -> Response:
        if not authorized(request.headers.get("authorization"), self.config.secret):
            return _error(401, "missing or wrong cluster secret")
        try:
            body = await request.json()
            rid = body.get("request_id")
        except (json.JSONDecodeError, AttributeError) as e:
            return _error(400, str(e))
        if not isinstance(rid, str):
            return _error(400, "request_id must be a string")
        if self.client.is_ready:
            await self._abort(rid, settled=body.get("writes_done") is True)
        return JSONResponse({"aborted": rid})

    async def _abort(self, rid: str, settled: bool = False) -> None:
        """Drop ``rid``. Its receive staging is reused at once only when ``settled`` (the sender
        has finished writing); otherwise a prefill may still be writing into it, so it is held
        back until any such write has completed or timed out."""
        await self.client.abort(rid)  # a live request (its stream ends with "abort")
        res = self.reservations.pop(rid, None)
        if res is not None:
            def drop(e: LLMEngine) -> None:
                seq = e.seqs.get(rid)
                if seq is not None and seq.status is SequenceStatus.RESERVED:
                    e.abort(rid)

            await self.client.call(drop)
            if res.staging is not None:
                if settled:
                    self.recv.release(res.staging)
                else:
                    asyncio.get_running_loop().call_later(self.config.transfer_timeout_s, self.recv.release, res.staging)


async def _ndjson(first, stream: AsyncIterator) -> AsyncIterator[bytes]:
    # Leaving early (the Conductor disconnected) closes ``stream``, which aborts the request.
    try:
        yield (json.dumps(output_to_dict(first)) + "\n").encode()
        if first.finished:
            return
        async for out in stream:
            yield (json.dumps(output_to_dict(out)) + "\n").encode()
    except (EngineError, EngineNotReady, ValueError) as e:
        yield (json.dumps({"error": str(e)}) + "\n").encode()
    finally:
        await stream.aclose()


def build_instance_app(instance: Instance) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):
        await instance.start()
        try:
            yield
        finally:
            await instance.shutdown()

    routes = [
        Route("/health", instance.health, methods=["GET"]),
        Route("/stats", instance.stats_route, methods=["GET"]),
        Route("/instance/info", instance.info, methods=["GET"]),
        Route("/instance/state", instance.state, methods=["GET"]),
        Route("/instance/reserve", instance.reserve, methods=["POST"]),
        Route("/instance/prefill", instance.prefill, methods=["POST"]),
        Route("/instance/generate", instance.generate, methods=["POST"]),
        Route("/instance/abort", instance.abort, methods=["POST"]),
        Route("/instance/push", instance.push, methods=["POST"]),
        Route("/instance/adopt", instance.adopt, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
