"""The proxy's Prometheus metrics: one registry per application, one middleware that feeds it,
and GET /metrics.

One process (--workers 1, the default): plain in-memory prometheus-client metrics, exact.
Several (--workers N): each worker counts in prometheus-client's multiprocess mode (the supervisor
sets PROMETHEUS_MULTIPROC_DIR for the workers only) and renders the merged files; the series that
must come from exactly one process (the vllm: view, the weight version, LoRA adapters, process_*)
come from the admin owner as one text block (token_proxy/serving/metrics_block.py), appended.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from bisect import bisect_left
from functools import partial

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client import (
    multiprocess as prom_multiprocess,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics import MetricWrapperBase

from token_proxy.errors import BackendTimeout, BackendUnavailable, ProxyError
from token_proxy.http_io import INFERENCE, route_kind, routes_where
from token_proxy.ops.access_log import log_request
from token_proxy.ops.vllm_metrics import BackendMetrics
from token_proxy.pipeline.request_state import RequestStats, add_request_id_header, stats_of
from token_proxy.role import ROLE
from token_proxy.sglang.client import RETRY_REASONS
from token_proxy.state import CONTEXT, REGISTER_COLLECTOR, SETTINGS

log = logging.getLogger(__name__)

PREFIX = "token_proxy_"
UNMATCHED = "unmatched"  # 404s and 405s: the raw path would be unbounded label cardinality
CLIENT_CLOSED = 499  # nginx's "client closed request"
_BACKEND_ERROR_KINDS = {502: "error", 503: "unavailable", 504: "timeout"}

# Milliseconds to twenty minutes: a cache-hit 1-token reply up to a long stream on a busy server.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80,
                160, 640)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 1, 2.5, 5)
RENDER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# vLLM 0.33's request-level series (vllm/v1/metrics/loggers.py, buckets.py), same names, buckets and
# labels (model_name, engine), for the Grafana boards and prime-rl monitors written for vLLM. vLLM 0.33
# has no vllm:time_per_output_token_seconds any more: its per-request mean is
# vllm:request_time_per_output_token_seconds (on the inter-token buckets).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, all at 0
VLLM_ENGINE = "0"  # one SGLang behind the proxy: vLLM's engine index 0
# Statuses an inference route answers besides 200, created at 0 (a 503 series born at its first 503
# hides that first refusal from rate()/increase()).
INFERENCE_STATUSES = ("200", "400", "404", "413", "499", "500", "502", "503", "504")
# prime-rl allows 720 s for /update_weights.
WEIGHT_UPDATE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 720, 1800)


MIRROR_INTERVAL_S = 1.0


class WorkerRegistry(CollectorRegistry):
    """A --workers process's registry: its metric objects write multiprocess files; other collectors
    (those that read the process's own state at scrape time, such as the session store's) are kept
    aside for CollectorMirror."""

    def __init__(self):
        super().__init__(auto_describe=True)
        self.custom: list = []

    def register(self, collector) -> None:
        super().register(collector)
        if not isinstance(collector, MetricWrapperBase):
            self.custom.append(collector)


class CollectorMirror:
    """prometheus-client's multiprocess mode merges only its own metric objects' files. With --workers,
    a custom collector's families are copied into multiprocess metrics of the same names (every
    MIRROR_INTERVAL_S, and before a scrape): counters by their increase (summed over workers), gauges
    as the live sum. Another worker's values are at most that interval old."""

    def __init__(self, collectors: list):
        self.collectors = collectors
        self._metrics: dict[tuple[str, str], object] = {}
        self._seen: dict[tuple, float] = {}
        self._lock = threading.Lock()  # the scrape syncs in a thread, the loop on its interval

    def sync(self) -> None:
        with self._lock:
            for collector in list(self.collectors):
                for family in collector.collect():
                    if family.type in ("counter", "gauge") and family.samples:
                        self._copy(family)

    def _copy(self, family) -> None:
        labelnames = tuple(family.samples[0].labels)
        metric = self._metrics.get((family.name, family.type))
        if metric is None:
            if family.type == "counter":
                metric = Counter(family.name, family.documentation, labelnames, registry=None)
            else:
                metric = Gauge(family.name, family.documentation, labelnames, registry=None,
                               multiprocess_mode="livesum")
            self._metrics[(family.name, family.type)] = metric
        for sample in family.samples:
            if tuple(sample.labels) != labelnames or (family.type == "counter" and not sample.name.endswith("_total")):
                continue
            values = tuple(sample.labels.values())
            child = metric.labels(*values) if labelnames else metric
            if family.type == "gauge":
                child.set(sample.value)
                continue
            increase = sample.value - self._seen.get((sample.name, values), 0.0)
            if increase > 0:
                child.inc(increase)
                self._seen[(sample.name, values)] = sample.value


