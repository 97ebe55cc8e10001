"""``python -m server``: the OpenAI-compatible HTTP server, and the cluster's processes.

Three ways to run it:

* ``python -m server`` (``--mode disaggregated``, the default): the Conductor serves the OpenAI
  API on 127.0.0.1:8000 and starts one prefill and one decode instance of the default model
  (SmolLM2-135M-Instruct) on this machine, each with its share of the cores; KV moves between
  them through shared memory. ``--prefill-instances`` / ``--decode-instances`` change the
  counts (0 and 0: instances started elsewhere register with ``--conductor``).
* ``python -m server --mode colocated``: one engine does prefill and decode (the baseline).
* ``python -m server --role prefill|decode|both --conductor URL``: one instance process.

The socket listens at once; models load in the background (``/health`` answers 503 until the
server can serve, then 200).

The cluster secret (which the Conductor and its instances derive their keys from) comes from
``MOONCAKE_CLUSTER_SECRET`` or ``--cluster-secret-file``; ``--cluster-secret`` still works but
puts it where every user of the machine can read it (``ps``).
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import sys
import time

from engine.model_config import QUANTIZATIONS
from server.app import DEFAULT_MAX_BODY_BYTES
from server.front_door import RESERVED_FDS, FrontDoor, serve

SECRET_ENV = "MOONCAKE_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16


def _env(name: str, default=None):
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _stage(text: str) -> tuple[int, int]:
    i, sep, x = text.partition("/")
    if not sep or not i.isdigit() or not x.isdigit() or not 0 <= int(i) < int(x) or int(x) < 2:
        raise argparse.ArgumentTypeError(f"a stage is I/X with 0 <= I < X and X >= 2, got {text!r}")
    return int(i), int(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m server",
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /stats) over the mooncake-py engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default=_env("MOONCAKE_HOST", "127.0.0.1"),
                   help="address to listen on (env MOONCAKE_HOST)")
    p.add_argument("--port", type=int, default=int(_env("MOONCAKE_PORT", 8000)),
                   help="port to listen on (env MOONCAKE_PORT)")
    p.add_argument("--model", default=_env("MOONCAKE_MODEL"),
                   help="HF model folder or .gguf file; default: SmolLM2-135M-Instruct (env MOONCAKE_MODEL)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients pass as 'model'; default: the model's folder/file name")
    p.add_argument("--kv-cache-gib", type=_positive_float,
                   default=float(v) if (v := _env("MOONCAKE_KV_CACHE_GIB")) else None,
                   help="KV cache size in GiB; default: 1 on CPU, 90%% of free memory on CUDA "
                   "(env MOONCAKE_KV_CACHE_GIB)")
    p.add_argument("--api-key", default=_env("MOONCAKE_API_KEY"),
                   help="if set, /v1, /metrics and /stats requests need 'Authorization: Bearer KEY' "
                   "(env MOONCAKE_API_KEY); /health stays open")
    p.add_argument("--public-metrics", action="store_true",
                   help="with --api-key, serve /metrics and /stats without it (e.g. to a scraper)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads; default: all cores")
    p.add_argument("--device", default=None, help="cpu or cuda[:N]; default: cuda if available")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="activations and KV cache, and the weights unless quantized; default: bfloat16 "
                        "(float32 on a CPU without bfloat16 units)")
    p.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="the KV cache's dtype; default: float32 on CPU, --dtype on CUDA")
    p.add_argument("--quantization", choices=["none", *QUANTIZATIONS], default=None,
                   help="weight-only quantization of the linear layers and the LM head (CPU); default: int4 on "
                        "CPU unless --dtype is given, none on CUDA (bench.quality measures what it costs)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=256,
                   help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512,
                   help="token budget of one engine step (chunked prefill)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length; default: the model's")
    p.add_argument("--max-waiting", type=_non_negative_int, default=256,
                   help="requests allowed to wait for their first token (in the colocated engine, or in each "
                   "instance); beyond it: HTTP 429")
    p.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted; beyond it: HTTP 413")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--header-timeout-s", type=_positive_float, default=FrontDoor.header_timeout_s,
                   help="a request's headers must arrive within this many seconds of the connection "
                   "being ready for it, else it is closed (every HTTP port, instances' too)")
    p.add_argument("--body-timeout-s", type=_positive_float, default=FrontDoor.body_timeout_s,
                   help="a request's body must arrive within this many seconds of its headers")
    p.add_argument("--max-connections", type=_positive_int, default=None,
                   help="open connections per HTTP port; past it new ones are closed at once "
                   f"(default: the open-file limit less {RESERVED_FDS})")
    c = p.add_argument_group("cluster")
    c.add_argument("--mode", choices=["disaggregated", "colocated"], default=_env("MOONCAKE_MODE", "disaggregated"),
                   help="disaggregated: Conductor + prefill and decode instances; colocated: one engine (env MOONCAKE_MODE)")
    c.add_argument("--role", choices=["prefill", "decode", "both"], default=None,
                   help="run one instance process of this role instead of a front end")
    # Not a list default: append would add the flags to it instead of replacing it.
    c.add_argument("--conductor", action="append", default=None,
                   help="(instance) a Conductor's URL to register with; repeatable (env MOONCAKE_CONDUCTOR, "
                   "comma-separated). With --etcd it needs none: every Conductor finds it there")
    c.add_argument("--conductor-id", default=_env("MOONCAKE_CONDUCTOR_ID"),
                   help="(Conductor) this Conductor's name to the instances, which keep each Conductor's "
                   "reservations apart; Conductors fronting the same instances need different ones, and a "
                   "restarted one its old one. Default: the host:port it is reached at (env MOONCAKE_CONDUCTOR_ID)")
    c.add_argument("--listen-fd", type=_non_negative_int,
                   default=int(v) if (v := _env("MOONCAKE_LISTEN_FD")) else None,
                   help="(instance) serve on this inherited listening socket instead of binding --port; the "
                   "Supervisor sets it (env MOONCAKE_LISTEN_FD) to keep a restarted instance's port its own")
    c.add_argument("--url", default=None,
                   help="(instance) the URL the Conductor reaches this instance at; default http://HOST:PORT. "
                   "(Conductor) the URL other hosts reach the Conductor at: its host is the address the embedded "
                   "metadata server is advertised by; default HOST, or with --host 0.0.0.0 the address of "
                   "this host's default route")
    given = c.add_mutually_exclusive_group()
    given.add_argument("--cluster-secret-file", metavar="PATH", default=None,
                       help=f"file holding the shared secret (>= {MIN_SECRET_CHARS} characters) between the "
                       f"Conductor and instances; default: env {SECRET_ENV}, else generated for the "
                       "instances this process starts")
    given.add_argument("--cluster-secret", default=None,
                       help=f"the shared secret itself; discouraged: other users see command lines (ps), "
                       f"use env {SECRET_ENV} or --cluster-secret-file")
    c.add_argument("--instance", action="append", default=[],
                   help="(Conductor) URL of an instance to poll from the start; repeatable")
    c.add_argument("--prefill-instances", type=_non_negative_int, default=1,
                   help="(Conductor) prefill instances to start on this machine")
    c.add_argument("--decode-instances", type=_non_negative_int, default=1,
                   help="(Conductor) decode instances to start on this machine")
    c.add_argument("--cpp-stages", type=_positive_int, default=1,
                   help="chunked pipeline parallel prefill: each prefill instance runs as a group of this many "
                        "stage processes, each holding a contiguous range of the layers (1: none)")
    c.add_argument("--cpp-chunk-tokens", type=_positive_int, default=None,
                   help="(a pipeline group: --cpp-stages or --stage) prompt tokens per chunk through the pipeline; default: "
                        "--max-num-batched-tokens")
    c.add_argument("--cpp-min-tokens", type=_non_negative_int, default=0,
                   help="(a pipeline group) a prompt shorter than this goes through the pipeline as one "
                        "chunk (0: every prompt is chunked)")
    c.add_argument("--stage", type=_stage, default=None, metavar="I/X",
                   help="(prefill instance, by hand) run stage I of a pipeline group of X stages; stage 0 is "
                        "the prefill instance the Conductor talks to, and the others join it (--group, --first)")
    c.add_argument("--group", default=None,
                   help="(with --stage) the pipeline group's name: a stage joins only the group it names")
    c.add_argument("--first", default=None, metavar="URL",
                   help="(with --stage I/X, I > 0) the URL of the group's stage 0 (its --url)")
    c.add_argument("--instance-threads", type=_positive_int, default=None,
                   help="(Conductor) torch threads of each started instance; default: cores / instances")
    c.add_argument("--transfer-timeout-s", type=_positive_float, default=30.0,
                   help="(instance) how long a KV write may take before it fails; receive staging of an "
                   "abandoned request is reused only after this long")
    c.add_argument("--staging-gib", type=_positive_float, default=0.5,
                   help="(instance) size of each KV staging area (send, receive)")
    c.add_argument("--recalibrate", action="store_true",
                   help="measure the cost models again instead of loading the profile cached for the same "
                        "model, precision, threads, step budget, role and machine (every started instance too)")
    c.add_argument("--recalibrate-after", type=float, default=None, metavar="UNIX_TIME",
                   help="(instance) measure again unless the cached profile is newer than this; the Conductor "
                        "passes its start time with --recalibrate, so a restarted instance loads what its first "
                        "run measured")
    c.add_argument("--scheduler", choices=["random", "load", "local", "global"], default="global",
                   help="(Conductor) prefill scheduling: global = Algorithm 1 with hot-prefix replication")
    c.add_argument("--kvcache-balancing-threshold", type=float, default=2.0,
                   help="(Conductor) pull a prefix from another prefill instance when it is this many times "
                   "longer than the local one")
    c.add_argument("--admission", choices=["none", "early", "predictive"], default="none",
                   help="(Conductor) early rejection (HTTP 429) on predicted load; needs --slo-ttft-s and --slo-tbt-s")
    c.add_argument("--slo-ttft-s", type=_positive_float, default=None, help="(Conductor) TTFT SLO in seconds")
    c.add_argument("--slo-tbt-s", type=_positive_float, default=None, help="(Conductor) TBT SLO in seconds")
    c.add_argument("--predicted-decode-s", type=_positive_float, default=5.0,
                   help="(Conductor) decode duration assumed by --admission predictive")
    c.add_argument("--max-queued-prefills", type=_positive_int, default=32,
                   help="(Conductor) requests allowed to wait on one prefill instance; beyond it: HTTP 429")
    c.add_argument("--reservation-lease-s", type=_positive_float, default=10.0,
                   help="(instance) a KV reservation the Conductor stops renewing is released after this long; "
                   "at least 3 x (--renew-interval-s + --renew-timeout-s)")
    c.add_argument("--renew-interval-s", type=_positive_float, default=1.0,
                   help="(Conductor) how often the leases of reservations are renewed, each instance on its own")
    c.add_argument("--renew-timeout-s", type=_positive_float, default=2.0,
                   help="(Conductor) a renewal not answered this fast is retried at the next interval")
    c.add_argument("--max-request-moves", type=int, default=2,
                   help="(Conductor) a request whose instance is lost (or drops its reservation) is placed "
                   "again at most this often, with the tokens it streamed as part of its prompt; then HTTP 503")
    pool = p.add_argument_group("KVCache pool (every node's DRAM and SSD as one store of prefix blocks)")
    pool.add_argument("--no-pool", action="store_true",
                      help="(Conductor) run without the pool: each instance has only its own prefix cache")
    pool.add_argument("--etcd", metavar="URL", default=_env("MOONCAKE_ETCD"),
                      help="(every process) etcd at URL (http://HOST:2379) holds the cluster's membership "
                           "(instances announce themselves there; several Conductors can front them) and the pool's "
                           "metadata; default: instances register with --conductor, and the pool's metadata is in "
                           "the Conductor's embedded server")
    pool.add_argument("--pool-metadata", metavar="URL", default=None,
                      help="(instance) the Conductor's embedded metadata server (the Conductor passes it "
                           "to the instances it starts)")
    pool.add_argument("--pool-dram-gib", type=_non_negative_float, default=1.0,
                      help="(instance) host DRAM this instance contributes to the pool (1; 0: none)")
    pool.add_argument("--pool-ssd-dir", default=None,
                      help="(instance) directory of this instance's SSD tier (a subdirectory per instance)")
    pool.add_argument("--pool-ssd-gib", type=_non_negative_float, default=0.0, help="(instance) SSD tier size")
    pool.add_argument("--pool-block-tokens", type=_positive_int, default=256,
                      help="(instance) tokens per pool object, a multiple of the KV block size (256)")
    args = p.parse_args(argv)
    if args.conductor is None:
        args.conductor = [u for u in (_env("MOONCAKE_CONDUCTOR") or "").split(",") if u]
    return args


def read_cluster_secret(args: argparse.Namespace) -> str | None:
    """The cluster secret from ``--cluster-secret-file``, ``--cluster-secret`` or the environment,
    without surrounding whitespace; None when none is given. Raises ``ValueError`` when it cannot be
    read or is too short to resist guessing."""
    log = logging.getLogger(__name__)
    if args.cluster_secret_file is not None:
        source = f"--cluster-secret-file {args.cluster_secret_file}"
        try:
            with open(args.cluster_secret_file, encoding="utf-8") as f:
                secret = f.read()
            mode = os.stat(args.cluster_secret_file).st_mode
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the cluster secret from {source}: {e}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s can be read by other users; restrict it with chmod 600", args.cluster_secret_file)
    elif args.cluster_secret is not None:
        source, secret = "--cluster-secret", args.cluster_secret
        log.warning("--cluster-secret on the command line is visible to other users of this machine (ps, "
                    "/proc/PID/cmdline); set %s or use --cluster-secret-file instead", SECRET_ENV)
    elif (secret := os.environ.get(SECRET_ENV)) is not None:
        source = SECRET_ENV
    else:
        return None
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the cluster secret from {source} must be at least {MIN_SECRET_CHARS} characters "
                         f"(got {len(secret)})")
    return secret


def _engine_config(args: argparse.Namespace, role: str = "both"):
    from engine.config import EngineConfig

    kwargs = dict(
        model=args.model, kv_cache_gib=args.kv_cache_gib, threads=args.threads,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, role=role,
        stage=(0, args.cpp_stages) if role == "prefill" and args.cpp_stages > 1 else None,
    )
    if args.stage is not None:
        kwargs["stage"] = args.stage
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


def _front_door(args: argparse.Namespace) -> FrontDoor:
    return FrontDoor(header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                     max_connections=args.max_connections)


def _instance_args(args: argparse.Namespace) -> list[str]:
    """Flags a started instance inherits from this command line."""
    out = ["--log-level", args.log_level, "--max-num-seqs", str(args.max_num_seqs),
           "--header-timeout-s", str(args.header_timeout_s), "--body-timeout-s", str(args.body_timeout_s),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--staging-gib", str(args.staging_gib),
           "--transfer-timeout-s", str(args.transfer_timeout_s),
           "--reservation-lease-s", str(args.reservation_lease_s), "--max-waiting", str(args.max_waiting),
           "--cpp-stages", str(args.cpp_stages), "--cpp-min-tokens", str(args.cpp_min_tokens)]
    if args.cpp_chunk_tokens is not None:
        out += ["--cpp-chunk-tokens", str(args.cpp_chunk_tokens)]
    if args.recalibrate:
        out += ["--recalibrate-after", repr(time.time())]
    if args.no_pool:
        out += ["--no-pool"]
    else:
        out += ["--pool-dram-gib", str(args.pool_dram_gib), "--pool-ssd-gib", str(args.pool_ssd_gib),
                "--pool-block-tokens", str(args.pool_block_tokens)]
    for flag, value in (("--model", args.model), ("--kv-cache-gib", args.kv_cache_gib),
                        ("--max-connections", args.max_connections),
                        ("--dtype", args.dtype), ("--quantization", args.quantization),
                        ("--kv-cache-dtype", args.kv_cache_dtype),
                        ("--max-model-len", args.max_model_len), ("--device", args.device),
                        ("--pool-ssd-dir", None if args.no_pool else args.pool_ssd_dir),
                        ("--etcd", args.etcd)):
        if value is not None:
            out += [flag, str(value)]
    return out


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
    from cluster.pool.metadata.embedded import MetadataServer
    from cluster.pool.metadata.etcd import EtcdMetadata
    from cluster.pool.metadata.local import LocalMetadata

    if args.etcd:
        return PoolIndex(EtcdMetadata(args.etcd)), None, []
    store = LocalMetadata()
    server = MetadataServer(secret.encode(), host=host or "0.0.0.0", store=store, advertise_host=advertise_host)
    return PoolIndex(store), server, ["--pool-metadata", server.url]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _claim_membership(args: argparse.Namespace, conductor_id: str):
    """With etcd: the store instances announce themselves in, this Conductor's claim on its id
    and the epoch the claim gives it (``cluster.pool.metadata.membership``). Raises ``RuntimeError`` when the id
    is held by a live Conductor or etcd does not answer."""
    from cluster.pool.metadata.membership import claim_conductor
    from cluster.pool.metadata import MetadataUnavailable
    from cluster.pool.metadata.etcd import EtcdMetadata

    store = EtcdMetadata(args.etcd)
    try:
        claim, epoch = claim_conductor(store, conductor_id, f"http://{_url_host(_advertised_host(args))}:{args.port}")
    except MetadataUnavailable as e:
        raise RuntimeError(f"cannot claim the Conductor id {conductor_id!r} in etcd: {e}") from None
    logging.getLogger(__name__).info("Conductor %r, epoch %d (its claim's revision in etcd)", conductor_id, epoch)
    return store, claim, epoch


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per control or metadata call otherwise
    log = logging.getLogger(__name__)

    from server.app import ServerSettings, build_app

    try:
        cluster_secret = read_cluster_secret(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    settings = ServerSettings(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                              public_metrics=args.public_metrics)
    if args.stage is not None:
        if args.role != "prefill" or not args.group or args.cpp_stages > 1:
            sys.exit("error: --stage needs --role prefill and --group NAME (and no --cpp-stages)")
        if (args.stage[0] > 0) != (args.first is not None):
            sys.exit("error: a later stage (--stage I/X, I > 0) needs --first URL; stage 0 takes none")
    if args.role is not None and args.stage is not None and args.stage[0] > 0:
        from cluster.cpp.group import serve_joined

        if cluster_secret is None:
            sys.exit(f"error: a pipeline stage needs the cluster secret: set {SECRET_ENV} or pass --cluster-secret-file")
        log.info("stage %d/%d of group %r, joining %s", *args.stage, args.group, args.first)
        try:
            sys.exit(serve_joined(args.first, args.group, *args.stage, args.host, cluster_secret.encode()))
        except RuntimeError as e:
            sys.exit(f"error: {e}")
    # Taken: a process this one starts must not think the socket its own (it is not passed on).
    os.environ.pop("MOONCAKE_LISTEN_FD", None)
    if args.role is not None:
        from cluster.instance.routes import build_instance_app
        from cluster.instance.service import InstanceConfig, InstanceService

        if cluster_secret is None:
            sys.exit(f"error: an instance needs the cluster secret: set {SECRET_ENV} or pass --cluster-secret-file")
        try:
            url = args.url or f"http://{args.host}:{args.port}"
            config = InstanceConfig(
                engine=_engine_config(args, args.role), url=url,
                secret=cluster_secret.encode(), conductors=tuple(args.conductor), members=args.etcd,
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
        serve(build_instance_app(InstanceService(config)), args.host, args.port, _front_door(args),
              log_level="warning", fd=args.listen_fd)
        return

    if args.mode == "colocated":
        from engine.async_engine import AsyncLLMEngine

        try:
            config = _engine_config(args)
        except ValueError as e:
            sys.exit(f"error: {e}")
        client = AsyncLLMEngine(config, served_model_name=args.served_model_name, max_waiting=args.max_waiting)
        app = build_app(client, settings)
        log.info("serving %r on http://%s:%d (colocated; /health is 503 until the model is loaded)",
                 client.model_name, args.host, args.port)
        serve(app, args.host, args.port, _front_door(args), log_level=args.log_level)
        return

    import secrets

    from starlette.routing import Route

    from cluster.conductor.conductor import Conductor, ConductorConfig
    from cluster.conductor.placement import PlacementConfig
    from cluster.conductor.supervisor import Supervisor

    # No thread settings: the Conductor loads no torch (tests/test_conductor_imports.py), and its
    # tokenizer encodes one text at a time on the calling thread (HF tokenizers starts its thread
    # pool only for batch calls, which the Conductor makes none of).
    secret = cluster_secret or secrets.token_hex(16)
    roles = ["prefill"] * args.prefill_instances + ["decode"] * args.decode_instances
    threads = args.instance_threads or max(1, (os.cpu_count() or 1) // max(1, len(roles)))
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    try:
        placement = PlacementConfig(
            scheduler=args.scheduler, kvcache_balancing_threshold=args.kvcache_balancing_threshold,
            admission=args.admission, slo_ttft_s=args.slo_ttft_s, slo_tbt_s=args.slo_tbt_s,
            predicted_decode_s=args.predicted_decode_s, max_queued_prefills=args.max_queued_prefills,
        )
        pool, metadata_server, pool_args = (
            (None, None, []) if args.no_pool else _start_pool(args, secret, args.host, _advertised_host(args)))
        supervisor = Supervisor(roles, f"http://{local}:{args.port}", secret, threads, _instance_args(args) + pool_args)
        conductor_id = args.conductor_id or f"{_url_host(_advertised_host(args))}:{args.port}"
        members, claim, epoch = _claim_membership(args, conductor_id) if args.etcd else (None, None, None)
        # Polled from the start, so an instance that cannot load shows up in /health at once.
        config = ConductorConfig(
            secret=secret.encode(), model=args.model, served_model_name=args.served_model_name,
            instances=tuple(args.instance) + tuple(supervisor.instances), placement=placement,
            renew_interval_s=args.renew_interval_s, renew_timeout_s=args.renew_timeout_s,
            max_request_moves=args.max_request_moves, conductor_id=conductor_id, epoch=epoch,
        )
        config.check_lease(args.reservation_lease_s)  # the lease of the instances it starts
    except (ValueError, RuntimeError) as e:  # RuntimeError: the id is held, or etcd does not answer
        sys.exit(f"error: {e}")
    conductor = Conductor(config, supervisor=supervisor, pool=pool, members=members, claim=claim)
    if metadata_server is not None:
        log.info("KVCache pool metadata at %s (a pool node joins with: python -m cluster.pool --metadata %s)",
                 metadata_server.url, metadata_server.url)
    app = build_app(conductor, settings,
                    extra_routes=[Route("/cluster/register", conductor.register_route, methods=["POST"])])
    log.info("serving %r on http://%s:%d: Conductor over %d prefill + %d decode instances (%d threads each); "
             "/health is 503 until they are up", conductor.model_name, args.host, args.port,
             args.prefill_instances, args.decode_instances, threads)
    supervisor.start()
    try:
        serve(app, args.host, args.port, _front_door(args), log_level=args.log_level)
    finally:
        supervisor.stop()
        if claim is not None:
            claim.close()  # the id is free at once for this Conductor's next start
        if metadata_server is not None:
            metadata_server.close()

if __name__ == "__main__":
    main()
