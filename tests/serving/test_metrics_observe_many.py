"""observe_many (ops/series.py): a stream's inter-token gaps in one update per bucket give the
histogram one-by-one observe() gives."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Histogram

from token_proxy.ops.series import observe_many, observe_repeated

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


def test_under_workers_mmapd_values_take_the_same_counts(tmp_path):
    """--workers: prometheus-client's multiprocess values (chosen at import, so in a child process)."""
    script = f"""
from prometheus_client import CollectorRegistry, Histogram, values
from token_proxy.ops.series import observe_many, observe_repeated
assert values.ValueClass.__name__ == "MmapedValue", values.ValueClass
one, many = (Histogram(name, "g", ["m"], buckets={BOUNDS!r}, registry=CollectorRegistry()).labels("m")
             for name in ("one", "many"))
for a in {AMOUNTS!r}:
    one.observe(a)
observe_many(many, {AMOUNTS!r})
print([b.get() for b in one._buckets] == [b.get() for b in many._buckets], abs(one._sum.get() - many._sum.get()) < 1e-9)
"""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.stdout.strip() == "True True", out.stderr[-2000:]


def test_observe_repeated_is_observe_n_times():
    one, many = CollectorRegistry(), CollectorRegistry()
    slow = Histogram("h", "h", buckets=(0.01, 0.1, 1.0), registry=one)
    fast = Histogram("h", "h", buckets=(0.01, 0.1, 1.0), registry=many)
    for amount, times in ((0.05, 7), (0.1, 3), (5.0, 2), (0.0, 1)):
        for _ in range(times):
            slow.observe(amount)
        observe_repeated(fast, amount, times)
    assert [(s.name, s.labels, s.value) for m in one.collect() for s in m.samples if not s.name.endswith("_created")] \
        == [(s.name, s.labels, s.value) for m in many.collect() for s in m.samples if not s.name.endswith("_created")]