class ProxyMetrics:
    """Every metric of one proxy application, registered in its own registry."""

    def __init__(self, model_name: str = "", stale_after_s: float = 10.0, multiprocess: bool = False):
        # multiprocess: a --workers process; its values live in PROMETHEUS_MULTIPROC_DIR's files.
        self.multiprocess = multiprocess
        self.registry = WorkerRegistry() if multiprocess else CollectorRegistry(auto_describe=True)
        self.mirror = CollectorMirror(self.registry.custom) if multiprocess else None
        reg = self.registry
        counter, gauge, histogram = (partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram))
        route, timed = ["endpoint"], ["endpoint", "stream"]
        self.requests = counter(PREFIX + "requests_total", "Requests answered, by route, HTTP status and "
                                "streaming (499: the client left first)", ["endpoint", "status", "stream"])
        self.in_flight = gauge(PREFIX + "requests_in_flight", "Requests being served now", route,
                               multiprocess_mode="livesum")
        self.latency = histogram(PREFIX + "request_duration_seconds", "End-to-end time in the proxy, until "
                                 "the last byte (streams included)", timed, buckets=LATENCY_BUCKETS)
        self.ttft = histogram(PREFIX + "time_to_first_token_seconds", "Time until the first output reached "
                              "the client (non-streaming: the whole reply)", timed, buckets=TTFT_BUCKETS)
        self.tpot = histogram(PREFIX + "time_per_output_token_seconds", "Streams: time per output token "
                              "after the first", timed, buckets=TPOT_BUCKETS)
        self.prompt_tokens = counter(PREFIX + "prompt_tokens_total", "Prompt tokens sent to SGLang", route)
        self.completion_tokens = counter(PREFIX + "completion_tokens_total", "Tokens SGLang generated", route)
        self.cached_tokens = counter(PREFIX + "cached_prompt_tokens_total", "Prompt tokens SGLang served "
                                     "from its prefix cache", route)
        self.prompt_cache = counter(PREFIX + "prompt_cache_lookups_total", "Rendered-prompt cache lookups "
                                    "(chat template + tokenization), by result", ["result"])
        self.render = histogram(PREFIX + "render_duration_seconds", "Chat template rendering and "
                                "tokenization, when it ran (cache misses)", buckets=RENDER_BUCKETS)
        self.backend_errors = counter(PREFIX + "backend_errors_total", "Requests failed by SGLang: error "
                                      "(502), unavailable (503), timeout (504)", ["endpoint", "kind"])
        self.upstream_retries = counter(PREFIX + "upstream_retries_total", "SGLang calls sent once more on a "
                                        "fresh connection: the reused one was closed before any answer "
                                        "(SGLang's keep-alive), by how it failed", ["reason"])
        for reason in RETRY_REASONS:
            self.upstream_retries.labels(reason)
        self.overloaded = counter(PREFIX + "overload_rejections_total", "Requests the proxy refused with "
                                  "503 and Retry-After (too many in flight)", route)
        self.disconnects = counter(PREFIX + "client_disconnects_total", "Requests whose client left before "
                                   "the end (their SGLang requests are aborted)", route)
        self.weight_updates = counter(PREFIX + "weight_updates_total", "Weight update calls, by route and "
                                      "result (success: 2xx)", ["endpoint", "result"])
        self.weight_update_latency = histogram(PREFIX + "weight_update_duration_seconds", "Weight update "
                                               "calls, start to end", route, buckets=WEIGHT_UPDATE_BUCKETS)
        self.last_weight_update = gauge(PREFIX + "last_weight_update_timestamp_seconds", "Unix time of the "
                                        "last successful weight update", multiprocess_mode="max")
        self.stale_replies = counter(PREFIX + "stale_replies_total", "SGLang replies on a weight version the "
                                     "fleet does not serve, sent again instead of returned (streams: "
                                     "checked at the first event)", route)
        self.unhonoured_seeds = counter(PREFIX + "unhonoured_seed_requests_total", "Requests whose `seed` "
                                        "SGLang ignores (started without --enable-deterministic-inference)", route)
        vllm = ["model_name", "engine"]
        self.vllm_ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                   "seconds (streams: until the first chunk went out).", vllm,
                                   buckets=VLLM_TTFT_BUCKETS)
        self.vllm_itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                  "seconds (streams: the gaps between SGLang's event batches).", vllm,
                                  buckets=VLLM_ITL_BUCKETS)
        self.vllm_tpot = histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                                   "time_per_output_token_seconds per request.", vllm, buckets=VLLM_ITL_BUCKETS)
        self.vllm_e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                                  "seconds.", vllm, buckets=VLLM_LATENCY_BUCKETS)
        self.vllm_success = counter("vllm:request_success", "Count of successfully processed requests.",
                                    [*vllm, "finished_reason"])
        # vLLM's per-request families: every process counts its own requests (with --workers N, in the
        # multiprocess files), unlike the vllm: view of SGLang's /metrics that the owner alone renders.
        self.per_request_vllm = frozenset(m._name for m in (self.vllm_ttft, self.vllm_itl, self.vllm_tpot,
                                                             self.vllm_e2e, self.vllm_success))
        self.model_name = ""  # the served model, once SGLang is known (start_vllm_series)
        self._seed_warned_at: float | None = None
        self._seeds_unwarned = 0
        self.current_weight_version: str | None = None
        self.backend = BackendMetrics(model_name, stale_after_s)
        if not multiprocess:  # else the owner's block carries these (one producer, no stale label files)
            self.weight_version_info = gauge(PREFIX + "weight_version_info", "1 for the weight version SGLang "
                                             "serves now", ["weight_version"])
            self.weight_version = gauge(PREFIX + "weight_version", "The current weight version as a number "
                                        "(NaN when it is not one)")
            self.backend.register(self.registry, PREFIX)
            # The standard process_* and python_* names dashboards expect, in this app's own registry.
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        # From the route table's flags when the app starts (routes_from_table), unless set before:
        # routes that swap weights (timed and counted), and those after which SGLang may serve another
        # weight version (the gauge is refreshed from /model_info).
        self.weight_update_routes: frozenset[str] | None = None
        self.version_routes: frozenset[str] = frozenset()
        self._children: dict[tuple, object] = {}

    def routes_from_table(self, inference: list[str], weight_update: list[str], sets_version: list[str]) -> None:
        """The route table's rows: the inference routes the proxy serves, whose labelled series start
        at 0 (rate() and increase() then see the first event), and the weight routes."""
        if self.weight_update_routes is None:
            self.weight_update_routes = frozenset(weight_update)
        self.version_routes = self.weight_update_routes | frozenset(sets_version)
        self.start_at_zero(inference, self.weight_update_routes)

    def start_at_zero(self, endpoints, weight_routes) -> None:
        """Create every known label combination of the counters at 0, so the first event is an
        increase from 0 (a series born at 1 hides it from rate() and increase())."""
        for endpoint in endpoints:
            for stream in ("false", "true"):
                for status in INFERENCE_STATUSES:
                    self.requests.labels(endpoint, status, stream)
            for counter in (self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.overloaded,
                            self.disconnects, self.unhonoured_seeds, self.stale_replies):
                counter.labels(endpoint)
            for kind in _BACKEND_ERROR_KINDS.values():
                self.backend_errors.labels(endpoint, kind)
        for result in ("hit", "miss"):
            self.prompt_cache.labels(result)
        for endpoint in weight_routes:
            for result in ("success", "failure"):
                self.weight_updates.labels(endpoint, result)

    def start_routes_at_zero(self, endpoints) -> None:
        """Every other served route (admin, tokenizer, ops) answered 200 once, at 0."""
        for endpoint in endpoints:
            self.requests.labels(endpoint, "200", "false")

    def start_vllm_series(self, model_name: str) -> None:
        """vLLM creates request_success for every finish reason at start-up; so does the proxy, once the
        served model's name is known."""
        self.model_name = model_name
        for reason in VLLM_FINISH_REASONS:
            self.vllm_success.labels(model_name, VLLM_ENGINE, reason)

    def _observe_vllm(self, status: int, stats: RequestStats) -> None:
        """vLLM's request-level series, from timings the pipeline already took: one observation per
        finished request, plus one per stream event batch for the inter-token latency."""
        model, engine = self.model_name, VLLM_ENGINE
        for reason in stats.finish_reasons:
            self.child(self.vllm_success, model, engine, reason).inc()
        if stats.client_disconnected or status == CLIENT_CLOSED:
            if not stats.finish_reasons:
                self.child(self.vllm_success, model, engine, "abort").inc()
            return
        if status != 200 or not stats.finish_reasons or stats.finished_at is None:
            return
        self.child(self.vllm_e2e, model, engine).observe(stats.finished_at - stats.started_at)
        if not stats.stream or stats.first_token_at is None:  # a whole reply has no first-token time
            return
        self.child(self.vllm_ttft, model, engine).observe(stats.first_token_at - stats.started_at)
        observe_many(self.child(self.vllm_itl, model, engine), stats.event_gaps)
        decode_tokens = stats.completion_tokens - 1
        per_token = (stats.last_event_at - stats.first_token_at) / decode_tokens if decode_tokens > 0 else 0.0
        self.child(self.vllm_tpot, model, engine).observe(per_token)

    def unhonoured_seed(self, endpoint: str, now: float | None = None) -> None:
        """Count a request whose seed SGLang ignores; warn at most once a minute."""
        self.child(self.unhonoured_seeds, endpoint).inc()
        self._seeds_unwarned += 1
        now = time.monotonic() if now is None else now
        if self._seed_warned_at is None or now - self._seed_warned_at >= 60.0:
            log.warning("%d request(s) carried a seed SGLang ignores: start it with --enable-deterministic-inference, "
                        "or run the proxy with --require-honoured-seed to refuse them", self._seeds_unwarned)
            self._seed_warned_at, self._seeds_unwarned = now, 0

    def upstream_retry(self, reason: str) -> None:
        self.child(self.upstream_retries, reason).inc()

    def child(self, metric, *labels: str):
        """A labelled child, looked up in prometheus-client once per label set, not per request."""
        key = (metric._name, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def observe(self, endpoint: str, status: int, stats: RequestStats, latency_s: float,
                overloaded: bool = False) -> None:
        stream = "true" if stats.stream else "false"
        self.child(self.requests, endpoint, str(status), stream).inc()
        self.child(self.latency, endpoint, stream).observe(latency_s)
        if stats.first_token_at is not None:
            self.child(self.ttft, endpoint, stream).observe(stats.first_token_at - stats.started_at)
            if stats.stream and stats.completion_tokens > 1 and stats.finished_at is not None:
                per_token = (stats.finished_at - stats.first_token_at) / (stats.completion_tokens - 1)
                self.child(self.tpot, endpoint, stream).observe(per_token)
        if stats.finish_reasons or stats.first_token_at is not None:  # an inference request
            self._observe_vllm(status, stats)
        if stats.prompt_tokens:
            self.child(self.prompt_tokens, endpoint).inc(stats.prompt_tokens)
        if stats.completion_tokens:
            self.child(self.completion_tokens, endpoint).inc(stats.completion_tokens)
        if stats.cached_tokens:
            self.child(self.cached_tokens, endpoint).inc(stats.cached_tokens)
        if stats.prompt_cache_hit is not None:
            self.child(self.prompt_cache, "hit" if stats.prompt_cache_hit else "miss").inc()
            if not stats.prompt_cache_hit:
                self.render.observe(stats.render_s)
        if stats.seed_unhonoured:
            self.unhonoured_seed(stats.endpoint)
        if stats.stale_replies:
            self.child(self.stale_replies, endpoint).inc(stats.stale_replies)
        if overloaded:
            self.child(self.overloaded, endpoint).inc()
        elif (stats.stream_error_status or status) in _BACKEND_ERROR_KINDS:  # in-stream failures too
            kind = _BACKEND_ERROR_KINDS[stats.stream_error_status or status]
            self.child(self.backend_errors, endpoint, kind).inc()
        if stats.client_disconnected or status == CLIENT_CLOSED:
            self.child(self.disconnects, endpoint).inc()
        if stats.weight_version and stats.weight_version != self.current_weight_version:
            self.set_weight_version(stats.weight_version)

    def observe_weight_update(self, endpoint: str, status: int, latency_s: float) -> bool:
        ok = 200 <= status < 300
        self.weight_updates.labels(endpoint, "success" if ok else "failure").inc()
        self.weight_update_latency.labels(endpoint).observe(latency_s)
        if ok:
            self.last_weight_update.set(time.time())
        return ok

    def exposition(self) -> bytes:
        """The exposition text of this process's metrics (with --workers: of every worker's files)."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        self.mirror.sync()
        merged = CollectorRegistry()
        prom_multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)

    def set_weight_version(self, version: str) -> None:
        self.current_weight_version = version
        if self.multiprocess:
            return
        self.weight_version_info.clear()
        self.weight_version_info.labels(version).set(1)
        self.weight_version.set(_as_number(version))


def observe_many(histogram, amounts: list[float]) -> None:
    """`histogram.observe(a)` for every amount, as one write per bucket touched and one to the sum: a
    stream's inter-token gaps are ~130 observations, each a locked write (an mmap'd file's under
    --workers), 0.7 us each here, 1.9 us under --workers. Reads prometheus-client's Histogram internals;
    where they are not as expected, observes one by one. (The sum is added at once: it may differ
    from one-by-one adds in the last bit.)"""
    if not amounts:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets) or bounds[-1] != math.inf:
        for amount in amounts:
            histogram.observe(amount)
        return
    total.inc(sum(amounts))
    # observe() counts an amount in the first bucket whose upper bound is >= it: bisect_left's index.
    counts: dict[int, int] = {}
    for amount in amounts:
        index = bisect_left(bounds, amount)
        counts[index] = counts.get(index, 0) + 1
    for index, n in counts.items():
        buckets[index].inc(n)


def _as_number(version: str) -> float:
    try:
        return float(version)
    except ValueError:
        return math.nan


METRICS = web.AppKey("metrics", ProxyMetrics)


def endpoint_of(request: web.Request) -> str:
    """The route's canonical path (e.g. /v1/chat/completions), never the raw one."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


