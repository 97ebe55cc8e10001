"""An instance's bring-up and what it tells the Conductor.

At start the instance loads its engine (``AsyncLLMEngine``: one engine thread), opens its
Messenger (``Messenger``) and staging (send for a prefill / both instance, receive for
every role), calibrates its cost models (``cluster/instance/calibration.py``), then makes itself known: it
announces itself in etcd (``cluster.metadata.membership``), where every Conductor finds it, and/or
registers with each Conductor named by hand, again every few seconds (one that restarted has
forgotten it). Polls (``info``, ``state``) are answered from snapshots the engine thread publishes
after each step, never by waiting for the engine thread: one long step must not make a healthy
instance look dead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import httpx

from cluster.instance.calibration import cached_profile
from cluster.policies.cost_model import InstanceProfile
from cluster.policies.prefix_index import match_len
from cluster.instance.cache_mirror import CacheMirror
from cluster.instance.pool_io import PoolIO
from cluster.instance.receiver import Receiver
from cluster.instance.replication import Replicator
from cluster.instance.roles import RoleState
from cluster.instance.work import WorkBook
from cluster.instance.decode import Decoder
from cluster.instance.prefill import Prefiller
from cluster.kv_stream import KVSender
from cluster.cpp.group import StageGroup, StageRendezvous
from cluster.cpp.pool_stages import LaterStages
from cluster.pool import PoolClient, PoolConfig, PoolGeometry, Segment, SegmentConfig, SegmentService, SsdTier
from cluster.pool.config import model_identity, weights_digest
from cluster.instance.epochs import Epochs
from cluster.metadata.membership import LeasedKey, announce
from cluster.metadata import MetadataUnavailable, connect_metadata
from cluster.messenger.staging import StagingArea
from cluster.messenger import MessengerConfig, Messenger
from cluster.protocol import (INSTANCE, MEMBERSHIP, MESSENGER, BadRequest, ControlAuth, Fence, StageSpec,
                              SwitchRoleReply, derive_key)
from cluster.protocol import InstanceInfo, InstanceState, PoolNaming, RegisterReply, RegisterRequest
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.disaggregation import KVHandoff
from engine.kv_layout import KVLayout
from engine.llm_engine import LLMEngine
from paged_kv.prefix_keys import reusable_keys

log = logging.getLogger(__name__)

_GIB = 1 << 30
_REREGISTER_S = 5.0  # registration again while a Conductor has this instance up
_DRAIN_POLL_S = 0.05  # how often a draining instance looks whether it holds nothing any more


@dataclass(frozen=True)
class InstanceConfig:
    engine: EngineConfig
    url: str  # how the Conductor reaches this instance, e.g. http://127.0.0.1:8101
    secret: bytes  # the cluster secret: Messenger authentication and the control routes
    conductors: tuple[str, ...] = ()  # Conductors' URLs to register with (besides, or instead of, etcd)
    members: str | None = None  # etcd's URL, to announce this instance in (``cluster.metadata.membership``)
    staging_gib: float = 0.5  # send and receive staging, each (raised to one max-length prompt's KV)
    reservation_lease_s: float = 10.0  # released unless the Conductor renews it within this long
    transfer_timeout_s: float = 30.0
    max_waiting: int = 64  # requests waiting for their first token; beyond it: 429
    calibration_seed: int = 0
    # A Unix time: a calibration cached before it is measured again (``--recalibrate``).
    recalibrate_after: float | None = None
    pool: PoolConfig = PoolConfig()  # the KVCache pool this instance joins (off without metadata)
    # A first pipeline stage whose later stages are started by hand and join it under this name
    # (``cluster.cpp.group``); None: it starts them itself.
    stage_group: str | None = None

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        for name in ("transfer_timeout_s", "staging_gib", "reservation_lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"instance url must be http(s)://host:port, got {self.url!r}")
        if self.stage_group is not None and (self.engine.stage is None or self.engine.stage[0] != 0):
            raise ValueError("only a first pipeline stage (stage 0/X) leads a group that joins it")

    @property
    def role(self) -> str:
        return self.engine.role


class InstanceService:
    def __init__(self, config: InstanceConfig) -> None:
        self.config = config
        self.client = AsyncLLMEngine(config.engine, max_waiting=config.max_waiting)
        self.instance_id = secrets.token_hex(6)  # a restarted instance is a new one
        self.ready = False
        self.error: str | None = None
        self._announcement: LeasedKey | None = None
        # The membership store (nothing is contacted yet), where Conductors' claims say their epochs.
        self._members = (connect_metadata(config.members, config.secret, etcd=True)
                         if config.members is not None else None)
        self.epochs = Epochs(self._members, derive_key(config.secret, MEMBERSHIP))
        self.transfer: Messenger | None = None
        self.profile: InstanceProfile | None = None
        self.send: StagingArea | None = None
        self.recv: StagingArea | None = None
        self.receiver: Receiver | None = None
        self.replicator: Replicator | None = None
        self.prefiller: Prefiller | None = None  # an instance that sends KV
        self.decoder: Decoder | None = None
        self.pool: PoolIO | None = None
        self.pool_service: SegmentService | None = None
        self.stages: StageGroup | None = None  # a first pipeline stage's later stages
        # Where they join, when they are started by hand.
        self.rendezvous = (StageRendezvous(config.stage_group, config.engine.stage[1])
                           if config.stage_group is not None else None)
        self.mirror = CacheMirror()
        self.work = WorkBook()  # the prefills and decodes running here, by Conductor
        self.roles = RoleState(config.role)
        self._handoff: KVHandoff | None = None  # once the engine is up
        self._staging_bytes = 0  # each staging area's size, once known
        self._info: InstanceInfo | None = None  # once ready
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.client.start()
        self._tasks.append(asyncio.create_task(self._bring_up()))

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._announcement is not None:  # Conductors stop polling it within a listing
            await asyncio.get_running_loop().run_in_executor(None, self._announcement.close)
        if self.pool_service is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.pool_service.close)
        await self.client.shutdown()
        if self.stages is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.stages.close)
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
            transfer = self.transfer = Messenger(
                MessengerConfig(secret=derive_key(cfg.secret, MESSENGER), host=host, timeout_s=cfg.transfer_timeout_s))
            handoff, facts = await self.client.call(lambda e: (KVHandoff(e), self._engine_facts(e)))
            layout = handoff.layout
            # At least one longest-possible prompt's KV fits, so a valid request never finds the
            # staging too small for good, only busy for a moment.
            staging = max(int(cfg.staging_gib * _GIB),
                          layout.nbytes(-(-facts["max_model_len"] // layout.block_size)))
            geometry = self._pool_geometry(layout, facts) if cfg.pool.enabled else None
            # Loads and stores go through their own staging, a few objects at a time.
            pool_staging = 0 if geometry is None else max(
                8 * geometry.nbytes, layout.nbytes(-(-facts["max_model_len"] // layout.block_size)))
            self._handoff, self._staging_bytes = handoff, staging
            if cfg.engine.stage is not None and cfg.engine.stage[1] > 1:
                # The later pipeline stages: child processes, or processes that join it, up before
                # calibration runs through them.
                # A step's hidden states and residual, or its rows' logits (fp32 at most): one row per
                # sampling sequence, and one per prompt position scored (prompt logprobs), so at
                # most one per token. (Shared memory: only the pages a step touches are backed.)
                tokens = cfg.engine.max_num_batched_tokens
                buffer = 4 * tokens * max(2 * facts["hidden_size"], facts["vocab_size"])
                spec = StageSpec.of(cfg.engine, buffer, staging, cfg.transfer_timeout_s,
                                    None if geometry is None else (geometry.blocks_per_object, pool_staging))
                if self.rendezvous is None:
                    self.stages = await loop.run_in_executor(
                        None, StageGroup.spawn, spec, transfer, cfg.secret, host, self._stage_died)
                else:
                    self.stages = await loop.run_in_executor(
                        None, StageGroup.join, spec, transfer, self.rendezvous, self._stage_died)
                link = self.stages.link
                await self.client.call(lambda e: setattr(e.runner, "downstream", link))
            # Every role receives: decode instances a prompt's KV, prefill ones pulled hot prefixes.
            self.recv = StagingArea(transfer, staging)
            self.receiver = Receiver(self.client, handoff, self.recv, transfer.address,
                                     cfg.reservation_lease_s, cfg.transfer_timeout_s)
            if geometry is not None:
                layers = await self.client.call(lambda e: e.runner.model.layer_range)
                self.pool = await loop.run_in_executor(None, self._join_pool, transfer, handoff, geometry, pool_staging,
                                                       layers)
            if cfg.role in ("prefill", "both"):
                await self._open_prefill_side()
            else:
                self.replicator = self._replicator()
            self.decoder = Decoder(self.client, self.receiver, self.pool)
            self.profile = await self.client.call(
                lambda e: cached_profile(e, cfg.calibration_seed, cfg.recalibrate_after))
            # With a pool, what the Conductor needs to name a prompt's pool objects itself.
            naming = (None if self.pool is None else
                      PoolNaming(self.pool.geometry.namespace, self.pool.geometry.blocks_per_object))
            # What the Conductor checks before it lets this instance exchange KV with the others.
            weights = await loop.run_in_executor(None, weights_digest, facts["model_path"])
            self._info = InstanceInfo(self.instance_id, cfg.role, os.getpid(), facts["max_model_len"],
                                      layout.to_dict(), self.profile.to_dict(), naming, weights,
                                      facts["dtype"], facts["quantization"], facts["deterministic"])
            self._publish_cache(loop, handoff)
            self.ready = True
            self._tasks.append(asyncio.create_task(self.receiver.expire_forever()))
            self._tasks += [asyncio.create_task(self._register_forever(c)) for c in cfg.conductors]
            if cfg.members:
                self._tasks.append(asyncio.create_task(self._announce_forever()))
        except Exception as e:  # noqa: BLE001 -- reported through /health
            self.error = f"instance failed to start: {type(e).__name__}: {e}"
            log.exception("instance failed to start")

    async def _open_prefill_side(self) -> None:
        """What sending KV takes: send staging, the ``KVSender``, the prompt sinks (the sender's,
        and with a pool its layer-wise stores: a prefill instance stores its prompts layer by
        layer), the ``Prefiller`` and a ``Replicator`` that pushes from that staging. At start for
        a prefill or colocated instance; on its first switch to prefill for a decode one."""
        cfg, handoff, transfer = self.config, self._handoff, self.transfer
        self.send = StagingArea(transfer, self._staging_bytes)
        layers = await self.client.call(lambda e: e.runner.model.layer_range)
        sender = KVSender(transfer, self.send, handoff.layout, write_window_s=cfg.transfer_timeout_s, layers=layers)
        await self.client.call(lambda _: handoff.add_sink(sender))
        if self.pool is not None:
            pool_io = self.pool
            await self.client.call(lambda _: handoff.add_sink(pool_io))
        self.prefiller = Prefiller(self.client, sender, cfg.transfer_timeout_s, self.pool,
                                   self.stages.link if self.stages is not None else None, aborted=self.receiver.aborted)
        self.replicator = self._replicator()

    def _replicator(self) -> Replicator:
        return Replicator(self.client, self._handoff, self.transfer, self.send, self.receiver,
                          self.config.transfer_timeout_s)

    # -- elastic roles -----------------------------------------------------------------
    @property
    def role(self) -> str:
        """The role served now: the one started with, until a Conductor switches it."""
        return self.roles.role

    def switch_role(self, to: str, fence: Fence, drain_s: float) -> SwitchRoleReply:
        """Begin a switch to ``to`` for ``fence``'s Conductor (``roles.py``): the drain runs as a
        task of its own, and the Conductor sees its end in this instance's state. Raises
        ``WrongEpoch``, ``BadRequest`` (a colocated instance, a pipeline stage) and
        ``InstanceBusy`` (switching the other way)."""
        self.receiver.check_current(fence)
        if self.config.engine.stage is not None and self.config.engine.stage[1] > 1:
            raise BadRequest("a pipeline stage group serves prefill only: it does not switch roles")
        if self.roles.begin(to, time.monotonic(), drain_s):
            log.info("switching from %s to %s (asked by Conductor %s): draining", self.role, to, fence.header())
            self._tasks.append(asyncio.create_task(self._drain_to(to)))
        return self.roles.reply()

    async def _drain_to(self, to: str) -> None:
        """Wait until nothing is held (no call in flight, no reservation, no sequence in the
        engine), then change the engine's role; past the deadline, give up."""
        roles = self.roles
        switched = False
        try:
            if to == "prefill" and self.prefiller is None:
                await self._open_prefill_side()
            while time.monotonic() < roles.deadline:
                # The engine's own check runs on its thread: a take-over or a request admitted
                # between this loop's look and the change keeps the old role for another round.
                if not roles.in_flight and not len(self.receiver):
                    handoff = self._handoff
                    if await self.client.call(lambda _: handoff.switch_role(to)):
                        switched = True
                        break
                await asyncio.sleep(_DRAIN_POLL_S)
        except Exception:  # noqa: BLE001 -- the instance keeps its old role and says so
            log.exception("switching to %s failed", to)
        finally:
            roles.finish(switched)
        if switched:
            log.info("now serving %s (switch %d)", to, roles.switches)
        else:
            log.warning("gave up switching to %s: still serving %s", to, roles.role)

    def _stage_died(self, reason: str) -> None:
        """A later pipeline stage is gone: this group cannot prefill any more. The process exits
        (its requests fail, its stages see their stdin close) and the Supervisor starts the
        group anew; the Conductor marks it down when it stops answering."""
        log.error("%s: exiting so the group restarts", reason)
        self.error = reason
        # The link fails every step from now on, so the engine fails the requests it holds
        # (once its current step ends): their answers, which name this reason, leave first.
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while time.monotonic() < deadline:
            stats = self.client.stats()
            if not stats.get("num_running") and not stats.get("num_waiting"):
                break
            time.sleep(0.1)
        time.sleep(0.5)
        os._exit(1)

    def _pool_geometry(self, layout: KVLayout, facts: dict[str, Any]) -> PoolGeometry:
        """The pool's objects: every layer of the model (``layout``), a pipeline stage's too."""
        pc = self.config.pool
        if pc.block_tokens % layout.block_size:
            raise ValueError(f"pool block of {pc.block_tokens} tokens is not a multiple of the "
                             f"engine's {layout.block_size}-token blocks")
        return PoolGeometry(layout, pc.block_tokens // layout.block_size,
                            model_identity(facts["model_path"], facts["dtype"], facts["quantization"],
                                           facts["deterministic"]))

    def _join_pool(self, transfer: Messenger, handoff: KVHandoff, geometry: PoolGeometry, staging: int,
                   layers: range) -> PoolIO:
        """Contribute a segment to the KVCache pool (if configured) and open this instance's way
        in and out of it. Blocking (metadata calls): run off the event loop."""
        pc = self.config.pool
        metadata = connect_metadata(pc.metadata_url, self.config.secret, etcd=pc.etcd)
        client = PoolClient(transfer, metadata, transfer_timeout_s=self.config.transfer_timeout_s)
        io = PoolIO(self.client, handoff, client, geometry, StagingArea(transfer, staging),
                    self.config.transfer_timeout_s, layers=layers,
                    stages=LaterStages(self.stages.link) if self.stages is not None else None)
        if pc.dram_bytes:
            ssd = SsdTier(pc.ssd_dir, pc.ssd_bytes) if pc.ssd_dir else None
            # The node's sessions are retained in its segment as in its prefix cache.
            engine = self.config.engine
            segment = Segment(transfer, SegmentConfig(pc.dram_bytes, session_retention_s=engine.session_retention_s,
                                                      retained_share=engine.session_retention_share), ssd)
            self.pool_service = SegmentService(
                segment, transfer, metadata, client, f"{self.config.role}-{self.instance_id}",
                lease_ttl_s=pc.lease_ttl_s)
        log.info("joined the KVCache pool (%s): %d-token objects of %d bytes, %s of DRAM%s",
                 pc.metadata_url, pc.block_tokens, geometry.nbytes, f"{pc.dram_gib:g} GiB",
                 f", {pc.ssd_gib:g} GiB of SSD in {pc.ssd_dir}" if pc.ssd_dir else "")
        return io

    @staticmethod
    def _engine_facts(e: LLMEngine) -> dict[str, Any]:
        return {"max_model_len": e.max_model_len, "vocab_size": e.model_config.vocab_size,
                "hidden_size": e.model_config.hidden_size, "model_path": str(e.model_path),
                "dtype": e.config.dtype, "quantization": e.config.quantization,
                "deterministic": e.config.deterministic}

    def _publish_cache(self, loop: asyncio.AbstractEventLoop, handoff: KVHandoff) -> None:
        """After every engine step, hand what changed in the prefix cache to the event loop."""
        seen: list[int | None] = [None]

        def observe(_engine: LLMEngine) -> None:
            report = handoff.cache_report(seen[0])
            if report.full is None and report.version == seen[0]:
                return
            seen[0] = report.version
            loop.call_soon_threadsafe(self.mirror.apply, report)

        self.client.add_step_observer(observe)
        # The first report (everything calibration cached) without waiting for a step.
        report = handoff.cache_report(None)
        seen[0] = report.version
        self.mirror.apply(report)

    async def _register_forever(self, conductor: str) -> None:
        """Register with ``conductor`` until it has this instance up, then every few seconds again
        (a Conductor that restarted has forgotten it); logs only changes."""
        url = conductor.rstrip("/") + "/cluster/register"
        body = RegisterRequest(self.config.url, self.instance_id).to_dict()
        was: str | None = None
        async with httpx.AsyncClient(timeout=5.0, auth=ControlAuth(derive_key(self.config.secret, INSTANCE))) as http:
            while True:
                up = False
                try:
                    r = await http.post(url, json=body)
                    if r.status_code != 200:
                        now = f"refused registration: {r.status_code} {r.text[:300]}"
                    else:
                        up = RegisterReply.from_dict(r.json()).up
                        now = "registered (up)" if up else "registered (not up yet)"
                except httpx.HTTPError as e:
                    now = f"not reachable ({type(e).__name__})"
                except ValueError as e:  # not JSON, or not a RegisterReply: try again all the same
                    now = f"answered registration wrongly: {e}"
                if now != was:
                    log.log(logging.INFO if now.startswith("registered") or was is None else logging.WARNING,
                            "conductor %s: %s", conductor, now)
                    was = now
                await asyncio.sleep(_REREGISTER_S if up else 1.0)

    async def _announce_forever(self) -> None:
        """Put this instance in the membership (``cluster.metadata.membership``), retrying until the store
        answers; the announcement lives until shutdown."""
        store = self._members
        loop = asyncio.get_running_loop()
        delay = 1.0
        while self._announcement is None:
            try:
                self._announcement = await loop.run_in_executor(
                    None, announce, store, derive_key(self.config.secret, MEMBERSHIP), self.instance_id,
                    self.config.url, self.config.role)
                log.info("announced in the membership at %s", self.config.members)
            except MetadataUnavailable as e:
                log.warning("cannot announce this instance at %s yet (retrying in %g s): %s",
                            self.config.members, delay, e)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)

    # -- what the Conductor polls ------------------------------------------------------------------
    def info(self) -> InstanceInfo:
        return dataclasses.replace(self._info, role=self.role)

    def state(self, since: int | None) -> InstanceState:
        incoming = self.receiver.incoming() if self.receiver is not None else {}
        return InstanceState(self.instance_id, self.mirror.report(since), self.stats(), self.work.report(incoming))

    def cached_tokens(self, token_ids: list[int], salt: str | None = None) -> int:
        """How much of ``token_ids``'s prefix (under ``salt``) this instance's prefix cache holds now
        (at most all but the last token, as the engine computes at least that one)."""
        if self._handoff is None or not self.mirror.keys:
            return 0
        bs = self._handoff.layout.block_size
        return match_len(reusable_keys(token_ids, bs, salt), self.mirror.keys) * bs

    def stats(self) -> dict[str, Any]:
        s = self.client.stats()
        s["role"] = self.role
        s["switching_to"] = self.roles.switching_to
        s["role_switches"] = self.roles.switches
        s["role_switches_given_up"] = self.roles.given_up
        s["num_reservations"] = len(self.receiver) if self.receiver is not None else 0
        incoming = self.receiver.incoming() if self.receiver is not None else {}
        s["reservations_by_conductor"] = {conductor: len(prompts) for conductor, prompts in incoming.items()}
        s["cache_version"] = self.mirror.version  # of the cached prefix keys the Conductor polls
        s["epochs_refused"] = self.epochs.refused
        for name, area in (("send", self.send), ("recv", self.recv)):
            if area is not None:
                s[f"staging_{name}_free_bytes"] = area.num_free_bytes
                s[f"staging_{name}_bytes"] = area.nbytes
                s[f"staging_{name}_ranges"] = area.num_allocated
                s[f"staging_{name}_holders"] = area.holders()
        if self.pool is not None:
            s["pool_client"] = dict(self.pool.pool.counters, stores_skipped=self.pool.stores_skipped,
                                    stored_layerwise=self.pool.stored_layerwise)
            s["staging_pool_ranges"] = self.pool.staging_ranges
            s["staging_pool_holders"] = self.pool.staging_holders
        if self.pool_service is not None:
            s["pool_segment"] = self.pool_service.segment.stats()
        return s
