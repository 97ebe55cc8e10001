"""The Conductor (FAST'25 §4): the cluster's front door, an ``EngineClient`` over instances.

The OpenAI server (``server/app.py``) hands it each request. For one request it:

1. validates and tokenizes the prompt once (``engine/prompt.py``) and names its full blocks with
   the engines' chained prefix keys (``paged_kv.prefix_keys``), the keys instances report cached;
2. asks ``Placer`` (``placement.py``: Algorithm 1, decode balancing, admission, the per-instance
   queue bound) for a placement on the ledger's snapshots and books it in the ledger in the same
   synchronous step, so a burst of arrivals sees each other's load; a refusal is
   ``EngineOverloaded`` (HTTP 429 with Retry-After) before any instance has done work;
3. runs the request through the instances (``flow.py``) and relays its outputs.

With a KVCache pool, step 2 first looks up how much of the prompt's prefix the pool holds
(``RequestInfo.pool_blocks``), which Algorithm 1 weighs against the instances' own caches; the
pool's totals (``pool`` in ``/stats``) are read from its metadata every second.

Beside the requests, the registry polls the instances (``registry.py``) and the upkeep loops
(``upkeep.py``) renew the leases of the reservations its requests hold on instances and follow
the membership and the pool; the Conductor carries its fence (its id and epoch, ``cluster.protocol.Fence``)
on every call, so instances keep its reservations apart from other Conductors' and release what
an earlier incarnation of it reserved. Any number of Conductors can front the same instances:
with etcd (``cluster.metadata.membership``) each finds the instances there and claims its id (the claim's
revision is its epoch); each places on its own, and an instance refuses a reservation it cannot
honour (the Conductor then tries the next instance).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


from cluster.conductor.client import InstanceClient
from cluster.conductor.elastic import DeciderLease, ElasticRoles
from cluster.conductor.flow import Counters, RequestFlow, RequestMoved
from cluster.conductor.indexer import MAX_BODY_BYTES, Indexer, Ours
from cluster.conductor.ledger import Ledger
from cluster.conductor.placement import AdmissionProbes, Placement, PlacementConfig, Placer, TTFTCorrection
from cluster.conductor.pool_lookup import PoolLookup
from cluster.conductor.prestaging import PreStager
from cluster.conductor.registry import InstanceRecord, Registry
from cluster.conductor.sessions import SessionTable
from cluster.conductor.upkeep import Upkeep
from cluster.metadata.membership import LeasedKey
from cluster.policies.cost_model import DecodeStepModel, InstanceProfile
from cluster.policies.early_rejection import SLO, request_tbt
from cluster.policies.elastic_roles import ElasticConfig
from cluster.policies.sessions import Affinity
from cluster.policies.snapshot import RequestInfo
from cluster.pool.index import CLIENT_COUNTERS, PoolIndex
from cluster.metadata import MetadataStore
from cluster.protocol import INSTANCE, MEMBERSHIP, ControlVerifier, derive_key
from cluster.protocol import BadRequest, Fence, RegisterReply, RegisterRequest
from engine.default_model import default_model_name
from engine.model_config import ModelConfig
from engine.default_model import resolve_model
from engine.engine_client import EngineClient, EngineNotReady, EngineOverloaded
from engine.outputs import RequestOutput
from engine.prompt import check_fits, prompt_token_ids
from engine.sampling_params import SamplingParams
from engine.session import SessionHint
from engine.tokenizer import Tokenizer
from paged_kv.prefix_keys import reusable_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConductorConfig:
    secret: bytes
    model: str | None = None
    served_model_name: str | None = None
    instances: tuple[str, ...] = ()  # URLs to poll from the start; others register themselves
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    poll_interval_s: float = 0.2
    poll_timeout_s: float = 5.0  # an instance that does not answer a poll this fast is down
    control_timeout_s: float = 10.0  # every control call to an instance
    request_timeout_s: float = 600.0  # a prefill or a decode stream, at most
    # Reservation leases (instances: 10 s) are renewed this often, each instance on its own, and
    # a renewal not answered within renew_timeout_s is retried at the next interval: a lease
    # must span three such rounds (``check_lease``) so one slow answer never lets it lapse.
    renew_interval_s: float = 1.0
    renew_timeout_s: float = 2.0
    max_request_moves: int = 2  # a request that loses its instance is placed again at most this often
    move_wait_s: float = 30.0  # a moved request waits this long at most for room (then 503)
    # Who this Conductor is to the instances (``Fence``): Conductors fronting the same instances
    # need ids of their own; one restarted keeps its id with a larger epoch (with etcd, its
    # claim's revision; None: its start time), and instances release what it reserved before.
    conductor_id: str = ""
    epoch: int | None = None
    members_interval_s: float = 1.0  # with etcd: how often the announced instances are listed
    # Elastic roles (``elastic.py``): None: off, the roles stay as started. A switch
    # that has not ended within elastic_drain_s is given up on (the instance keeps its role).
    elastic: ElasticConfig | None = None
    elastic_drain_s: float = 60.0
    # The indexer API's /register (``indexer.py``): off unless the server takes an API key, and
    # then only for the endpoints listed (``host:port`` or ``ipc://path``: --indexer-allow).
    indexer_registrations: bool = False
    indexer_allow: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES  # of the indexer's requests, as the server's others (--max-body-bytes)
    # Pre-stage a session's KV from the pool's SSD tiers before its next turn.
    session_prestage: bool = False

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        for name in ("poll_interval_s", "poll_timeout_s", "control_timeout_s", "request_timeout_s", "renew_interval_s",
                     "renew_timeout_s", "members_interval_s", "move_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.max_request_moves < 0:
            raise ValueError("max_request_moves must be >= 0")
        if self.elastic is not None and (self.placement.slo_ttft_s is None or self.placement.slo_tbt_s is None):
            raise ValueError("elastic roles need both SLOs (TTFT and TBT seconds): the misses they weigh")
        if not self.elastic_drain_s > 0:
            raise ValueError("elastic_drain_s must be positive")

    def check_lease(self, reservation_lease_s: float) -> None:
        """Refuse instances' reservation lease shorter than three renewal rounds (interval plus
        timeout each): shorter, one stalled or slow answer lets a healthy request's lease lapse."""
        need = 3 * (self.renew_interval_s + self.renew_timeout_s)
        if reservation_lease_s < need:
            raise ValueError(f"the reservation lease ({reservation_lease_s:g} s) must be at least 3 x (renew interval "
                             f"{self.renew_interval_s:g} s + renew timeout {self.renew_timeout_s:g} s) = {need:g} s")


