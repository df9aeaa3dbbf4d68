"""``GET /metrics``: Prometheus text from a per-app registry (never the global one: a process —
a test — may hold several apps).

The server measures what a client sees (time to first token, inter-token latency, tokens/s,
requests by endpoint and status); the engine's own figures (running sequences, queue depth,
per-routing switch rate, and with offloaded experts the resident experts, hit rate and bytes
read) are read from ``engine.stats()`` when Prometheus scrapes, so they are never stale.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
WINDOW_S = 10.0


class Throughput:
    """Generated tokens per second over the last ``window`` seconds (thread-safe)."""

    def __init__(self, window: float = WINDOW_S) -> None:
        self.window, self.started = window, time.monotonic()
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((now, tokens))
            self._drop(now)

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._drop(now)
            total = sum(n for _, n in self._events)
        return total / max(min(self.window, now - self.started), 1e-9)

    def _drop(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()


def _gauge(
    name: str, doc: str, value: float | None, labels: dict[str, str] | None = None
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    if value is not None:
        family.add_metric(list((labels or {}).values()), float(value))
    return family


# engine.stats()["offload"] key -> (metric name, help): present when experts are offloaded
OFFLOAD_GAUGES = {
    "resident_experts": ("moectl_resident_experts", "Experts resident in memory (all MoE layers)."),
    "hit_rate": ("moectl_expert_hit_rate", "Share of expert uses served by resident experts."),
    "bytes_moved": (
        "moectl_expert_bytes_read",
        "Bytes of expert weights read from the store into resident slots.",
    ),
    "loads": ("moectl_expert_loads", "Expert loads into resident slots."),
    "union_mean": (
        "moectl_expert_union_mean",
        "Distinct experts a decoding step's rows need together per MoE layer (mean); above the budget a step reloads.",
    ),
    "budget_per_layer": ("moectl_expert_budget_per_layer", "Resident expert slots per MoE layer."),
}


class EngineCollector(Collector):
    """The engine's figures, read at scrape time."""

    def __init__(self, engine: Any, throughput: Throughput) -> None:
        self.engine, self.throughput = engine, throughput

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield _gauge("moectl_running_sequences", "Sequences being generated.", stats.get("running", 0))
        yield _gauge("moectl_queue_depth", "Requests waiting for a batch row.", stats.get("waiting", 0))
        yield _gauge(
            "moectl_tokens_per_second",
            f"Generated tokens/s over the last {WINDOW_S:g} s.",
            self.throughput.rate(),
        )
        yield _gauge("moectl_engine_steps", "Engine steps run.", stats.get("steps"))
        yield _gauge(
            "moectl_prefix_tokens_reused",
            "Prompt tokens whose KV came from the prefix cache instead of a forward.",
            stats.get("prefix_tokens_reused"),
        )
        rates = GaugeMetricFamily(
            "moectl_switch_rate",
            "Expert switch rate of finished requests, per routing name (default: the model as trained).",
            labels=["routing"],
        )
        for name, rate in (stats.get("switch_rate") or {}).items():
            if rate is not None:
                rates.add_metric([str(name)], float(rate))
        yield rates
        forwards = GaugeMetricFamily(
            "moectl_decode_forwards",
            "Decoding forwards run, by forward: compiled (moectl.lm.compiled_decode), lean "
            "(moectl.lm.lean_decode) or model (the model's own).",
            labels=["forward"],
        )
        for path in ("compiled", "lean", "model"):
            forwards.add_metric([path], float((stats.get("decode_forward") or {}).get(path, 0)))
        yield forwards
        slow = GaugeMetricFamily(
            "moectl_decode_slow_steps",
            "Decoding steps a compiled runner left to a slower forward, by the feature that needed it.",
            labels=["reason"],
        )
        for reason, n in ((stats.get("decode_forward") or {}).get("slow") or {}).items():
            slow.add_metric([str(reason)], float(n))
        yield slow
        yield from _expert_tokens(self.engine)
        offload = stats.get("offload") or {}
        for key, (name, doc) in OFFLOAD_GAUGES.items():
            if offload.get(key) is not None:
                yield _gauge(name, doc, offload[key])


def _expert_tokens(engine: Any) -> Iterator[Metric]:
    """The expert distribution window's counts (engine/expert_counts.py), while it holds any."""
    counts = getattr(engine, "expert_counts", None)
    dump = counts.dump() if counts is not None else None
    if dump is None or dump["started"] is None:
        return
    family = GaugeMetricFamily(
        "moectl_expert_tokens",
        "Tokens routed to each expert of each MoE layer per routing, over the expert distribution record "
        "window (/start_expert_distribution_record).",
        labels=["routing", "layer", "expert"],
    )
    for name, entry in dump["routings"].items():
        for layer, row in zip(dump["moe_layers"], entry["counts"], strict=True):
            for expert, value in enumerate(row):
                family.add_metric([name, str(layer), str(expert)], float(value))
    yield family


class ServerMetrics:
    """The app's registry and the instruments the request handlers update."""

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        self.throughput = Throughput()
        self.requests = Counter(
            "moectl_requests",
            "Requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "moectl_prompt_tokens", "Prompt tokens admitted.", registry=self.registry
        )
        self.generated_tokens = Counter(
            "moectl_generated_tokens", "Tokens generated.", registry=self.registry
        )
        self.ttft = Histogram(
            "moectl_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "moectl_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request.",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine, self.throughput))

    def tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)
        self.throughput.add(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


ENDPOINTS = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"})


class RequestCounter:
    """ASGI middleware: notes each request's arrival (``request.state.arrived``, where time to first
    token starts) and counts it by endpoint and status once the status is sent. Paths that are
    not endpoints count as ``other`` (a scan of random paths must not grow the label set)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrived"] = time.perf_counter()
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
