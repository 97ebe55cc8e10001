"""``python -m server``'s command line: its flags, the cluster secret, and the flags a Conductor
passes on to the instances it starts.

Each flag is declared once, in ``_parser``; a flag that the instances a Conductor starts inherit
with its value (the engine's and the pool's settings, the front door's limits) is wrapped in
``passed_on`` there, and ``instance_args`` renders every such flag from the parsed command line,
so a new instance flag cannot be forgotten on the way to the instances.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import time
from collections.abc import Callable

from cluster.conductor.placement import PlacementConfig
from cluster.conductor.supervisor import CORE_SHARE_ENV
from cluster.policies.elastic_roles import ElasticConfig
from engine.model_config import QUANTIZATIONS
from server.app import DEFAULT_MAX_BODY_BYTES
from server.front_door import DEFAULT_CONNECTIONS_PER_CLIENT, RESERVED_FDS, FrontDoor

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


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _slack(text: str) -> float | None:
    return None if text == "off" else _non_negative_float(text)


def _stage(text: str) -> tuple[int, int]:
    i, sep, x = text.partition("/")
    if not sep or not i.isdigit() or not x.isdigit() or not 0 <= int(i) < int(x) or int(x) < 2:
        raise argparse.ArgumentTypeError(f"a stage is I/X with 0 <= I < X and X >= 2, got {text!r}")
    return int(i), int(x)


def _core_share(text: str) -> tuple[str, int]:
    path, sep, slot = text.rpartition(":")
    if not sep or not path or not slot.isdigit():
        raise argparse.ArgumentTypeError(f"a core share is PATH:SLOT, got {text!r}")
    return path, int(slot)


PassedOn = Callable[[argparse.Action], argparse.Action]  # marks a flag the started instances inherit


def _engine_flags(p: argparse.ArgumentParser, passed_on: PassedOn) -> None:
    """The model and its engine (every process that runs one)."""
    passed_on(p.add_argument("--model", default=_env("MOONCAKE_MODEL"),
                             help="HF model folder or .gguf file; default: SmolLM2-135M-Instruct (env MOONCAKE_MODEL)"))
    passed_on(p.add_argument("--kv-cache-gib", type=_positive_float,
                             default=float(v) if (v := _env("MOONCAKE_KV_CACHE_GIB")) else None,
                             help="KV cache size in GiB; default: 1 on CPU, 90%% of free memory on CUDA "
                             "(env MOONCAKE_KV_CACHE_GIB)"))
    passed_on(p.add_argument("--busy-heap-free-mib", type=_non_negative_float, default=64.0,
                             help="(CPU) while the engine is busy, how far its private memory may grow since the "
                                  "heap was last trimmed before it is trimmed again, checked once a second (64): "
                                  "bounds memory under overload for ~3%% of throughput at large batches; a large "
                                  "value keeps it all until idle"))
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads; default: all cores")
    passed_on(p.add_argument("--device", default=None, help="cpu or cuda[:N]; default: cuda if available"))
    passed_on(p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                             help="activations and KV cache, and the weights unless quantized; default: bfloat16 "
                                  "(float32 on a CPU without bfloat16 units)"))
    passed_on(p.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                             help="the KV cache's dtype; default: float32 on CPU, --dtype on CUDA"))
    passed_on(p.add_argument("--quantization", choices=["none", *QUANTIZATIONS], default=None,
                             help="weight-only quantization of the linear layers and the LM head (CPU); default: int4 on "
                                  "CPU unless --dtype is given, none on CUDA (bench.quality measures what it costs)"))
    passed_on(p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                             help="one answer per request whatever the path: greedy output does not depend on the "
                                  "batch, the chunking or the prefix cache (CPU, int4). Default: on where the native "
                                  "CPU kernels run int4 projections; --no-deterministic lets a measured faster dense "
                                  "matmul take large batches (docs/engine.md#deterministic-mode)"))
    passed_on(p.add_argument("--max-num-seqs", type=_positive_int, default=256,
                             help="most sequences in one batch"))
    passed_on(p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512,
                             help="token budget of one engine step (chunked prefill)"))
    passed_on(p.add_argument("--max-model-len", type=_positive_int, default=None,
                             help="context length; default: the model's"))
    passed_on(p.add_argument("--session-retention-s", type=_non_negative_float, default=600.0,
                             help="KV of a request with a session hint (session_id, X-Session-Id) stays cached ahead "
                             "of other KV this long after it ends, in the prefix cache and the pool's DRAM (a bias "
                             "on eviction, never a pin); 0: off"))
    passed_on(p.add_argument("--session-retention-share", type=_share, default=0.5,
                             help="at most this share of a prefix cache or a pool segment's DRAM is held for sessions"))
    passed_on(p.add_argument("--max-waiting", type=_non_negative_int, default=256,
                             help="requests allowed to wait for their first token (in the colocated engine, or in each "
                             "instance); beyond it: HTTP 429"))


def _http_flags(p: argparse.ArgumentParser, passed_on: PassedOn) -> None:
    """Every HTTP port: where it listens, who may call, the front door's limits."""
    p.add_argument("--host", default=_env("MOONCAKE_HOST", "127.0.0.1"),
                   help="address to listen on (env MOONCAKE_HOST)")
    p.add_argument("--port", type=int, default=int(_env("MOONCAKE_PORT", 8000)),
                   help="port to listen on (env MOONCAKE_PORT)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients pass as 'model'; default: the model's folder/file name")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a user's key: /v1 requests need one of the keys given ('Authorization: Bearer KEY'); repeat "
                   "for several. On the command line it is visible to other users of the machine: prefer env "
                   "MOONCAKE_API_KEY (one key) or --api-key-file; /health stays open")
    p.add_argument("--api-key-file", metavar="PATH", default=None,
                   help="users' keys, one a line (blank lines and lines starting with # skipped)")
    p.add_argument("--operator-key", default=_env("MOONCAKE_OPERATOR_KEY"), metavar="KEY",
                   help="the operator's key (env MOONCAKE_OPERATOR_KEY): /stats, /metrics and the indexer API "
                   "(/query, /query_by_hash, /register, /unregister) need it, a user's key gets 403; it serves "
                   "/v1 too. Without it those take a user key and no engine may register with the indexer")
    p.add_argument("--max-user-priority", type=int, default=0, metavar="N",
                   help="the highest session 'priority' a request with a user's API key may ask for (403 above); "
                   "the operator's key may ask for any")
    p.add_argument("--cache-scope", choices=["per-key", "shared"], default=_env("MOONCAKE_CACHE_SCOPE", "per-key"),
                   help="per-key (default): each API key's prompts are cached apart, so a cache hit "
                   "(usage.cached_tokens, a faster first token) tells no user what another sent, and the indexer "
                   "API is never a user's; shared: every key reuses every cached prefix (faster where users share "
                   "prompts such as a system prompt, and it leaks them). With no keys set there is one caller. "
                   "A request's cache_salt narrows either (env MOONCAKE_CACHE_SCOPE)")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template file to render chat requests with, in place of the model's "
                   "(tokenizer_config.json's, or its chat_template.jinja)")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto (default): the sampling fields of the model's generation_config.json (temperature, "
                   "top_p, top_k, min_p, repetition_penalty) are the defaults of requests that leave them out; "
                   "vllm: OpenAI's defaults (temperature 1, top_p 1, ...) whatever the model ships")
    p.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                   help="an origin (https://host:port, or * for any) a browser may call the API from: CORS, "
                   "preflight included; repeat for several. None (default): no CORS headers, as vLLM")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics and /stats without a key (e.g. to a scraper)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted; beyond it: HTTP 413")
    passed_on(p.add_argument("--log-level", default="info",
                             choices=["critical", "error", "warning", "info", "debug"]))
    passed_on(p.add_argument("--header-timeout-s", type=_positive_float, default=FrontDoor.header_timeout_s,
                             help="a request's headers must arrive within this many seconds of the connection "
                             "being ready for it, else it is closed (every HTTP port, instances' too)"))
    passed_on(p.add_argument("--body-timeout-s", type=_positive_float, default=FrontDoor.body_timeout_s,
                             help="a request's body must arrive within this many seconds of its headers"))
    passed_on(p.add_argument("--max-connections", type=_positive_int, default=None,
                             help="open connections per HTTP port; past it new ones are closed at once "
                             f"(default: the open-file limit less {RESERVED_FDS})"))
    p.add_argument("--max-connections-per-client", type=_non_negative_int, default=DEFAULT_CONNECTIONS_PER_CLIENT,
                   help="(the OpenAI port) open connections from one client address; past it: HTTP 429 "
                   f"(default {DEFAULT_CONNECTIONS_PER_CLIENT}; 0: no cap; loopback clients are exempt)")
    p.add_argument("--max-requests-per-client-s", type=_non_negative_float, default=0.0,
                   help="(the OpenAI port) requests a second from one client, in bursts of two seconds' worth; past "
                   "it: HTTP 429 with Retry-After (default 0: no cap). A client is a user's API key, else the "
                   "address a --trusted-proxy saw, else the connection's address (loopback addresses are exempt)")
    p.add_argument("--trusted-proxy", action="append", default=[], metavar="ADDRESS",
                   help="(the OpenAI port) a balancer whose X-Forwarded-For names the client (its last entry), as "
                   "the shipped server/haproxy.cfg sets it; repeat for several")


