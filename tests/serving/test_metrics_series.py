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


def test_a_probe_makes_no_token_or_first_token_series():
    """As when children were looked up per request: a route that never saw a first token or a token (a probe,
    a 404) shows only its request count and latency in /metrics, no zero ttft/tpot/token series."""
    metrics = ProxyMetrics()
    metrics.observe("/health", 200, RequestStats(endpoint="/health"), 0.001)
    names = {(s.name, s.labels.get("endpoint")) for m in metrics.registry.collect() for s in m.samples}
    endpoints = {name: endpoint for name, endpoint in names if endpoint == "/health"}
    assert "token_proxy_requests_total" in endpoints
    assert "token_proxy_request_duration_seconds_count" in endpoints
    for absent in ("token_proxy_time_to_first_token_seconds_count", "token_proxy_time_per_output_token_seconds_count",
                   "token_proxy_prompt_tokens_total", "token_proxy_completion_tokens_total"):
        assert absent not in endpoints, absent
    metrics.observe("/v1/completions", 200, RequestStats(endpoint="/v1/completions", prompt_tokens=3), 0.01)
    assert metrics.registry.get_sample_value("token_proxy_prompt_tokens_total", {"endpoint": "/v1/completions"}) == 3