@web.middleware
async def observe_requests(request: web.Request, handler):
    """Outermost middleware: sees the final status (after the error middleware), counts, times,
    and writes the access line. Costs a few microseconds; nothing here waits."""
    metrics = request.app[METRICS]
    stats = stats_of(request)  # created here, so stats.started_at is the request's start
    endpoint = endpoint_of(request)
    gauge = metrics.child(metrics.in_flight, endpoint)
    gauge.inc()
    status, overloaded = 500, False
    try:
        response = await handler(request)
        status = response.status
        overloaded = stats.overloaded  # the proxy's own refusal (a 503 from SGLang's side is not)
        if isinstance(response, web.Response) and not response.prepared:
            # A whole reply leaves now, so the client does not wait for the bookkeeping below;
            # aiohttp's own prepare and write_eof then find it sent.
            try:
                await response.prepare(request)
                await response.write_eof()
            except ConnectionError:
                status = CLIENT_CLOSED
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = CLIENT_CLOSED
        raise
    finally:
        gauge.dec()
        stats.finished_at = time.perf_counter()
        if stats.client_disconnected:
            status = CLIENT_CLOSED
        latency = stats.finished_at - stats.started_at
        metrics.observe(endpoint, status, stats, latency, overloaded)
        if endpoint in metrics.version_routes:
            _after_weight_update(request, metrics, endpoint, status, latency)
        log_request(request, endpoint, status, stats, latency)