def _cluster_flags(c: argparse._ArgumentGroup, passed_on: PassedOn) -> None:
    """Which process this is, and how the Conductor and its instances find each other."""
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


def _pipeline_flags(c: argparse._ArgumentGroup, passed_on: PassedOn) -> None:
    """Chunked pipeline parallel prefill (CPP): a prefill instance as a group of stages."""
    passed_on(c.add_argument("--cpp-stages", type=_positive_int, default=1,
                             help="chunked pipeline parallel prefill: each prefill instance runs as a group of this many "
                                  "stage processes, each holding a contiguous range of the layers (1: none)"))
    passed_on(c.add_argument("--cpp-chunk-tokens", type=_positive_int, default=None,
                             help="(a pipeline group: --cpp-stages or --stage) prompt tokens per chunk through the "
                                  "pipeline; default: --max-num-batched-tokens"))
    passed_on(c.add_argument("--cpp-min-tokens", type=_non_negative_int, default=0,
                             help="(a pipeline group) a prompt shorter than this goes through the pipeline as one "
                                  "chunk (0: every prompt is chunked)"))
    c.add_argument("--stage", type=_stage, default=None, metavar="I/X",
                   help="(prefill instance, by hand) run stage I of a pipeline group of X stages; stage 0 is "
                        "the prefill instance the Conductor talks to, and the others join it (--group, --first)")
    c.add_argument("--group", default=None,
                   help="(with --stage) the pipeline group's name: a stage joins only the group it names")
    c.add_argument("--first", default=None, metavar="URL",
                   help="(with --stage I/X, I > 0) the URL of the group's stage 0 (its --url)")


