"""ops/series.py: a histogram observed by one bisect holds the same samples as prometheus-client's own
observe, and the children looked up once per route count what the per-request lookups counted."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from token_proxy.ops import ProxyMetrics
from token_proxy.ops.histograms import LATENCY_BUCKETS
from token_proxy.ops.series import fast_observer
from token_proxy.pipeline import RequestStats

AMOUNTS = [0.0, 1e-9, 0.001, 0.0025, 0.005, 0.1, 1.0, 2.5, 10.0, 59.9, 60.0, 1e9, -1.0, math.inf, -math.inf,
           math.nan, 3, 0]


def samples(registry):
    return sorted((s.name, tuple(sorted(s.labels.items())), repr(s.value)) for m in registry.collect()
                  for s in m.samples if not s.name.endswith("_created"))


@pytest.mark.parametrize("buckets", [LATENCY_BUCKETS, (1.0, 2.0), (0.5, math.inf)])
def test_fast_observer_matches_observe(buckets):
    slow_reg, fast_reg = CollectorRegistry(), CollectorRegistry()
    slow = Histogram("h", "h", ["a"], buckets=buckets, registry=slow_reg).labels("x")
    fast = fast_observer(Histogram("h", "h", ["a"], buckets=buckets, registry=fast_reg).labels("x"))
    for amount in AMOUNTS:
        slow.observe(amount)
        fast(amount)
    assert samples(fast_reg) == samples(slow_reg)


def test_fast_observer_falls_back_to_observe_without_the_internals():
    seen = []

    class Odd:
        def observe(self, amount):
            seen.append(amount)

    fast_observer(Odd())(1.5)
    assert seen == [1.5]


def test_route_children_count_each_status_and_stream_apart():
    metrics = ProxyMetrics()
    for stream, status in ((False, 200), (True, 200), (False, 200), (False, 400)):
        stats = RequestStats(endpoint="/v1/completions", stream=stream, prompt_tokens=3)
        metrics.observe("/v1/completions", status, stats, 0.01)
    value = metrics.registry.get_sample_value
    assert value("token_proxy_requests_total", {"endpoint": "/v1/completions", "status": "200", "stream": "false"}) == 2
    assert value("token_proxy_requests_total", {"endpoint": "/v1/completions", "status": "200", "stream": "true"}) == 1
    assert value("token_proxy_requests_total", {"endpoint": "/v1/completions", "status": "400", "stream": "false"}) == 1
    assert value("token_proxy_request_duration_seconds_count", {"endpoint": "/v1/completions", "stream": "false"}) == 3
    assert value("token_proxy_prompt_tokens_total", {"endpoint": "/v1/completions"}) == 12
