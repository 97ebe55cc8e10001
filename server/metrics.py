"""Prometheus metrics for ``GET /metrics``, named as vLLM names them where vLLM has the metric.

Each app owns its ``CollectorRegistry`` (never the process-global one), so several apps can live
in one process (tests do this). Engine-level values (queue lengths, KV usage, prefix-cache
counters) are read from ``EngineClient.stats()`` at scrape time by a custom collector;
per-request latencies and token counters are recorded by ``RequestTracker`` as outputs stream.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput
from engine.engine_client import EngineClient

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


POOL_COUNTERS = {
    "hits": "Pool objects read by instances.",
    "misses": "Pool objects looked for and not read (absent, or failed).",
    "loads": "Prefix loads that read at least one pool object.",
    "stores": "Objects stored in the pool.",
    "evictions": "Objects evicted from the pool for good.",
    "demotions": "Objects moved from a segment's DRAM to its SSD tier.",
    "promotions": "Objects brought back from SSD to DRAM on a read.",
    "replicas_made": "Extra replicas of hot objects.",
    "failed_reads_recomputed": "Pool objects whose read or checksum failed; their tokens were recomputed.",
    "foreign_objects": "Pool objects found under a reader's key with another size (another model's or KV "
                       "layout's); not read.",
}


class _EngineCollector(Collector):
    def __init__(self, client: EngineClient, model_name: str):
        self.client = client
        self.model_name = model_name

    def collect(self):
        s = self.client.stats()
        if "num_running" not in s:  # not loaded yet
            return
        labels = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s["num_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                    s["kv_cache_usage"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s["prefix_cache_queries"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      s["prefix_cache_hits"])
        yield counter("vllm:num_preemptions", "Preemptions (recompute) of running requests.",
                      s["num_preemptions"])
        yield gauge("mooncake:kv_blocks_total", "KV cache blocks.", s["num_blocks"])
        yield gauge("mooncake:kv_blocks_free", "KV blocks free or evictable (cached, unused).",
                    s["num_free_blocks"])
        yield gauge("mooncake:kv_blocks_cached", "KV blocks holding a reusable prefix, unused.",
                    s["num_cached_blocks"])
        instances = s.get("instances")
        if instances is not None:  # a Conductor: each instance's role (elastic roles move them)
            roles = GaugeMetricFamily("mooncake:instance_role", "1 for the role each instance serves now "
                                      "(switching: the role it is leaving).", labels=["model_name", "instance", "role"])
            for rec in instances:
                if rec.get("role") is not None:
                    roles.add_metric([self.model_name, rec["url"], rec["role"]], 1.0)
            yield roles
        if "membership_refused" in s:  # a Conductor with --etcd
            yield gauge("mooncake:membership_records_refused", "Instance records in etcd ignored because their MAC "
                        "under the cluster's membership key failed (written without the cluster secret).",
                        s["membership_refused"])
        if "answers_refused" in s:  # a Conductor
            yield counter("mooncake:instance_answers_refused", "Instance answers ignored because their signature "
                          "under the cluster's instance key failed (not from an instance, or altered on the way).",
                          s["answers_refused"])
        if "role_switches" in s:  # a Conductor with --elastic-roles
            yield counter("mooncake:role_switches", "Instances this Conductor moved between prefill and decode.",
                          s["role_switches"])
            yield counter("mooncake:role_switches_given_up", "Role switches given up on (the drain took too long).",
                          s["role_switches_given_up"])
        pool = s.get("pool")
        if pool is not None:  # a Conductor with a KVCache pool
            yield gauge("mooncake:pool_objects", "Objects in the KVCache pool (DRAM and SSD).", pool["objects"])
            yield gauge("mooncake:pool_bytes", "Bytes of the objects in the KVCache pool.", pool["bytes"])
            yield gauge("mooncake:pool_segments", "Segments (nodes) in the KVCache pool.", len(pool["segments"]))
            for name in POOL_COUNTERS:
                yield counter(f"mooncake:pool_{name}", POOL_COUNTERS[name], pool[name])


class ServerMetrics:
    def __init__(self, client: EngineClient, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lbl,
                              registry=r, buckets=_TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens (TPOT).",
                             lbl, registry=r, buckets=_ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             lbl, registry=r, buckets=_E2E_BUCKETS).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of started requests.", lbl,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", lbl,
                                         registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               lbl + ["finished_reason"], registry=r)
        self.errors = Counter("mooncake:request_errors", "Requests that failed in the engine.", lbl,
                              registry=r).labels(model_name)
        r.register(_EngineCollector(client, model_name))

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Latency bookkeeping for one engine request."""

    __slots__ = ("m", "arrival", "last", "done")

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.arrival = time.perf_counter()
        self.last: float | None = None
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        n = len(out.new_token_ids)
        if n:
            if self.last is None:
                self.m.ttft.observe(now - self.arrival)
                self.m.prompt_tokens.inc(out.num_prompt_tokens)
            else:
                for _ in range(n):
                    self.m.itl.observe((now - self.last) / n)
            self.last = now
            self.m.generation_tokens.inc(n)
        if out.finished and not self.done:
            self.done = True
            self.m.e2e.observe(now - self.arrival)
            self.m.success.labels(self.m.model_name, out.finish_reason or "unknown").inc()

    def aborted(self) -> None:
        """The consumer left before the request finished (client disconnect)."""
        if not self.done:
            self.done = True
            self.m.success.labels(self.m.model_name, "abort").inc()

    def failed(self) -> None:
        if not self.done:
            self.done = True
            self.m.errors.inc()