def _after_weight_update(request: web.Request, metrics: ProxyMetrics, endpoint: str, status: int,
                         latency: float) -> None:
    if endpoint in metrics.weight_update_routes:
        metrics.observe_weight_update(endpoint, status, latency)
    if 200 <= status < 300:
        ctx = request.app.get(CONTEXT)
        if ctx is not None:
            ctx.spawn(refresh_weight_version(version_client(ctx), metrics))


def version_client(ctx):
    """Where the weight version is read: the backend, or behind a router its first worker (a router
    serves no /model_info)."""
    connected = ctx.connection.connected
    if connected is None or not connected.picture.behind_router:
        return ctx.client
    return ctx.client.at(connected.picture.worker_urls[0])


async def refresh_weight_version(client, metrics: ProxyMetrics) -> None:
    """Ask SGLang which weights it now serves (a weight update may not say)."""
    try:
        info = await client.get_json("/model_info", timeout_s=10.0)
    except ProxyError:
        return
    version = info.get("weight_version") if isinstance(info, dict) else None
    if version:
        metrics.set_weight_version(str(version))


async def metrics_endpoint(request: web.Request) -> web.Response:
    """GET /metrics, in Prometheus' text format 0.0.4. Rendering runs in a thread: a big registry
    takes a millisecond or more, which the event loop should not pay."""
    body = await asyncio.get_running_loop().run_in_executor(None, request.app[METRICS].exposition)
    extra = request.app.get(EXTRA_METRICS)
    if extra is not None:  # a --workers process: the owner's one-producer block
        body += await extra(request.app)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


