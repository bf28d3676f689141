"""Prometheus metrics: one registry per app; engine gauges are read from the engine's snapshot."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Receive, Scope, Send

from kestrel.engine.client import EngineClient, EngineStats, LatencyListener, ReplicaStatus

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics(LatencyListener):
    def __init__(self, engine: Callable[[], EngineClient | None], stats: EngineStats):
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "kestrel_http_requests",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kestrel_time_to_first_token_seconds",
            "time from admission to the first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kestrel_inter_token_latency_seconds",
            "time between a request's tokens",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine, stats))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """Engine counters (kept across engine restarts) and gauges of the engine's latest load."""

    def __init__(self, engine: Callable[[], EngineClient | None], stats: EngineStats):
        self.engine, self.stats = engine, stats

    def collect(self):
        engine, stats = self.engine(), self.stats
        load = stats.load
        in_flight = engine.num_unfinished if engine is not None else 0
        alive = engine is not None and engine.dead is None
        yield _gauge("kestrel_queue_depth", "requests waiting for a running slot", load.waiting)
        yield _gauge("kestrel_running_sequences", "sequences in the running batch", load.running)
        yield _gauge("kestrel_requests_in_flight", "accepted, unfinished requests", in_flight)
        yield _gauge(
            "kestrel_kv_tokens_in_use", "live KV tokens over all sequences", load.kv_tokens_in_use
        )
        yield _gauge("kestrel_engine_alive", "1 while the engine runs", int(alive))
        yield _counter(
            "kestrel_kv_trimmed_tokens",
            "KV tokens trimmed by --max-kv-size",
            load.kv_tokens_trimmed,
        )
        yield _counter("kestrel_prompt_tokens", "prompt tokens admitted", stats.prompt_tokens)
        yield _counter("kestrel_generation_tokens", "tokens generated", stats.generation_tokens)
        yield _counter("kestrel_embeddings", "embedding vectors computed", stats.embeddings)
        yield _counter("kestrel_engine_steps", "engine steps run", stats.steps)
        yield _counter(
            "kestrel_preemptions", "requests preempted for KV (then recomputed)", load.preemptions
        )
        yield _counter(
            "kestrel_prefix_cache_queries",
            "prompt tokens looked up in the prefix cache",
            load.prefix_queried_tokens,
        )
        yield prefix_hits_by_tier(load)
        yield _gauge("kestrel_prefix_cache_blocks", "KV blocks cached", load.prefix_cached_blocks)
        yield _gauge(
            "kestrel_prefix_cache_host_blocks",
            "KV blocks the host tier holds (--kv-offloading-size)",
            load.prefix_host_blocks,
        )
        yield _gauge(
            "kestrel_prefix_cache_host_capacity_blocks",
            "KV blocks the host tier can hold (0: off)",
            load.prefix_host_capacity,
        )
        yield _counter(
            "kestrel_prefix_cache_evictions",
            "cached KV blocks evicted for new ones",
            load.prefix_evictions,
        )
        yield _counter(
            "kestrel_spec_decode_draft_tokens",
            "tokens proposed by speculative decoding",
            load.draft_tokens,
        )
        yield _counter(
            "kestrel_spec_decode_accepted_tokens",
            "proposed tokens the model accepted",
            load.accepted_tokens,
        )
        finished = CounterMetricFamily(
            "kestrel_requests_finished", "engine requests by finish reason", labels=["reason"]
        )
        for reason, count in sorted(stats.finished.items()):
            finished.add_metric([reason], count)
        yield finished
        if engine is not None:
            yield from replica_metrics(engine.replica_status())


# -dp: per-replica samples, labelled `replica` (its index): (name, kind, doc, value of a status)
REPLICA_METRICS = (
    ("kestrel_replica_alive", "gauge", "1 while the replica serves", lambda r: r.status == "ok"),
    ("kestrel_replica_requests_in_flight", "gauge", "routed, unfinished", lambda r: r.in_flight),
    ("kestrel_replica_requests_routed", "counter", "requests routed", lambda r: r.routed),
    (
        "kestrel_replica_restarts",
        "gauge",
        "restarts within --engine-restart-window",
        lambda r: r.restarts,
    ),
    (
        "kestrel_replica_prefix_cache_queries",
        "counter",
        "prompt tokens looked up in the replica's prefix cache (since it started)",
        lambda r: r.load.prefix_queried_tokens,
    ),
    (
        "kestrel_replica_prefix_cache_hits",
        "counter",
        "prompt tokens whose KV the replica's prefix cache held (since it started)",
        lambda r: r.load.prefix_hit_tokens,
    ),
)


def replica_metrics(replicas: list[ReplicaStatus]):
    """One labelled family per REPLICA_METRICS entry (none without replicas)."""
    if not replicas:
        return
    for name, kind, doc, value in REPLICA_METRICS:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
            name, doc, labels=["replica"]
        )
        for replica in replicas:
            family.add_metric([str(replica.replica)], float(value(replica)))
        yield family


def prefix_hits_by_tier(load) -> CounterMetricFamily:
    """Prompt tokens the prefix cache held, by where their KV was: the device pool, or the host
    tier (copied back)."""
    hits = CounterMetricFamily(
        "kestrel_prefix_cache_hits",
        "prompt tokens whose KV the prefix cache held, by tier",
        labels=["tier"],
    )
    hits.add_metric(["device"], load.prefix_hit_tokens - load.prefix_host_hit_tokens)
    hits.add_metric(["host"], load.prefix_host_hit_tokens)
    return hits


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class HTTPMetricsMiddleware:
    """Counts every response by route and status (unknown paths as "other": bounded labels)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