def _instance_flags(c: argparse._ArgumentGroup, passed_on: PassedOn) -> None:
    """An instance's threads, KV transfer, calibration and reservations."""
    c.add_argument("--instance-threads", type=_positive_int, default=None,
                   help="(Conductor) torch threads of each started instance; default: cores / instances")
    c.add_argument("--share-cores", action=argparse.BooleanOptionalAction, default=False,
                   help="(Conductor) the instances it starts draw on one budget of this machine's cores: each "
                   "step takes cores / busy instances threads, so an idle prefill instance's cores go to the "
                   "decode batch and back (each starts, and calibrates, at --instance-threads)")
    c.add_argument("--core-share", type=_core_share, default=_core_share(v) if (v := _env(CORE_SHARE_ENV)) else None,
                   metavar="PATH:SLOT",
                   help=f"(instance) its slot in a core budget the Supervisor wrote (env {CORE_SHARE_ENV}, which "
                   "the Supervisor sets with --share-cores)")
    passed_on(c.add_argument("--transfer-timeout-s", type=_positive_float, default=30.0,
                             help="(instance) how long a KV write may take before it fails; receive staging of an "
                             "abandoned request is reused only after this long"))
    passed_on(c.add_argument("--staging-gib", type=_positive_float, default=0.5,
                             help="(instance) size of each KV staging area (send, receive)"))
    passed_on(c.add_argument("--recalibrate", action="store_true",
                             help="measure the cost models again instead of loading the profile cached for the same "
                                  "model, precision, threads, step budget, role and machine (every started instance too)"))
    c.add_argument("--recalibrate-after", type=float, default=None, metavar="UNIX_TIME",
                   help="(instance) measure again unless the cached profile is newer than this; the Conductor "
                        "passes its start time with --recalibrate, so a restarted instance loads what its first "
                        "run measured")
    passed_on(c.add_argument("--reservation-lease-s", type=_positive_float, default=10.0,
                             help="(instance) a KV reservation the Conductor stops renewing is released after this long; "
                             "at least 3 x (--renew-interval-s + --renew-timeout-s)"))