# A --workers process: more exposition text for /metrics (token_proxy/serving/metrics_block.py).
EXTRA_METRICS = web.AppKey("extra_metrics", object)


async def backend_metrics(app: web.Application):
    """cleanup_ctx, after the proxy context: reads SGLang's /metrics on an interval for the vllm:
    view, and seeds the weight version from start-up discovery."""
    settings, metrics, ctx = app[SETTINGS], app[METRICS], app[CONTEXT]

    def seed(backend) -> None:  # once SGLang is known (start-up may come before it)
        metrics.backend.model_name = backend.served_model_name
        if backend.max_total_num_tokens:
            metrics.backend.set_cache_config(backend.max_total_num_tokens, backend.page_size)
        if backend.weight_version:
            metrics.set_weight_version(str(backend.weight_version))

    ctx.when_ready(seed)
    interval = settings.backend_metrics_interval_s
    task = None
    if interval > 0:
        timeout = min(5.0, max(interval, settings.backend_metrics_stale_s / 2))
        task = asyncio.get_running_loop().create_task(_scrape_forever(ctx, metrics, interval, timeout))
    yield
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _scrape_forever(ctx, metrics: ProxyMetrics, interval: float, timeout: float) -> None:
    """Reads SGLang's /metrics for the vllm: view: the backend's, or behind an sglang-router (which serves
    none) each worker's, added up (_read_pages). When SGLang answers again after failing (it may have
    restarted, with other weights), the weight version is read again at once. Whether SGLang answers at
    all is the proxy's outage signal (the connection's outage_began / outage_ended log it): a 404 is an
    answer. A page SGLang refuses is named once, after discovery (before it, a router's 404 says nothing)."""
    conn = ctx.connection
    backend, was_up, warned = metrics.backend, True, False
    while True:
        try:
            backend.update_many(await _read_pages(ctx, timeout))
            conn.outage_ended()
            warned = False
        except (BackendUnavailable, BackendTimeout) as exc:  # no answer: SGLang is gone, or not there yet
            backend.failed()
            conn.outage_began(exc.message)
        except ProxyError as exc:
            backend.failed()
            conn.outage_ended()
            if not warned and conn.connected is not None:
                warned = True
                hint = (" (start SGLang with --enable-metrics)" if "HTTP 404" in exc.message
                        else "; the vllm: view goes stale")
                log.warning("cannot read SGLang's /metrics: %s%s", exc.message, hint)
        except Exception:  # a bad page must not end the loop
            backend.failed()
            log.exception("unreadable /metrics page from SGLang")
        if backend.up and not was_up:
            log.info("reading SGLang's /metrics again")
            await refresh_weight_version(version_client(ctx), metrics)
        was_up = backend.up
        await asyncio.sleep(interval)


