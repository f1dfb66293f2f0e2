"""observe_many (proxy/ops/metrics.py): a stream's inter-token gaps in one update per bucket give the
histogram one-by-one observe() gives."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from token_proxy.proxy.ops.metrics import observe_many

BOUNDS = [0.01, 0.025, 0.05, 0.1, 1.0]
# on a bound, between bounds, below the first, past the last (+Inf), zero, negative, repeats
AMOUNTS = [0.01, 0.025, 0.0100001, 0.005, 0.03, 0.03, 0.05, 0.7, 1.0, 2.5, 99.0, 0.0, -0.5, 0.024999]


def exposition(histogram: Histogram) -> dict:
    return {(s.name, s.labels.get("le")): s.value for s in histogram.collect()[0].samples if s.name != "h_created"}


def make():
    return Histogram("h", "gaps", ["model"], buckets=BOUNDS, registry=CollectorRegistry()).labels("m")


def test_one_update_per_bucket_equals_one_by_one():
    one_by_one, at_once = make(), make()
    for amount in AMOUNTS:
        one_by_one.observe(amount)
    observe_many(at_once, AMOUNTS)
    slow, fast = exposition(one_by_one), exposition(at_once)
    assert fast.pop(("h_sum", None)) == pytest.approx(slow.pop(("h_sum", None)))
    assert fast == slow
    assert slow[("h_bucket", "0.01")] == 4.0  # 0.01, 0.005, 0.0, -0.5
    assert slow[("h_bucket", "+Inf")] == 14.0 and slow[("h_count", None)] == 14.0


def test_nothing_to_observe_writes_nothing():
    histogram = make()
    observe_many(histogram, [])
    assert exposition(histogram)[("h_count", None)] == 0.0


def test_a_histogram_without_the_expected_internals_is_observed_one_by_one():
    class Plain:
        def __init__(self):
            self.seen = []

        def observe(self, amount):
            self.seen.append(amount)

    plain = Plain()
    observe_many(plain, [0.5, 0.25])
    assert plain.seen == [0.5, 0.25]