def _placement_flags(c: argparse._ArgumentGroup, passed_on: PassedOn) -> None:
    """The Conductor's scheduling, admission and leases."""
    c.add_argument("--scheduler", choices=["random", "load", "local", "global"], default="global",
                   help="(Conductor) prefill scheduling: global = Algorithm 1 with hot-prefix replication")
    c.add_argument("--kvcache-balancing-threshold", type=float, default=2.0,
                   help="(Conductor) pull a prefix from another prefill instance when it is this many times "
                   "longer than the local one")
    c.add_argument("--admission", choices=["none", "early", "predictive"], default="predictive",
                   help="(Conductor) early rejection (HTTP 429 with Retry-After) of what the cost models predict "
                   "would miss the SLOs: --slo-ttft-s and --slo-tbt-s, or without them each request's default "
                   "(10x its TTFT and 5x its TBT alone on an idle cluster, at least 1 s and 100 ms); none: only "
                   "the queue bound refuses")
    c.add_argument("--admission-probe-share", type=float, default=0.02,
                   help="(Conductor) of the requests admission refuses, this share is admitted all the same and "
                   "timed against its SLOs: how often a refusal is wrong (/stats false_reject_rate); 0: none")
    c.add_argument("--session-slack-s", type=_slack, default=PlacementConfig.session_slack_s,
                   help="(Conductor) a session's next turn stays on the instances its last turn ran on while that "
                   "costs at most this much predicted TTFT over the best placement and meets the SLOs; off: no "
                   "sticky placement (docs/serving.md#sessions)")
    c.add_argument("--session-prestage", action="store_true",
                   help="(Conductor) bring a session's KV up from the pool's SSD tiers when its next turn is "
                   "likely near (half its shortest recent think time after its last turn)")
    c.add_argument("--indexer-allow", action="append", default=[], metavar="HOST:PORT|ipc://PATH",
                   help="(Conductor) an endpoint the indexer API's /register may follow KV events from (repeat "
                   "for several; with --operator-key); none listed: every registration is refused "
                   "(docs/serving.md#the-indexer-api)")
    c.add_argument("--slo-ttft-s", type=_positive_float, default=None,
                   help="(Conductor) TTFT SLO in seconds (with --slo-tbt-s)")
    c.add_argument("--slo-tbt-s", type=_positive_float, default=None,
                   help="(Conductor) TBT SLO in seconds (with --slo-ttft-s)")
    c.add_argument("--local-prefill", action="store_true",
                   help="(Conductor) a request may prefill on its decode instance instead of a prefill instance, "
                   "where the cost models predict that meets both SLOs sooner (no queue, no KV transfer, its "
                   "chunks between the decode steps); needs --slo-ttft-s and --slo-tbt-s")
    c.add_argument("--predicted-decode-s", type=_positive_float, default=5.0,
                   help="(Conductor) decode duration assumed by --admission predictive")
    c.add_argument("--max-queued-prefills", type=_positive_int, default=32,
                   help="(Conductor) requests allowed to wait on one prefill instance; beyond it: HTTP 429")
    c.add_argument("--renew-interval-s", type=_positive_float, default=1.0,
                   help="(Conductor) how often the leases of reservations are renewed, each instance on its own")
    c.add_argument("--renew-timeout-s", type=_positive_float, default=2.0,
                   help="(Conductor) a renewal not answered this fast is retried at the next interval")
    c.add_argument("--max-request-moves", type=int, default=2,
                   help="(Conductor) a request whose instance is lost (or drops its reservation) is placed "
                   "again at most this often, with the tokens it streamed as part of its prompt; then HTTP 503")


