"""vLLM's scheduler metric names, derived from SGLang's own /metrics, for clients that scrape vLLM
(prime-rl's adaptive concurrency reads vllm:num_requests_running, vllm:num_requests_waiting,
vllm:kv_cache_usage_perc and vllm:num_preemptions).

The proxy reads SGLang's /metrics every few seconds (backend_scrape.py runs the loop). When no read has
succeeded for `stale_after_s`, the vllm: series are withdrawn from the exposition instead of being
left frozen at their last values, and token_proxy_backend_metrics_stale says so.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


@dataclass(frozen=True, slots=True)
class Derived:
    name: str  # vLLM's family name (counters are exposed with _total)
    kind: str  # "gauge" or "counter"
    sources: tuple[str, ...]  # SGLang sample names, added together
    combine: str  # across data-parallel groups: "sum" or "max"
    doc: str


VIEW = (
    Derived("vllm:num_requests_running", "gauge", ("sglang:num_running_reqs",), "sum",
            "Number of requests in model execution batches (SGLang's num_running_reqs)."),
    Derived("vllm:num_requests_waiting", "gauge", ("sglang:num_queue_reqs", "sglang:num_grammar_queue_reqs"),
            "sum", "Number of requests waiting to be processed (SGLang's queue + grammar queue)."),
    Derived("vllm:kv_cache_usage_perc", "gauge", ("sglang:token_usage",), "max",
            "KV-cache usage. 1 means 100 percent usage (SGLang's token_usage)."),
    Derived("vllm:num_preemptions", "counter", ("sglang:num_retracted_requests_total",), "sum",
            "Cumulative number of preemption from the engine (SGLang's retractions)."),
    Derived("vllm:prompt_tokens", "counter", ("sglang:prompt_tokens_total",), "sum",
            "Number of prefill tokens processed."),
    Derived("vllm:generation_tokens", "counter", ("sglang:generation_tokens_total",), "sum",
            "Number of generation tokens processed."),
    Derived("vllm:prefix_cache_queries", "counter", ("sglang:prompt_tokens_total",), "sum",
            "Prefix cache queries, in terms of number of queried tokens."),
    Derived("vllm:prefix_cache_hits", "counter", ("sglang:cached_tokens_total",), "sum",
            "Prefix cache hits, in terms of number of cached tokens (SGLang's cached_tokens)."),
)
# vllm:num_requests_waiting_by_reason{reason}: SGLang's waiting queue is waiting for capacity; its
# grammar queue waits for a grammar to compile (vLLM's "deferred": not schedulable yet).
WAITING_BY_REASON = (("capacity", "sglang:num_queue_reqs"), ("deferred", "sglang:num_grammar_queue_reqs"))
WANTED = frozenset(source for derived in VIEW for source in derived.sources)
# Every TP/PP rank of one scheduler reports the same numbers (with
# --enable-metrics-for-all-schedulers): keep one of them, add up everything else (DP ranks,
# is_streaming, cache_source).
_REPLICA_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank"})
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_sglang(text: str) -> dict[str, dict[tuple, float]]:
    """The WANTED samples of a Prometheus text page: name -> {labels minus replica ranks: value}.
    Replicas of one value keep the largest. Cheap: only the few wanted lines are parsed."""
    found: dict[str, dict[tuple, float]] = {}
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        brace = line.find("{")  # names hold no braces or spaces, and values no braces
        name = line[:brace] if brace >= 0 else line.partition(" ")[0]
        if name not in WANTED:
            continue
        labels, value = _split(line, brace)
        if value is None:
            continue
        groups = found.setdefault(name, {})
        key = tuple(sorted((k, v) for k, v in labels if k not in _REPLICA_LABELS))
        groups[key] = max(groups.get(key, value), value)
    return found


def merge_pages(pages: list[str]) -> dict[str, dict[tuple, float]]:
    """parse_sglang of several servers' pages, each sample keyed by its server too (none is lost)."""
    if len(pages) == 1:
        return parse_sglang(pages[0])
    merged: dict[str, dict[tuple, float]] = {}
    for server, page in enumerate(pages):
        for name, groups in parse_sglang(page).items():
            into = merged.setdefault(name, {})
            for key, value in groups.items():
                into[(("server", str(server)), *key)] = value
    return merged


def _split(line: str, brace: int) -> tuple[list[tuple[str, str]], float | None]:
    if brace >= 0:
        close = line.rfind("}")
        labels = _LABEL.findall(line[brace + 1:close])
        rest = line[close + 1:].split()
    else:
        labels, rest = [], line.split()[1:]
    try:
        return labels, float(rest[0])
    except (IndexError, ValueError):
        return labels, None