async def _read_pages(ctx, timeout: float) -> list[str]:
    """The backend's /metrics page, or behind a router every worker's (the router's port serves none).
    All workers unreachable is an outage; one worker failing is a ProxyError naming it."""
    connected = ctx.connection.connected
    if connected is None or not connected.picture.behind_router:
        return [await ctx.client.metrics_text(timeout)]
    urls = connected.picture.worker_urls
    pages = await asyncio.gather(*(ctx.client.at(url).metrics_text(timeout) for url in urls),
                                 return_exceptions=True)
    failed = [(url, page) for url, page in zip(urls, pages) if isinstance(page, BaseException)]
    for _url, exc in failed:
        if not isinstance(exc, ProxyError):
            raise exc
    if failed and len(failed) == len(urls) and all(isinstance(e, (BackendUnavailable, BackendTimeout))
                                                   for _, e in failed):
        raise failed[0][1]
    if failed:
        url, exc = failed[0]
        raise ProxyError(f"worker {url}: {exc.message}")
    return pages


def add_observability(app: web.Application) -> None:
    """Metrics registry, X-Request-Id on every response, and the backend scrape (append after the
    proxy context: it uses its SGLang client). The middleware goes first in create_app's list."""
    settings = app[SETTINGS]
    multiproc = app[ROLE].multiprocess if ROLE in app else False
    metrics = app[METRICS] = ProxyMetrics(stale_after_s=settings.backend_metrics_stale_s, multiprocess=multiproc)
    app[REGISTER_COLLECTOR] = metrics.registry.register
    app.on_response_prepare.append(add_request_id_header)
    app.on_startup.append(_start_routes_at_zero)
    app.on_startup.append(_start_vllm_series)
    if not multiproc:  # with --workers, the owner alone reads SGLang's /metrics
        app.cleanup_ctx.append(backend_metrics)
    else:
        app.cleanup_ctx.append(_mirror_collectors)


