"""What ``python -m server`` runs, one builder per role: a later stage of a pipeline group, an
instance (prefill, decode or both), the colocated engine, and the Conductor (with the instances
it supervises and the pool's metadata). ``server/__main__.py`` picks one from the command line
(``server/cli.py``).

Each builder imports what its role needs when it runs: the Conductor's process must load neither
torch nor the Messenger (tests/test_conductor_imports.py), which only instances use.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from server.app import ServerSettings, build_app
from server.cli import instance_args
from server.front_door import FrontDoor, serve

log = logging.getLogger(__name__)


def engine_config(args: argparse.Namespace, role: str = "both"):
    from engine.config import EngineConfig

    kwargs = dict(
        model=args.model, kv_cache_gib=args.kv_cache_gib, threads=args.threads,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, role=role, deterministic=args.deterministic,
        busy_heap_free_mib=args.busy_heap_free_mib, session_retention_s=args.session_retention_s,
        session_retention_share=args.session_retention_share,
        stage=(0, args.cpp_stages) if role == "prefill" and args.cpp_stages > 1 else None,
    )
    if args.stage is not None:
        kwargs["stage"] = args.stage
    if args.core_share is not None:
        kwargs["core_share"], kwargs["core_slot"] = args.core_share
    if kwargs["stage"] is not None:
        # A group's chunk, and a step that takes a prompt below --cpp-min-tokens whole.
        chunk = args.cpp_chunk_tokens or args.max_num_batched_tokens
        kwargs.update(prefill_chunk_tokens=chunk, chunk_min_prompt_tokens=args.cpp_min_tokens,
                      max_num_batched_tokens=max(args.max_num_batched_tokens, chunk, args.cpp_min_tokens))
    if args.device:
        kwargs["device"] = args.device
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if args.quantization:
        kwargs["quantization"] = args.quantization
    if args.kv_cache_dtype:
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    return EngineConfig(**kwargs)


def front_door(args: argparse.Namespace, public: ServerSettings | None = None) -> FrontDoor:
    """The limits of this process's HTTP port; ``public``: the OpenAI API's settings (the
    Conductor's, the colocated server's port), which also caps each client (a user's key is one)."""
    per_client = {} if public is None else dict(
        max_connections_per_client=args.max_connections_per_client or None,
        max_requests_per_client_s=args.max_requests_per_client_s or None,
        client_keys=public.api_keys, trusted_proxies=frozenset(args.trusted_proxy))
    return FrontDoor(header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                     max_connections=args.max_connections, **per_client)


def _pool_config(args: argparse.Namespace, url: str):
    """An instance's pool settings; no pool with --no-pool or unless it was told where the metadata is."""
    from cluster.pool import PoolConfig

    if args.no_pool:
        return PoolConfig()

    ssd_dir = args.pool_ssd_dir
    if ssd_dir is not None:
        # Instances started together share the flag: each keeps its own files, by its address
        # (a restarted instance finds, and clears, only its own).
        ssd_dir = os.path.join(ssd_dir, url.split("://", 1)[1].replace(":", "_").replace("/", "_"))
    return PoolConfig(metadata_url=args.etcd or args.pool_metadata, etcd=args.etcd is not None,
                      dram_gib=args.pool_dram_gib, ssd_dir=ssd_dir, ssd_gib=args.pool_ssd_gib,
                      block_tokens=args.pool_block_tokens)


def _outward_address() -> str | None:
    """The address this host's default route leaves by (a UDP connect sends nothing), or None."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: only the route to it is looked up
            return s.getsockname()[0]
    except OSError:
        return None


def _indexer_allow(args: argparse.Namespace) -> tuple[str, ...]:
    """``--indexer-allow`` as the indexer compares endpoints (``endpoint_address``); this server's
    own port is never one."""
    from cluster.conductor.indexer import endpoint_address

    out = []
    for entry in args.indexer_allow:
        try:
            address = endpoint_address(entry)
        except ValueError as e:
            raise ValueError(f"--indexer-allow: {e}; give HOST:PORT or ipc://PATH") from None
        if not address.startswith("ipc://") and int(address.rpartition(":")[2]) == args.port:
            raise ValueError(f"--indexer-allow {entry!r}: that is this server's own port")
        out.append(address)
    return tuple(out)


def _advertised_host(args: argparse.Namespace) -> str:
    """The address other hosts reach the Conductor (and its metadata server) at: ``--url``'s
    host, else ``--host``; for a wildcard ``--host``, this host's outward address."""
    from urllib.parse import urlsplit

    if args.url:
        host = urlsplit(args.url).hostname
        if host:
            return host
    if args.host not in ("0.0.0.0", "::", ""):
        return args.host
    return _outward_address() or "127.0.0.1"


def _start_pool(args: argparse.Namespace, secret: str, host: str, advertise_host: str | None = None):
    """The Conductor's view of the pool (a ``PoolIndex`` on its metadata), the metadata server
    it runs when there is no etcd (or None: listening on ``host``, the Conductor's own, and
    advertised by ``advertise_host``), and the flags its instances get to join."""
    from cluster.pool.index import PoolIndex
    from cluster.metadata.embedded import MetadataServer
    from cluster.metadata.etcd import EtcdMetadata
    from cluster.metadata.local import LocalMetadata

    if args.etcd:
        return PoolIndex(EtcdMetadata(args.etcd)), None, []
    store = LocalMetadata()
    server = MetadataServer(secret.encode(), host=host or "0.0.0.0", store=store, advertise_host=advertise_host)
    return PoolIndex(store), server, ["--pool-metadata", server.url]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _claim_membership(args: argparse.Namespace, conductor_id: str, secret: bytes):
    """With etcd: the store instances announce themselves in, this Conductor's claim on its id
    and the epoch the claim gives it (``cluster.metadata.membership``). Raises ``RuntimeError`` when the id
    is held by a live Conductor or etcd does not answer."""
    from cluster.metadata.membership import claim_conductor
    from cluster.metadata import MetadataUnavailable
    from cluster.metadata.etcd import EtcdMetadata
    from cluster.protocol import MEMBERSHIP, derive_key

    store = EtcdMetadata(args.etcd)
    try:
        claim, epoch = claim_conductor(store, derive_key(secret, MEMBERSHIP), conductor_id,
                                       f"http://{_url_host(_advertised_host(args))}:{args.port}")
    except MetadataUnavailable as e:
        raise RuntimeError(f"cannot claim the Conductor id {conductor_id!r} in etcd: {e}") from None
    log.info("Conductor %r, epoch %d (its claim's revision in etcd)", conductor_id, epoch)
    return store, claim, epoch


def serve_stage(args: argparse.Namespace, secret: str) -> None:
    """A later stage (``--stage I/X``, I > 0) of a pipeline group: joins the group's stage 0 at
    ``--first`` and serves it until the group ends; exits with the group's status."""
    from cluster.cpp.group import serve_joined

    log.info("stage %d/%d of group %r, joining %s", *args.stage, args.group, args.first)
    try:
        sys.exit(serve_joined(args.first, args.group, *args.stage, args.host, secret.encode()))
    except RuntimeError as e:
        sys.exit(f"error: {e}")


def serve_instance(args: argparse.Namespace, secret: str) -> None:
    """One instance of ``--role``: registers with ``--conductor`` and announces itself in
    ``--etcd``; serves on ``--listen-fd`` when its Supervisor holds its port."""
    from cluster.instance.routes import build_instance_app
    from cluster.instance.service import InstanceConfig, InstanceService

    try:
        url = args.url or f"http://{args.host}:{args.port}"
        config = InstanceConfig(
            engine=engine_config(args, args.role), url=url,
            secret=secret.encode(), conductors=tuple(args.conductor), members=args.etcd,
            staging_gib=args.staging_gib,
            transfer_timeout_s=args.transfer_timeout_s, reservation_lease_s=args.reservation_lease_s,
            max_waiting=args.max_waiting, pool=_pool_config(args, url),
            stage_group=args.group if args.stage is not None else None,
            recalibrate_after=time.time() if args.recalibrate else args.recalibrate_after,
        )
    except ValueError as e:
        sys.exit(f"error: {e}")
    log.info("%s instance on %s (conductors: %s; membership: %s)", args.role, config.url,
             ", ".join(args.conductor) or "none by hand", args.etcd or "none")
    serve(build_instance_app(InstanceService(config)), args.host, args.port, front_door(args),
          log_level="warning", fd=args.listen_fd)


def serve_colocated(args: argparse.Namespace, settings: ServerSettings) -> None:
    """One engine that prefills and decodes, behind the OpenAI API (the baseline)."""
    from engine.async_engine import AsyncLLMEngine

    try:
        config = engine_config(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    client = AsyncLLMEngine(config, served_model_name=args.served_model_name, max_waiting=args.max_waiting)
    app = build_app(client, settings)
    log.info("serving %r on http://%s:%d (colocated; /health is 503 until the model is loaded)",
             client.model_name, args.host, args.port)
    serve(app, args.host, args.port, front_door(args, public=settings), log_level=args.log_level)


def serve_conductor(args: argparse.Namespace, secret: str | None, settings: ServerSettings) -> None:
    """The Conductor behind the OpenAI API, over the instances it starts and supervises
    (``--prefill-instances``, ``--decode-instances``), those given by hand (``--instance``) and
    those announced in ``--etcd``; with the pool's metadata server unless there is etcd."""
    import secrets

    from cluster.conductor.conductor import Conductor, ConductorConfig
    from cluster.conductor.placement import PlacementConfig
    from cluster.conductor.routes import indexer_routes, registration_route
    from cluster.policies.elastic_roles import ElasticConfig
    from cluster.conductor.supervisor import Supervisor

    # No thread settings: the Conductor loads no torch (tests/test_conductor_imports.py), and its
    # tokenizer encodes one text at a time on the calling thread (HF tokenizers starts its thread
    # pool only for batch calls, which the Conductor makes none of).
    secret = secret or secrets.token_hex(16)
    if args.share_cores and args.cpp_stages > 1:
        # A group's later stages are processes of their own that would not draw on the budget.
        sys.exit("error: --share-cores covers one process per instance; it does not go with --cpp-stages")
    roles = ["prefill"] * args.prefill_instances + ["decode"] * args.decode_instances
    threads = args.instance_threads or max(1, (os.cpu_count() or 1) // max(1, len(roles)))
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    try:
        placement = PlacementConfig(
            scheduler=args.scheduler, kvcache_balancing_threshold=args.kvcache_balancing_threshold,
            admission=args.admission, slo_ttft_s=args.slo_ttft_s, slo_tbt_s=args.slo_tbt_s,
            predicted_decode_s=args.predicted_decode_s, max_queued_prefills=args.max_queued_prefills,
            local_prefill=args.local_prefill, local_prefill_chunk_tokens=args.max_num_batched_tokens,
            probe_share=args.admission_probe_share, session_slack_s=args.session_slack_s,
        )
        pool, metadata_server, pool_args = (
            (None, None, []) if args.no_pool else _start_pool(args, secret, args.host, _advertised_host(args)))
        supervisor = Supervisor(roles, f"http://{local}:{args.port}", secret, threads, instance_args(args) + pool_args,
                                share_cores=(os.cpu_count() or 1) if args.share_cores else None)
        conductor_id = args.conductor_id or f"{_url_host(_advertised_host(args))}:{args.port}"
        members, claim, epoch = _claim_membership(args, conductor_id, secret.encode()) if args.etcd else (None, None, None)
        # Polled from the start, so an instance that cannot load shows up in /health at once.
        config = ConductorConfig(
            secret=secret.encode(), model=args.model, served_model_name=args.served_model_name,
            indexer_registrations=bool(args.operator_key), indexer_allow=_indexer_allow(args),
            max_body_bytes=args.max_body_bytes, session_prestage=args.session_prestage,
            instances=tuple(args.instance) + tuple(supervisor.instances), placement=placement,
            renew_interval_s=args.renew_interval_s, renew_timeout_s=args.renew_timeout_s,
            max_request_moves=args.max_request_moves, conductor_id=conductor_id, epoch=epoch,
            elastic=ElasticConfig(
                interval_s=args.elastic_interval_s, horizon_s=args.elastic_horizon_s,
                min_dwell_s=args.elastic_min_dwell_s, margin=args.elastic_margin,
                switch_cost_s=args.elastic_switch_cost_s, decode_time_s=args.predicted_decode_s,
                min_per_role=args.elastic_min_per_role) if args.elastic_roles else None,
            elastic_drain_s=args.elastic_drain_s,
        )
        config.check_lease(args.reservation_lease_s)  # the lease of the instances it starts
    except (ValueError, RuntimeError) as e:  # RuntimeError: the id is held, or etcd does not answer
        sys.exit(f"error: {e}")
    conductor = Conductor(config, supervisor=supervisor, pool=pool, members=members, claim=claim)
    if metadata_server is not None:
        log.info("KVCache pool metadata at %s (a pool node joins with: python -m cluster.pool --metadata %s)",
                 metadata_server.url, metadata_server.url)
    app = build_app(conductor, settings, extra_routes=[registration_route(conductor)],
                    operator_routes=indexer_routes(conductor.indexer))
    log.info("serving %r on http://%s:%d: Conductor over %d prefill + %d decode instances (%d threads each%s); "
             "/health is 503 until they are up", conductor.model_name, args.host, args.port,
             args.prefill_instances, args.decode_instances, threads,
             f", up to {os.cpu_count()} as the others idle" if args.share_cores else "")
    supervisor.start()
    try:
        serve(app, args.host, args.port, front_door(args, public=settings), log_level=args.log_level)
    finally:
        supervisor.stop()
        if claim is not None:
            claim.close()  # the id is free at once for this Conductor's next start
        if metadata_server is not None:
            metadata_server.close()