def _elastic_flags(c: argparse._ArgumentGroup, passed_on: PassedOn) -> None:
    """Elastic roles: instances moved between prefill and decode."""
    e = ElasticConfig()
    c.add_argument("--elastic-roles", action="store_true",
                   help="(Conductor) move instances between prefill and decode as the load shifts, "
                   "weighing the SLO misses it predicts (needs --slo-ttft-s and --slo-tbt-s; --predicted-decode-s "
                   "is the decode time it assumes to predict a decode instance's drain); off: the roles stay as started")
    c.add_argument("--elastic-interval-s", type=_positive_float, default=e.interval_s,
                   help="(Conductor) how often elastic roles decide")
    c.add_argument("--elastic-horizon-s", type=_positive_float, default=e.horizon_s,
                   help="(Conductor) the predictions elastic roles read, and how long a new split must pay off within")
    c.add_argument("--elastic-min-dwell-s", type=_non_negative_float, default=e.min_dwell_s,
                   help="(Conductor) a role that took an instance (or started) this recently gives none up")
    c.add_argument("--elastic-margin", type=_non_negative_float, default=e.margin,
                   help="(Conductor) the least net share of requests a switch must save")
    c.add_argument("--elastic-switch-cost-s", type=_non_negative_float, default=e.switch_cost_s,
                   help="(Conductor) the seconds a switch is assumed to cost beyond its drain")
    c.add_argument("--elastic-min-per-role", type=_positive_int, default=e.min_per_role,
                   help="(Conductor) the fewest instances either role keeps")
    c.add_argument("--elastic-drain-s", type=_positive_float, default=60.0,
                   help="(Conductor) a switch not done within this long is given up on (the instance keeps its role)")


def _pool_flags(pool: argparse._ArgumentGroup, passed_on: PassedOn) -> None:
    """The KVCache pool."""
    passed_on(pool.add_argument("--no-pool", action="store_true",
                                help="(Conductor) run without the pool: each instance has only its own prefix cache"))
    passed_on(pool.add_argument("--etcd", metavar="URL", default=_env("MOONCAKE_ETCD"),
                                help="(every process) etcd at URL (http://HOST:2379) holds the cluster's membership "
                                     "(instances announce themselves there; several Conductors can front them) and the pool's "
                                     "metadata; default: instances register with --conductor, and the pool's metadata is in "
                                     "the Conductor's embedded server. TLS and an etcd user come from MOONCAKE_ETCD_CA, "
                                     "MOONCAKE_ETCD_CERT, MOONCAKE_ETCD_KEY, MOONCAKE_ETCD_USER, MOONCAKE_ETCD_PASSWORD "
                                     "(docs/serving.md)"))
    pool.add_argument("--pool-metadata", metavar="URL", default=None,
                      help="(instance) the Conductor's embedded metadata server (the Conductor passes it "
                           "to the instances it starts)")
    passed_on(pool.add_argument("--pool-dram-gib", type=_non_negative_float, default=1.0,
                                help="(instance) host DRAM this instance contributes to the pool (1; 0: none)"))
    passed_on(pool.add_argument("--pool-ssd-dir", default=None,
                                help="(instance) directory of this instance's SSD tier (a subdirectory per instance)"))
    passed_on(pool.add_argument("--pool-ssd-gib", type=_non_negative_float, default=0.0, help="(instance) SSD tier size"))
    passed_on(pool.add_argument("--pool-block-tokens", type=_positive_int, default=256,
                                help="(instance) tokens per pool object, a multiple of the KV block size (256)"))


def _parser() -> tuple[argparse.ArgumentParser, list[argparse.Action]]:
    """The parser, and the flags the instances a Conductor starts inherit (in declaration order).
    Built per call: defaults read the environment as it is then."""
    inherited: list[argparse.Action] = []

    def passed_on(action: argparse.Action) -> argparse.Action:
        inherited.append(action)
        return action

    p = argparse.ArgumentParser(
        prog="python -m server",
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /stats) over the mooncake-py engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _engine_flags(p, passed_on)
    _http_flags(p, passed_on)
    cluster = p.add_argument_group("cluster")
    for flags in (_cluster_flags, _pipeline_flags, _instance_flags, _placement_flags, _elastic_flags):
        flags(cluster, passed_on)
    _pool_flags(p.add_argument_group("KVCache pool (every node's DRAM and SSD as one store of prefix blocks)"), passed_on)
    return p, inherited


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = _parser()[0].parse_args(argv)
    if args.conductor is None:
        args.conductor = [u for u in (_env("MOONCAKE_CONDUCTOR") or "").split(",") if u]
    return args


