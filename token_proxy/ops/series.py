"""The labelled children one request observes, looked up once per route (RouteSeries) and per served
model (VllmSeries) instead of per request, a histogram child's observe as one bisect (fast_observer), and many
observations at once (observe_many, observe_repeated: a request's inter-token latencies).
ProxyMetrics (ops/metrics.py) owns the series and passes itself as `metrics`; these only hold its children
(not imported here: ops/ has no cycles, type-only imports counted)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from math import inf, isnan


class RouteSeries:
    """One route's children for one stream label, looked up once: what every request observes."""

    __slots__ = ("_metrics", "_statuses", "completion_tokens", "endpoint", "latency", "prompt_tokens", "render",
                 "stream", "tpot", "ttft")

    def __init__(self, metrics, endpoint: str, stream: str):
        self._metrics, self.endpoint, self.stream = metrics, endpoint, stream
        self._statuses: dict[int, object] = {}
        self.latency = fast_observer(metrics.child(metrics.latency, endpoint, stream))
        self.render = fast_observer(metrics.render)

    def __getattr__(self, name: str):
        """The children only some requests observe (ttft, tpot, prompt and completion tokens), made on first
        use: a labelled child appears in /metrics once made, so a route that never had a first token (a
        probe, a 404) shows none of them, as before they were looked up once."""
        metrics = self._metrics
        if name in ("ttft", "tpot"):
            value = fast_observer(metrics.child(getattr(metrics, name), self.endpoint, self.stream))
        elif name in ("prompt_tokens", "completion_tokens"):
            value = metrics.child(getattr(metrics, name), self.endpoint)
        else:
            raise AttributeError(name)
        setattr(self, name, value)
        return value

    def requests(self, status: int):
        found = self._statuses.get(status)
        if found is None:
            metrics = self._metrics
            found = self._statuses[status] = metrics.child(metrics.requests, self.endpoint, str(status), self.stream)
        return found


class VllmSeries:
    """The served model's vLLM request-level children, looked up once."""

    __slots__ = ("_engine", "_metrics", "_reasons", "e2e", "generation_tokens", "itl", "model", "prompt_tokens",
                 "tpot", "ttft")

    def __init__(self, metrics, model: str, engine: str):
        self._metrics, self.model, self._engine = metrics, model, engine
        self._reasons: dict[str, object] = {}
        self.prompt_tokens = self.generation_tokens = None
        if metrics.vllm_prompt_tokens is not None:
            self.prompt_tokens = fast_observer(metrics.child(metrics.vllm_prompt_tokens, model, engine))
            self.generation_tokens = fast_observer(metrics.child(metrics.vllm_generation_tokens, model, engine))
        self.e2e = fast_observer(metrics.child(metrics.vllm_e2e, model, engine))
        self.ttft = fast_observer(metrics.child(metrics.vllm_ttft, model, engine))
        self.tpot = fast_observer(metrics.child(metrics.vllm_tpot, model, engine))
        self.itl = metrics.child(metrics.vllm_itl, model, engine)

    def success(self, reason: str):
        found = self._reasons.get(reason)
        if found is None:
            metrics = self._metrics
            found = self._reasons[reason] = metrics.child(metrics.vllm_success, self.model, self._engine,
                                                          reason)
        return found


def fast_observer(histogram) -> Callable[[float], None]:
    """`histogram.observe` for one labelled child (or an unlabelled histogram), as one bisect: the same
    sum and the same bucket (the first upper bound >= the amount) as prometheus-client's scan over every
    bucket (~1.3 us with the 20-odd latency buckets; this ~0.5). Reads its internals; where they are not
    as expected it is `observe` itself, and so it is for a NaN (which no bucket takes)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets) or bounds[-1] != inf:
        return histogram.observe
    add, counts, slow = total.inc, [bucket.inc for bucket in buckets], histogram.observe

    def observe(amount: float) -> None:
        if isnan(amount):
            slow(amount)
            return
        add(amount)
        counts[bisect_left(bounds, amount)](1)

    return observe


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
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets) or bounds[-1] != inf:
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


def observe_repeated(histogram, amount: float, times: int) -> None:
    """`histogram.observe(amount)` `times` times as one write to its bucket and one to its sum (a non-streamed
    reply's inter-token latencies: one mean per decoded token). As observe_many, it falls back to observe."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets) or bounds[-1] != inf \
            or isnan(amount):
        for _ in range(times):
            histogram.observe(amount)
        return
    total.inc(amount * times)
    buckets[bisect_left(bounds, amount)].inc(times)