class Conductor(EngineClient):
    def __init__(self, config: ConductorConfig, supervisor: Any = None, pool: PoolIndex | None = None,
                 members: MetadataStore | None = None, claim: LeasedKey | None = None) -> None:
        """``supervisor``: the ``cluster.conductor.supervisor.Supervisor`` of the instances this process
        started, if any; it explains a missing role while they restart. ``pool``: the KVCache
        pool's metadata, to look prefixes up and report its totals (None: no pool). ``members``:
        where instances announce themselves (etcd), listed every ``members_interval_s``; ``claim``:
        this Conductor's claim on its id there (if another Conductor takes the id, this one stops
        serving)."""
        self.config = config
        self.fence = Fence(config.conductor_id, config.epoch or time.time_ns())  # a Conductor started later is newer
        self.epoch = self.fence.epoch
        self.client = InstanceClient(config.secret, self.fence, config.control_timeout_s, config.request_timeout_s)
        # Instances registering sign with the instances' key, not the Conductors' (a call signed
        # with the one is refused where the other is expected).
        self._verifier = ControlVerifier(derive_key(config.secret, INSTANCE))
        self.ledger = Ledger(self.fence.conductor)
        self.ttft_correction = TTFTCorrection()
        self.probes = AdmissionProbes(config.placement.probe_share)
        self.sessions = SessionTable()
        self.registry = Registry(self.client, config.poll_interval_s, config.poll_timeout_s,
                                 on_new_incarnation=self.ledger.forget)
        for url in config.instances:
            self.registry.add(url)
        self.counters = Counters()
        self.flow = RequestFlow(self.client, self.registry, self.counters, self._spawn)
        self._supervisor = supervisor
        self._pool = pool
        self._members, self._claim = members, claim
        # Pool metadata calls run on threads of their own: a lookup that outlives its 1 s wait
        # (etcd down: up to its client timeout) must not take the default executor's few threads.
        self._pool_threads = ThreadPoolExecutor(2, thread_name_prefix="pool-lookup")
        self.pool_lookup = PoolLookup(pool, self.registry, self._pool_threads)
        # With pre-staging and a pool, a session's KV comes up from SSD before its next turn.
        self.prestager = PreStager(self.sessions, self.registry, self.client, self._spawn,
                                   lambda: self.config.session_prestage and self._pool is not None)
        self._model_name = config.served_model_name or default_model_name(config.model)
        self.indexer = Indexer(self._model_name, self._indexed, self.pool_lookup.blocks, config.indexer_registrations,
                               allow=config.indexer_allow, reserved=self._own_addresses,
                               max_body_bytes=config.max_body_bytes)
        self._tokenizer: Tokenizer | None = None
        self._vocab_size = 0
        self._load_error: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()
        self._background: set[asyncio.Task] = set()
        self._max_running_seen = 0
        self._decode_seen: InstanceProfile | None = None  # the last profile with a decode model
        self.upkeep = Upkeep(config, self.client, self.registry, self.ledger, self.flow, self._spawn,
                             self._pool_threads, pool, members, derive_key(config.secret, MEMBERSHIP))
        self.elastic: ElasticRoles | None = None
        if config.elastic is not None:
            slo = SLO(config.placement.slo_ttft_s, config.placement.slo_tbt_s)
            # With the membership in etcd other Conductors may front the same instances: one
            # decides switches for all of them (``DeciderLease``).
            decider = (DeciderLease(members, self.fence.conductor, self._pool_threads,
                                    derive_key(config.secret, MEMBERSHIP)) if members is not None else None)
            self.elastic = ElasticRoles(config.elastic, slo, config.elastic_drain_s, self.client, self.registry,
                                        self.ledger, self._decode_model, self._spawn, decider)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._load_tokenizer()), *self.upkeep.tasks()]
            if self.elastic is not None:
                self._tasks.append(asyncio.create_task(self.elastic.run_forever()))
                if self.elastic.decider is not None:
                    self._tasks.append(asyncio.create_task(self.elastic.decider.run_forever()))
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

    def _indexed(self) -> list[Ours]:
        """The instances up, as the indexer API answers for them (``indexer.py``)."""
        return [Ours(r.instance_id or r.url, r.layout.block_size, r.match_len)
                for r in self.registry.records if r.up and r.layout is not None]

    def _own_addresses(self) -> set[str]:
        """``host:port`` of every instance this Conductor knows (no registration may name one)."""
        out = set()
        for r in self.registry.records:
            u = urlsplit(r.url)
            if u.hostname and u.port:
                out.add(f"{u.hostname}:{u.port}")
        return out

    async def shutdown(self) -> None:
        self.indexer.close()
        for task in self._tasks + list(self._background):
            task.cancel()
        if self.elastic is not None and self.elastic.decider is not None:
            # Revoked now (a store call, off the loop): another Conductor decides from its next ask.
            await asyncio.get_running_loop().run_in_executor(self._pool_threads, self.elastic.decider.close)
        await self.registry.close()
        await self.client.close()
        self._pool_threads.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- readiness ---------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        if self._claim is not None and self._claim.lost.is_set():
            return False
        return self._tokenizer is not None and self._serving_mode() is not None

    def _serving_mode(self) -> str | None:
        if self.registry.up("prefill") and self.registry.up("decode"):
            return "disaggregated"
        if self.registry.up("both"):
            return "colocated"
        return None

    @property
    def load_error(self) -> str | None:
        if self._load_error or self.is_ready:
            return self._load_error
        broken = [f"{r.url} ({r.role or 'instance'}): {r.last_error}" for r in self.registry.records if r.failed_to_start]
        return "; ".join(broken) or None

    def readiness(self) -> str:
        """Why no request can be served now, naming the missing role."""
        if self._tokenizer is None:
            return self._load_error or "loading the tokenizer"
        if self._claim is not None and self._claim.lost.is_set():
            return (f"another Conductor took this one's id {self.fence.conductor!r} while it was cut off from etcd; "
                    "restart it (with another --conductor-id if both are meant to run)")
        up = {role: len(self.registry.up(role)) for role in ("prefill", "decode", "both")}
        if up["both"] or (up["prefill"] and up["decode"]):
            return "ready"
        missing = [role for role in ("prefill", "decode") if not up[role]]
        why = ""
        if self._supervisor is not None:  # e.g. {"decode": "restarting after signal SIGKILL"}
            reasons = self._supervisor.missing_roles()
            why = "".join(f" ({role}: {reasons[role]})" for role in missing if role in reasons)
        return f"no {' and no '.join(missing)} instance is up{why}; retry shortly"

    def not_ready(self) -> EngineNotReady:
        return EngineNotReady(self.readiness(), retry_after=2.0)

    # -- model facts -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise self.not_ready()
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        lens = [r.info.max_model_len for r in self.registry.records if r.up]
        if not lens:
            raise self.not_ready()
        return min(lens)

    # -- registration (its signed route: cluster/conductor/routes.py) ------------------------------
    @property
    def verifier(self) -> ControlVerifier:
        """Checks the signature of an instance's call (its registration) under the instances' key."""
        return self._verifier

    async def register(self, r: RegisterRequest) -> RegisterReply:
        """An instance registering itself: polled at once; ``BadRequest`` when it does not fit."""
        rec = self.registry.add(r.url)
        if rec.instance_id != r.instance_id:
            self.registry.mark_down(rec, "re-registered")  # re-read its info on the next poll
        await self.registry.poll(rec)
        if rec.misfit is not None:  # its weights, precision or KV layout differ: kept out
            raise BadRequest(f"instance does not fit this cluster: {rec.misfit}")
        return RegisterReply(r.url, rec.up)

    # -- requests ----------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, session: SessionHint | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Serve one request; when it loses its instance (``RequestMoved``) place it again, at
        most ``max_request_moves`` times, with the tokens already streamed as part of its prompt:
        the client's stream only pauses. A moved request was admitted once: where there is no
        room for it now, it waits for room (``move_wait_s`` at most) rather than end mid-stream."""
        arrived = time.monotonic()
        if not self.is_ready:
            raise self.not_ready()
        ids = prompt_token_ids(prompt, self.tokenizer, self._vocab_size)
        check_fits(len(ids), params.max_tokens, self.max_model_len, "the model's context")
        streamed: list[int] = []  # output tokens the client has
        moves, number = 0, 0
        waiting_since: float | None = None
        while True:
            attempt = _Attempt(request_id, ids, tuple(streamed), params, moves, number, arrived, session)
            number += 1
            try:
                async with aclosing(self._serve(attempt)) as outs:
                    async for out in outs:
                        streamed.extend(out.new_token_ids)
                        if out.finished:
                            # Before the last output goes: a client that has it closes the stream
                            # (the HTTP layer does), and no code after this loop would run.
                            self._finished(ids + streamed, params.cache_salt, session)
                        yield attempt.as_seen_by_client(out)
                return
            except EngineOverloaded as e:
                if not moves:
                    self.counters.refused(e)
                    raise  # not admitted yet: the client gets the 429
                now = time.monotonic()
                waiting_since = waiting_since or now
                self.counters.moved_waits += 1
                if now - waiting_since >= self.config.move_wait_s:
                    self.counters.failed += 1
                    raise EngineNotReady(f"no room for the moved request within {self.config.move_wait_s:g} s "
                                         f"({e}); retry shortly", retry_after=2.0) from None
                await asyncio.sleep(min(max(e.retry_after, 0.2), 1.0))
            except RequestMoved as e:
                serving = self._serving_mode() is not None
                if moves >= self.config.max_request_moves or not serving:
                    self.counters.failed += 1
                    why = f"it was moved {moves} time(s) already; retry shortly" if serving else self.readiness()
                    log.warning("request %s lost its %s instance and cannot move (%s): %s", request_id, e.role, why, e)
                    raise EngineNotReady(f"the {e.role} instance serving the request was lost: {why}",
                                         retry_after=2.0) from None
                moves, waiting_since = moves + 1, None
                self.counters.moved += 1
                log.warning("request %s lost its %s instance after %d token(s); placing it again (move %d): %s",
                            request_id, e.role, len(streamed), moves, e)

    def _finished(self, tokens: list[int], salt: str | None, session: SessionHint | None) -> None:
        """A request ended with ``tokens`` (its prompt and output). What its instances now hold
        (the last sampled token never ran through the model: it has no KV) is noted for the
        indexer's queries by hash, and for a session's next turn."""
        if salt is None:  # a salted prompt's blocks are no one else's to look up by hash
            self.indexer.learn(tokens[:-1])
        if session is not None:
            self.prestager.turn_ended(session, tokens[:-1], salt)

    async def _serve(self, attempt: _Attempt) -> AsyncIterator[RequestOutput]:
        """One placement of ``attempt`` and its run through the instances."""
        request_id, ids, params = attempt.request_id, attempt.prompt, attempt.params
        # The prompt's block keys, once: the pool's lookup and the placement both match them. (The
        # instances of one cluster share one block size: a misfit is kept out.)
        ours = self._indexed()
        keys = reusable_keys(ids, ours[0].block_size, params.cache_salt) if ours else []
        pool_blocks = await self.pool_lookup.blocks(keys)
        if (since := self.upkeep.last_pause_end()) is not None:
            # Right after a pause of this process, what it knows of the instances is from before
            # it: placed and admitted by fresh reports only (bounded by the polls' timeout).
            await self.registry.refresh(since)
        # From here to the booking nothing awaits: the decision and its record are one step.
        mode = self._serving_mode()
        if mode is None:  # instances went down since the check above
            raise self.not_ready()
        disaggregated = mode == "disaggregated"
        prefills = self.registry.up("prefill" if disaggregated else "both")
        decodes = self.registry.up("decode") if disaggregated else []
        session = attempt.session
        affinity = Affinity() if session is None else self.sessions.affinity(session.session_id, prefills, decodes)
        # A moved request was admitted once: refusing it now would lose work the client waits on.
        placement, probed = self._place(len(ids), keys, prefills, decodes, pool_blocks, admit=attempt.moves == 0,
                                        affinity=affinity)
        booking = self.ledger.book(request_id, moved=attempt.moves > 0)
        prefill = prefills[placement.plan.instance]
        if session is not None:
            ran_on = decodes[placement.local.instance] if placement.local is not None else prefill
            self.sessions.placed(session.session_id, affinity, ran_on,
                                 decodes[placement.decode_order[0]] if decodes else None, time.monotonic())
        now = time.monotonic()
        if placement.local is not None:
            # Prefilled on its decode instance (cluster/policies/local_prefill.py): the whole
            # request runs there, as on a colocated instance.
            decode = decodes[placement.local.instance]
            booking.placed(decode, now, placement.local.prefill_s)
            self.counters.local_prefills += 1
            stream = self.flow.colocated(request_id, ids, params, session, booking, decode)
        elif disaggregated:
            booking.placed(prefill, now, placement.plan.prefill_s)
            order = [decodes[i] for i in placement.decode_order]
            booking.kv_headed(order[0], now + placement.plan.ttft_s, len(ids))
            source = prefills[placement.plan.source] if placement.plan.source is not None else None
            stream = self.flow.disaggregated(request_id, ids, params, session, booking, prefill, source,
                                             placement.plan.prefix_tokens, order)
        else:
            booking.placed(prefill, now, placement.plan.prefill_s)
            stream = self.flow.colocated(request_id, ids, params, session, booking, prefill)
        self._max_running_seen = max(self._max_running_seen, self.ledger.total_running() + 1)
        # A first token placed afresh says how long prefills take live (a moved request's
        # prompt is the one before plus what streamed: its TTFT is not the plan's).
        timed = placement.local is None and attempt.moves == 0
        factor_then = self.ttft_correction.factor
        stamps: list[float] = []  # when each output of a probe went out
        async with aclosing(stream):
            async for out in stream:
                if timed:
                    # Not across a pause of this process: that TTFT measures us, not the instances
                    # (a 20 s SIGSTOP took the factor to its bound and admission refused for long).
                    if not self.upkeep.paused_between(now, first := time.monotonic()):
                        self.ttft_correction.observe(placement.plan.ttft_s, first - now, factor_then)
                        self.ledger.prefill_factor = self.ttft_correction.factor
                    timed = False
                if probed:
                    stamps.append(time.monotonic())
                    # Judged at its last output, not after the loop: a client has what it asked
                    # for then, and may close the stream without reading further.
                    if out.finished:
                        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                        self.probes.done(stamps[0] - attempt.arrived <= placement.slo.ttft_s
                                         and request_tbt(gaps) <= placement.slo.tbt_s)
                yield out

    def _place(self, num_tokens: int, keys: list[bytes], prefills: list[InstanceRecord], decodes: list[InstanceRecord],
               pool_blocks: int, admit: bool = True, affinity: Affinity = Affinity()) -> tuple[Placement, bool]:
        """The placement of a prompt of ``num_tokens`` whose reusable blocks have ``keys``, and
        whether it is an admission probe (``AdmissionProbes``); a refusal raises ``EngineOverloaded``."""
        ref = prefills[0]
        layout = ref.layout
        profile = self._decode_profile() if decodes else None
        if decodes and profile is None:  # every decode instance started as prefill: none measured decode
            raise EngineNotReady("no instance has measured its decode steps yet (those serving decode started as "
                                 "prefill instances); start a decode instance", retry_after=5.0)
        placer = Placer(self.config.placement, ref.profile.prefill, None if profile is None else profile.decode,
                        layout.block_size, layout.nbytes(1) // layout.block_size, seed=next(self._ids),
                        pool=self._pool is not None, decode_prefill=None if profile is None else profile.prefill,
                        prefill_factor=self.ttft_correction.factor)
        info = RequestInfo(next(self._ids), num_tokens, keys, min(pool_blocks, len(keys)))
        now = time.monotonic()
        decode_states = [self.ledger.decode_state(r, i, now) for i, r in enumerate(decodes)]
        result = placer.place(
            now, info, [self.ledger.prefill_state(r, i, now) for i, r in enumerate(prefills)],
            [self.ledger.queued(r) for r in prefills], decode_states, admit=admit, affinity=affinity)
        placed = isinstance(result, Placement)
        if self.elastic is not None and decodes and admit:  # arrivals only: a move was counted once
            self.elastic.on_placed(now, num_tokens, result.plan, ref.profile.prefill, prefills,
                                   decode_states[result.decode_order[0]] if placed else None, len(decodes))
        if not placed:
            if result.placement is not None and self.probes.take():
                return result.placement, True  # refused by admission, admitted to see if it was right
            raise self.counters.reject(result.reason, result.retry_after_s)
        return result, False

    def _decode_profile(self) -> InstanceProfile | None:
        """The profile placement predicts decode instances with: a decode instance's, else any
        instance's with a decode model, down ones too, else the last one seen (an instance
        started as prefill measured no decode steps, and may be the only one serving decode now,
        its decode instances gone: instances that fit one cluster run the same model on the same
        kind of node). Elastic roles asks every interval, so it is seen before it is forgotten."""
        known = [r for r in self.registry.records if r.profile is not None and r.profile.decode is not None]
        if known:  # up ones first, decode instances first (a down one is kept a minute: ``upkeep.py``)
            self._decode_seen = min(known, key=lambda r: (not r.up, r.role != "decode")).profile
        return self._decode_seen

    def _decode_model(self) -> DecodeStepModel | None:
        """The decode step model of ``_decode_profile``."""
        profile = self._decode_profile()
        return None if profile is None else profile.decode

    async def abort(self, request_id: str) -> None:
        for rec in self.registry.records:
            load = self.ledger.load(rec)
            if request_id in load.prefilling or request_id in load.running or request_id in load.reserved:
                await self.flow.abort_on(rec, request_id)

    # -- statistics --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        up = [r.state.stats for r in self.registry.records if r.up and r.state is not None]
        totals: dict[str, Any] = {}
        for stats in up:
            for k, v in stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    totals[k] = totals.get(k, 0) + v
        if up:
            # What one request can use is one instance's cache, not the sum.
            totals["num_blocks"] = min(s.get("num_blocks", 0) for s in up)
            totals["block_size"] = up[0].get("block_size", 0)
            totals["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) for s in up) / len(up)
        c = self.counters
        totals.update({
            "ready": self.is_ready,
            "mode": self._serving_mode() or "none",
            "conductor_id": self.fence.conductor, "epoch": self.epoch,
            **({"membership_error": self.upkeep.members_error} if self.upkeep.members_error else {}),
            **({"membership_refused": len(self.upkeep.members_refused)} if self._members is not None else {}),
            "answers_refused": self.client.answers_refused,
            # Calls that timed out on an instance the next poll found up (kept up: Registry.suspect).
            "timeouts_on_instances_up": self.registry.suspicions,
            "requests_accepted": c.accepted, "requests_rejected": c.rejected,
            "requests_failed": c.failed, "rejections_by_reason": dict(c.per_reason),
            "decode_reservation_retries": c.decode_retries, "requests_moved": c.moved,
            "local_prefills": c.local_prefills, **self.sessions.describe(), **self.indexer.describe(),
            "ttft_prediction_factor": round(self.ttft_correction.factor, 3),
            "paused_s": round(self.upkeep.paused_s, 1),
            "admission_probes": self.probes.probed, "admission_probes_met_slo": self.probes.met,
            "false_reject_rate": self.probes.false_reject_rate,
            "moved_requests_waiting_for_room": c.moved_waits,
            "migrations": c.migrations, "migrated_blocks": c.migrated_blocks,
            "max_num_running_seen": max(self._max_running_seen, totals.get("max_num_running_seen", 0)),
            "instances": [{**r.describe(), **self.ledger.load(r).describe()} for r in self.registry.records],
        })
        if self.elastic is not None:
            totals.update(self.elastic.describe())
        if self._supervisor is not None:
            totals["supervised"] = self._supervisor.status()
        if self.upkeep.pool_stats is not None:
            pool = dict(self.upkeep.pool_stats)
            for name in CLIENT_COUNTERS:  # what the instances read and wrote
                pool[name] = sum(s.get("pool_client", {}).get(name, 0) for s in up)
            totals["pool"] = pool
        return totals


@dataclass(frozen=True)
class _Attempt:
    """One placement of a client's request. After a move (``moves`` > 0) its prompt is the
    client's prompt plus the tokens already streamed, and it asks for what is left. Each
    attempt after the first (``number`` > 0: a move, or a moved request trying again for room)
    has an id of its own: a lost instance may still hold the old one until its abort lands."""

    client_request_id: str
    client_prompt: list[int]
    streamed: tuple[int, ...]  # output tokens the client had when this attempt began
    client_params: SamplingParams
    moves: int
    number: int = 0
    arrived: float = 0.0  # monotonic, when the client's request reached the Conductor
    session: SessionHint | None = None

    @property
    def request_id(self) -> str:
        return self.client_request_id if not self.number else f"{self.client_request_id}~{self.number}"

    @property
    def prompt(self) -> list[int]:
        return self.client_prompt + list(self.streamed)

    @property
    def params(self) -> SamplingParams:
        if not self.moves:
            return self.client_params
        # Only the penalties on output tokens and a seeded sampler's state start afresh; a greedy
        # request continues exactly as it would have. The prompt's logprobs go out with the first
        # token: asked again only if the client has none yet (then the prompt is the client's).
        return dataclasses.replace(self.client_params, max_tokens=self.client_params.max_tokens - len(self.streamed),
                                   prompt_logprobs=None if self.streamed else self.client_params.prompt_logprobs)

    def as_seen_by_client(self, out: RequestOutput) -> RequestOutput:
        """``out`` with the client's id and counts (its prompt, its output so far)."""
        if not self.moves:
            return out
        return dataclasses.replace(out, request_id=self.client_request_id, num_prompt_tokens=len(self.client_prompt),
                                   num_output_tokens=len(self.streamed) + out.num_output_tokens,
                                   num_cached_tokens=min(out.num_cached_tokens, len(self.client_prompt)))