def instance_args(args: argparse.Namespace) -> list[str]:
    """The flags a started instance inherits from this command line: every ``passed_on`` flag
    that is set, with its value."""
    out: list[str] = []
    for action in _parser()[1]:
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if action.dest == "recalibrate":
            # Not the flag itself: an instance the Supervisor restarts later must load what its
            # first run measured, not measure again, so it gets this start's time instead.
            out += ["--recalibrate-after", repr(time.time())] if value else []
        elif args.no_pool and action.dest.startswith("pool_"):
            continue  # no pool: nothing of it to configure
        elif isinstance(action, argparse.BooleanOptionalAction):
            out += [] if value is None else [flag if value else action.option_strings[1]]
        elif isinstance(value, bool):
            out += [flag] if value else []
        elif value is not None:
            out += [flag, str(value)]
    return out


def _read_private(path: str, flag: str, what: str) -> str:
    """The text of a file holding secrets (``what``, named by ``flag``), with a warning when other
    users may read it. Raises ``ValueError`` when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} from {flag} {path}: {e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logging.getLogger(__name__).warning("%s can be read by other users; restrict it with chmod 600", path)
    return text


def _on_the_command_line(flag: str, instead: str) -> None:
    logging.getLogger(__name__).warning("%s on the command line is visible to other users of this machine (ps, "
                                        "/proc/PID/cmdline); %s instead", flag, instead)


def read_keys(args: argparse.Namespace) -> tuple[tuple[str, ...], str | None]:
    """The users' keys (``--api-key`` each, ``MOONCAKE_API_KEY``, ``--api-key-file``'s lines) and
    the operator's (``--operator-key`` or ``MOONCAKE_OPERATOR_KEY``). Raises ``ValueError`` when
    the file cannot be read, a key is empty, or the operator's is also a user's."""
    keys = list(args.api_key)
    if keys:
        _on_the_command_line("--api-key", "set MOONCAKE_API_KEY or use --api-key-file")
    operator = args.operator_key.strip() if args.operator_key is not None else None
    if operator is not None and args.operator_key != os.environ.get("MOONCAKE_OPERATOR_KEY"):
        _on_the_command_line("--operator-key", "set MOONCAKE_OPERATOR_KEY")
    if env := os.environ.get("MOONCAKE_API_KEY"):
        keys.append(env)
    if args.api_key_file is not None:
        text = _read_private(args.api_key_file, "--api-key-file", "the API keys")
        keys += [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    keys = [k.strip() for k in keys]
    if any(not k for k in keys) or operator == "":
        raise ValueError("an API key is empty")
    if operator is not None and operator in keys:
        raise ValueError("the operator key must not also be a user's API key")
    return tuple(dict.fromkeys(keys)), operator


def read_cluster_secret(args: argparse.Namespace) -> str | None:
    """The cluster secret from ``--cluster-secret-file``, ``--cluster-secret`` or the environment,
    without surrounding whitespace; None when none is given. Raises ``ValueError`` when it cannot be
    read or is too short to resist guessing."""
    if args.cluster_secret_file is not None:
        source = f"--cluster-secret-file {args.cluster_secret_file}"
        secret = _read_private(args.cluster_secret_file, "--cluster-secret-file", "the cluster secret")
    elif args.cluster_secret is not None:
        source, secret = "--cluster-secret", args.cluster_secret
        _on_the_command_line("--cluster-secret", f"set {SECRET_ENV} or use --cluster-secret-file")
    elif (secret := os.environ.get(SECRET_ENV)) is not None:
        source = SECRET_ENV
    else:
        return None
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the cluster secret from {source} must be at least {MIN_SECRET_CHARS} characters "
                         f"(got {len(secret)})")
    return secret
