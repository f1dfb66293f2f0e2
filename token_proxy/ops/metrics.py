"""The proxy's series table: every Prometheus series one proxy application has (ProxyMetrics), in
its own registry, and how one finished request's RequestStats becomes observations.

Who feeds and reads it: the middleware (ops/observe.py), the SGLang scrape and weight version
(ops/backend_scrape.py), GET /metrics (ops/exposition.py), and with --workers N the multiprocess
registry and collector mirror (ops/metrics_mirror.py).

One process (--workers 1, the default): plain in-memory prometheus-client metrics, exact.
Several (--workers N): each worker counts in prometheus-client's multiprocess mode (the supervisor
sets PROMETHEUS_MULTIPROC_DIR for the workers only) and renders the merged files; the series that
must come from exactly one process (the vllm: view, the weight version, LoRA adapters, process_*)
come from the admin owner as one text block (token_proxy/serving/metrics_block.py), appended.

No `_created` samples: prometheus-client writes one per counter and histogram child, which in text
0.0.4 is a gauge series of its own holding the same start-up time, for every labelled series that
starts at 0 (issue 31 counted 88 growing to 219; with the admin rows at 0, 577 of 1,431 samples and 67 of
153 KB). Prometheus needs none of them for rate(). add_observability turns them off process-wide (prometheus-client's only
switch) unless the operator set PROMETHEUS_DISABLE_CREATED_SERIES (=false keeps them).
"""

from __future__ import annotations

import logging
import math
import time
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
)
from prometheus_client import (
    multiprocess as prom_multiprocess,
)

from token_proxy.ops.histograms import (
    LATENCY_BUCKETS,
    RENDER_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    VLLM_ITL_BUCKETS,
    VLLM_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    WEIGHT_UPDATE_BUCKETS,
    one_two_five_buckets,
)
from token_proxy.ops.metrics_mirror import CollectorMirror, WorkerRegistry
from token_proxy.ops.series import RouteSeries, VllmSeries, observe_many, observe_repeated
from token_proxy.ops.vllm_metrics import BackendMetrics
from token_proxy.pipeline.request_state import RequestStats
from token_proxy.sglang.client import RETRY_REASONS

log = logging.getLogger(__name__)

PREFIX = "token_proxy_"
UNMATCHED = "unmatched"  # 404s and 405s: the raw path would be unbounded label cardinality
CLIENT_CLOSED = 499  # nginx's "client closed request"
_BACKEND_ERROR_KINDS = {502: "error", 503: "unavailable", 504: "timeout"}

VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, all at 0
VLLM_ENGINE = "0"  # one SGLang behind the proxy: vLLM's engine index 0
# Statuses an inference route answers besides 200, created at 0 (a 503 series born at its first 503
# hides that first refusal from rate()/increase()).
INFERENCE_STATUSES = ("200", "400", "404", "413", "499", "500", "502", "503", "504")
# An admin route's statuses created at 0 (besides 200): refusals, conflicts and SGLang's failures.
ADMIN_STATUSES = ("200", "400", "409", "500", "502", "503", "504")


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
        self.upstream_retries = counter(PREFIX + "upstream_retries_total", "SGLang calls sent once more: a reused "
                                        "connection closed before any answer (SGLang's keep-alive: disconnected, "
                                        "reset), or a whole reply broken off mid-body (broken_reply: the server "
                                        "generating it died)", ["reason"])
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
                                   "seconds (streams: until the first chunk went out; whole replies: the proxy's "
                                   "time until the call to SGLang plus SGLang's meta_info request_received_ts to "
                                   "prefill_finished_time, left out when SGLang sends no such timestamps).", vllm,
                                   buckets=VLLM_TTFT_BUCKETS)
        self.vllm_itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                  "seconds (one per output token after a choice's first: streams from the gaps "
                                  "between SGLang's event batches, whole replies from SGLang's decode time).", vllm,
                                  buckets=VLLM_ITL_BUCKETS)
        self.vllm_tpot = histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                                   "time_per_output_token_seconds per request (whole replies: from SGLang's "
                                   "meta_info prefill_finished_time to request_finished_ts, left out without them).",
                                   vllm, buckets=VLLM_ITL_BUCKETS)
        self.vllm_e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                                  "seconds.", vllm, buckets=VLLM_LATENCY_BUCKETS)
        self.vllm_success = counter("vllm:request_success", "Count of successfully processed requests.",
                                    [*vllm, "finished_reason"])
        # vLLM's request_prompt_tokens / request_generation_tokens: their 1-2-5 buckets end at the
        # served model's max_model_len, so they are made once SGLang is known (start_vllm_series).
        self._histogram = histogram
        self.vllm_prompt_tokens: Histogram | None = None
        self.vllm_generation_tokens: Histogram | None = None
        # vLLM's per-request families: every process counts its own requests (with --workers N, in the
        # multiprocess files), unlike the vllm: view of SGLang's /metrics that the owner alone renders.
        self.per_request_vllm = frozenset(m._name for m in (self.vllm_ttft, self.vllm_itl, self.vllm_tpot,
                                                             self.vllm_e2e, self.vllm_success)) | {
            "vllm:request_prompt_tokens", "vllm:request_generation_tokens"}
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
        # routes that swap weights (timed and counted).
        self.weight_update_routes: frozenset[str] | None = None
        self._children: dict[tuple, object] = {}
        self._routes: dict[tuple[str, bool], RouteSeries] = {}  # (endpoint, stream): its children, made once
        self._vllm: VllmSeries | None = None  # the served model's vLLM children, made once

    def routes_from_table(self, inference: list[str], weight_update: list[str]) -> None:
        """The route table's rows: the inference routes the proxy serves, whose labelled series start
        at 0 (rate() and increase() then see the first event), and the weight routes."""
        if self.weight_update_routes is None:
            self.weight_update_routes = frozenset(weight_update)
        self.start_at_zero(inference, self.weight_update_routes)

    def start_at_zero(self, endpoints, weight_routes) -> None:
        """Create every known label combination of the counters and histograms (the inference and weight
        routes of the table) at 0, so the first event is an increase from 0 (a series born at 1 hides it from
        rate() and increase()). Other routes' histograms (a probe's, a 404's) appear on first use."""
        for endpoint in endpoints:
            for stream in ("false", "true"):
                for status in INFERENCE_STATUSES:
                    self.requests.labels(endpoint, status, stream)
                self.latency.labels(endpoint, stream)  # the histograms too: rate() sees their first observation
                self.ttft.labels(endpoint, stream)
            self.tpot.labels(endpoint, "true")  # streams only
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
            self.weight_update_latency.labels(endpoint)  # the first weight update is an increase from 0

    def start_routes_at_zero(self, endpoints, admin_endpoints=()) -> None:
        """Every other served route (admin, tokenizer, ops) at 0 for its 200; an admin route also for
        its refusals and SGLang's failures (ADMIN_STATUSES) and its backend errors by kind."""
        for endpoint in endpoints:
            self.requests.labels(endpoint, "200", "false")
        for endpoint in admin_endpoints:
            for status in ADMIN_STATUSES:
                self.requests.labels(endpoint, status, "false")
            for kind in _BACKEND_ERROR_KINDS.values():
                self.backend_errors.labels(endpoint, kind)

    def start_vllm_series(self, model_name: str, max_model_len: int = 0) -> None:
        """vLLM creates its request-level series at start-up, each at 0; so does the proxy, once the
        served model's name (and its max_model_len, the token histograms' last bucket) is known."""
        self.model_name = model_name
        if self.vllm_prompt_tokens is None:
            buckets = one_two_five_buckets(max_model_len or 1)
            vllm = ["model_name", "engine"]
            self.vllm_prompt_tokens = self._histogram("vllm:request_prompt_tokens", "Number of prefill tokens "
                                                      "processed.", vllm, buckets=buckets)
            self.vllm_generation_tokens = self._histogram("vllm:request_generation_tokens", "Number of "
                                                          "generation tokens processed.", vllm, buckets=buckets)
        for reason in VLLM_FINISH_REASONS:
            self.vllm_success.labels(model_name, VLLM_ENGINE, reason)
        for histogram in (self.vllm_ttft, self.vllm_itl, self.vllm_tpot, self.vllm_e2e, self.vllm_prompt_tokens,
                          self.vllm_generation_tokens):
            histogram.labels(model_name, VLLM_ENGINE)

    def _observe_vllm(self, stats: RequestStats) -> None:
        """vLLM 0.33's request-level series as its output processor records them, per engine request: here per
        choice (vLLM runs each of n samples as its own request). Every choice SGLang finished counts once in
        request_success (by reason; SGLang's aborts as "abort"), the e2e latency, the prompt and generation
        token histograms and the time per output token, so their counts agree; the choices of a request its
        client left count only if they had finished (vLLM records no stats for a client's abort). The first
        token: once per choice that produced output. Inter-token latency: one observation per output token
        after a choice's first (vLLM: one per engine step), for whole replies too (from SGLang's decode time).
        A whole reply without SGLang's meta_info timestamps is left out of the three time-per-token series."""
        vllm = self._vllm_series()
        e2e = stats.finished_at - stats.started_at
        decode_s = stats.backend_decode_s
        if stats.stream:
            last = stats.last_event_at if stats.last_event_at is not None else stats.finished_at
            decode_s = last - stats.first_token_at if stats.first_token_at is not None else None
        for choice in stats.finished:
            vllm.success(choice.reason).inc()
            vllm.e2e(e2e)
            if vllm.prompt_tokens is not None:
                vllm.prompt_tokens(choice.prompt_tokens)
                vllm.generation_tokens(choice.generation_tokens)
            if decode_s is not None:
                decode_tokens = choice.generation_tokens - 1
                vllm.tpot(decode_s / decode_tokens if decode_tokens > 0 else 0.0)
                if not stats.stream and decode_tokens > 0:
                    observe_repeated(vllm.itl, decode_s / decode_tokens, decode_tokens)
        ttft = self._first_token_s(stats)
        if ttft is not None:
            for _ in range(stats.started_choices):
                vllm.ttft(ttft)
        if stats.stream and stats.event_gaps:
            observe_many(vllm.itl, stream_token_gaps(stats.event_gaps, stats.event_tokens, stats.started_choices))

    @staticmethod
    def _first_token_s(stats: RequestStats) -> float | None:
        """Streams: until the first chunk went out; whole replies: the proxy's time until the call plus
        SGLang's request_received_ts to prefill_finished_time (None without them)."""
        if stats.first_token_at is None:
            return None
        if stats.stream:
            return stats.first_token_at - stats.started_at
        if stats.backend_first_token_s is not None and stats.sent_at is not None:
            return stats.sent_at - stats.started_at + stats.backend_first_token_s
        return None

    def _vllm_series(self) -> VllmSeries:
        """The served model's vLLM children (made again if the model or its token histograms appear later)."""
        vllm = self._vllm
        if vllm is None or vllm.model != self.model_name or (vllm.prompt_tokens is None) != (
                self.vllm_prompt_tokens is None):
            vllm = self._vllm = VllmSeries(self, self.model_name, VLLM_ENGINE)
        return vllm

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
        route = self._routes.get((endpoint, stats.stream)) or self._route_series(endpoint, stats.stream)
        route.requests(status).inc()
        route.latency(latency_s)
        if stats.first_token_at is not None:
            route.ttft(stats.first_token_at - stats.started_at)
            if stats.stream and stats.completion_tokens > 1 and stats.finished_at is not None:
                per_token = (stats.finished_at - stats.first_token_at) / (stats.completion_tokens - 1)
                route.tpot(per_token)
        if stats.finished or stats.first_token_at is not None:  # an inference request
            self._observe_vllm(stats)
        if stats.prompt_tokens:
            route.prompt_tokens.inc(stats.prompt_tokens)
        if stats.completion_tokens:
            route.completion_tokens.inc(stats.completion_tokens)
        if stats.cached_tokens:
            self.child(self.cached_tokens, endpoint).inc(stats.cached_tokens)
        if stats.prompt_cache_hit is not None:
            self.child(self.prompt_cache, "hit" if stats.prompt_cache_hit else "miss").inc()
            if not stats.prompt_cache_hit:
                route.render(stats.render_s)
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

    def _route_series(self, endpoint: str, stream: bool) -> RouteSeries:
        route = self._routes[(endpoint, stream)] = RouteSeries(self, endpoint, "true" if stream else "false")
        return route

    def observe_weight_update(self, endpoint: str, status: int, latency_s: float) -> bool:
        ok = 200 <= status < 300
        self.weight_updates.labels(endpoint, "success" if ok else "failure").inc()
        self.weight_update_latency.labels(endpoint).observe(latency_s)
        if ok:
            self.last_weight_update.set(time.time())
        return ok

    def scrape_registry(self) -> CollectorRegistry:
        """What GET /metrics renders: this process's registry (with --workers: every worker's files, merged)."""
        if not self.multiprocess:
            return self.registry
        self.mirror.sync()
        merged = CollectorRegistry()
        prom_multiprocess.MultiProcessCollector(merged)
        return merged

    def set_weight_version(self, version: str) -> None:
        self.current_weight_version = version
        if self.multiprocess:
            return
        self.weight_version_info.clear()
        self.weight_version_info.labels(version).set(1)
        self.weight_version.set(_as_number(version))


def stream_token_gaps(gaps: list[float], tokens: list[int], choices: int) -> list[float]:
    """A stream's inter-token latencies as vLLM defines them (one per output token after a choice's first):
    a batch of events that brought k tokens over `choices` choices after a gap g stands for k tokens of
    max(1, k / choices) engine steps, each g / steps. `tokens`: the output tokens so far after each batch,
    the first batch's included (one more entry than `gaps`)."""
    amounts: list[float] = []
    choices = max(1, choices)
    for gap, before, after in zip(gaps, tokens, tokens[1:]):
        new = after - before
        if new > 0:
            amounts += [gap / max(1.0, new / choices)] * new
    return amounts


def _as_number(version: str) -> float:
    try:
        return float(version)
    except ValueError:
        return math.nan


METRICS = web.AppKey("metrics", ProxyMetrics)