def derive(samples: dict[str, dict[tuple, float]]) -> dict[str, float]:
    """vLLM name -> value. Counters SGLang has not created yet (no retraction so far) read 0;
    gauges SGLang does not report are left out."""
    values = {}
    for derived in VIEW:
        groups = [v for source in derived.sources for v in samples.get(source, {}).values()]
        if groups:
            values[derived.name] = max(groups) if derived.combine == "max" else sum(groups)
        elif derived.kind == "counter":
            values[derived.name] = 0.0
    for reason, source in WAITING_BY_REASON:
        if source in samples:
            values[f"waiting_by_reason:{reason}"] = sum(samples[source].values())
    return values


class BackendMetrics:
    """A prometheus-client collector: the latest derived values while fresh, and the scrape's health."""

    def __init__(self, model_name: str = "", stale_after_s: float = 10.0, clock=time.monotonic):
        self.model_name = model_name
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._values: dict[str, float] = {}
        self._last_ok: float | None = None  # clock() of the last good read
        self._last_ok_unix: float | None = None
        self.up = False  # the last read succeeded
        self.failures: Counter | None = None
        self._prefix = "token_proxy_"
        self._cache_config: dict[str, str] | None = None

    def set_cache_config(self, max_total_num_tokens: int, page_size: int) -> None:
        """vLLM's KV capacity labels from SGLang's: blocks of page_size tokens, and vLLM's kv_cache_size_tokens
        (prime-rl reads kv_cache_size_tokens first, else num_gpu_blocks x block_size, as the KV capacity)."""
        self._cache_config = {"block_size": str(page_size), "num_gpu_blocks": str(max_total_num_tokens // page_size),
                              "kv_cache_size_tokens": str(max_total_num_tokens),
                              "enable_prefix_caching": "True", "engine": "0"}

    def register(self, registry, prefix: str) -> None:
        self._prefix = prefix
        self.failures = Counter(prefix + "backend_metrics_scrape_failures_total", "Reads of SGLang's "
                                "/metrics that failed", registry=registry)
        registry.register(self)

    def update(self, text: str) -> None:
        self.update_many([text])

    def update_many(self, pages: list[str]) -> None:
        """One read of every SGLang server's page (several behind a router): their samples added up
        (kv usage: the fullest), as data-parallel ranks of one server are."""
        self._values = derive(merge_pages(pages))
        self._last_ok = self._clock()
        self._last_ok_unix = time.time()
        self.up = True

    def failed(self) -> None:
        self.up = False
        if self.failures is not None:
            self.failures.inc()

    @property
    def stale(self) -> bool:
        return self._last_ok is None or self._clock() - self._last_ok > self.stale_after_s

    def collect(self):
        prefix = self._prefix
        stale = self.stale
        yield GaugeMetricFamily(prefix + "backend_metrics_up", "1 if the last read of SGLang's /metrics "
                                "succeeded", value=1.0 if self.up else 0.0)
        yield GaugeMetricFamily(prefix + "backend_metrics_stale", "1 while the vllm: view is withdrawn "
                                "(no good read of SGLang's /metrics within the staleness window)",
                                value=1.0 if stale else 0.0)
        if self._last_ok_unix is not None:
            yield GaugeMetricFamily(prefix + "backend_metrics_last_success_timestamp_seconds", "Unix time "
                                    "of the last good read of SGLang's /metrics", value=self._last_ok_unix)
        if self._cache_config is not None:  # configuration, not a live value: shown while known
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig "
                                     "(from SGLang's max_total_num_tokens and page_size)",
                                     labels=list(self._cache_config))
            info.add_metric(list(self._cache_config.values()), 1.0)
            yield info
        if stale:
            return
        labels = ["model_name", "engine"]
        for derived in VIEW:
            value = self._values.get(derived.name)
            if value is None:
                continue
            cls = CounterMetricFamily if derived.kind == "counter" else GaugeMetricFamily
            family = cls(derived.name, derived.doc, labels=labels)
            family.add_metric([self.model_name, "0"], value)
            yield family
        reasons = [(reason, self._values[f"waiting_by_reason:{reason}"]) for reason, _ in WAITING_BY_REASON
                   if f"waiting_by_reason:{reason}" in self._values]
        if reasons:
            family = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Number of requests waiting, by "
                                       "reason (capacity: SGLang's queue; deferred: its grammar queue)",
                                       labels=[*labels, "reason"])
            for reason, value in reasons:
                family.add_metric([self.model_name, "0", reason], value)
            yield family