async def _start_routes_at_zero(app: web.Application) -> None:
    """The route table's inference and weight routes, then every fixed route of the finished router
    (admin routes included), at 0 before its first answer."""
    metrics = app[METRICS]
    served_inference = [path for path in routes_where(app, "served") if route_kind(app, path) == INFERENCE]
    metrics.routes_from_table(served_inference, routes_where(app, "weight_update"), routes_where(app, "sets_version"))
    paths = {resource.canonical for resource in app.router.resources()
             if isinstance(resource, web.PlainResource)}
    metrics.start_routes_at_zero(sorted(paths))


async def _start_vllm_series(app: web.Application) -> None:
    """vLLM's request_success series for the served model, at 0 once SGLang is known; the one place
    every role (single, owner, worker) starts them."""
    metrics, ctx = app[METRICS], app.get(CONTEXT)
    if ctx is not None:
        ctx.when_ready(lambda backend: metrics.start_vllm_series(backend.served_model_name))


async def _mirror_collectors(app: web.Application):
    """--workers: keep this worker's custom collectors' values in the multiprocess files (CollectorMirror)."""
    metrics = app[METRICS]
    mirror = metrics.mirror

    async def forever() -> None:
        while True:
            await asyncio.sleep(MIRROR_INTERVAL_S)
            try:
                mirror.sync()
            except Exception:  # a collector's bug must not end the loop
                log.exception("copying a metrics collector into the multiprocess files failed")

    task = asyncio.get_running_loop().create_task(forever())
    yield
    task.cancel()
    mirror.sync()  # the last values, before this worker's files are marked dead
