"""bench/proxy_roles.py, which bench_ceiling.py and bench_workers_cpu.py stand on (issue 30.3): which process
of the proxy's tree is the supervisor, a serving process or something else, and the per-stream arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.bench_modules import load_bench_module


@pytest.fixture(scope="module")
def roles():
    load_bench_module("cpu_groups")  # proxy_roles imports it by name
    return load_bench_module("proxy_roles")


def _child(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])


def test_a_root_with_serving_children_is_the_supervisor(roles, tmp_path):
    serving = _child("-m", "token_proxy.serving.process", str(tmp_path), "0")
    other = _child("simulator")
    try:
        snap = roles.snapshot(os.getpid())  # this test's process stands for the supervisor
        assert snap[serving.pid].role == "serving"
        assert snap[other.pid].role == "other"
        assert snap[os.getpid()].role == "supervisor"
        assert snap[os.getpid()].cpu_ns > 0
    finally:
        for proc in (serving, other):
            proc.kill()
            proc.wait()


def test_a_root_without_serving_children_serves_itself(roles):
    other = _child("simulator")
    try:
        snap = roles.snapshot(os.getpid())
        assert snap[os.getpid()].role == "single"
        assert snap[other.pid].role == "other"
    finally:
        other.kill()
        other.wait()


def test_per_role_divides_by_streams_and_sums_each_role(roles):
    stat = roles.ProcStat
    before = {1: stat("supervisor", 0, 0, 0, 0), 2: stat("serving", 1_000_000, 10, 10, 5),
              3: stat("serving", 0, 0, 0, 0)}
    after = {1: stat("supervisor", 4_000_000, 0, 0, 20), 2: stat("serving", 21_000_000, 1310, 1330, 605),
             3: stat("serving", 60_000_000, 3900, 3960, 1800), 4: stat("serving", 20_000_000, 0, 0, 0)}
    per = roles.per_role(before, after, 100)
    assert per["supervisor"] == {"processes": 1, "cpu_ms": 0.04, "reads": 0.0, "writes": 0.0, "wakeups": 0.2,
                                 "cpu_ms_each": [0.04]}
    assert per["serving"]["processes"] == 3  # one born meanwhile counts whole
    assert per["serving"]["cpu_ms"] == pytest.approx(1.0)
    assert per["serving"]["cpu_ms_each"] == [0.6, 0.2, 0.2]
    assert (per["serving"]["reads"], per["serving"]["writes"], per["serving"]["wakeups"]) == (52.0, 52.8, 24.0)
    cells = roles.role_cells(per)
    assert cells["serving_ms"] == pytest.approx(1.0)
    assert cells["supervisor_ms"] == 0.04
    assert cells["total_ms"] == pytest.approx(1.04)
    assert cells["spread"] == pytest.approx(1.8)  # the busiest of three took 0.6 of 1.0


def test_roles_table_is_the_median_over_rounds(roles):
    def row(serving_ms: float, rnd: int) -> dict:
        cells = {"serving_ms": serving_ms, "supervisor_ms": 0.05, "total_ms": serving_ms + 0.05, "reads": 130.0,
                 "writes": 131.0, "wakeups": 60.0, "supervisor_wakeups": 1.0, "spread": 1.1}
        return {"workers": 4, "flags": "", "stream": True, "concurrency": 256, "round": rnd, "extra": {"roles": cells}}

    lines = roles.roles_table([row(9.0, 0), row(11.0, 1), row(10.0, 2), {"workers": None, "extra": {}}])
    assert lines[2] == ("| proxy x4 | yes | 256 | 10.00 (9.00..11.00) | 0.050 (0.050..0.050) | 10.05 (9.05..11.05) "
                        "| 130.0 (130.0..130.0) | 131.0 (131.0..131.0) | 60.0 (60.0..60.0) | 1.00 (1.00..1.00) "
                        "| 1.10 (1.10..1.10) |")
    assert len(lines) == 3
    assert roles.roles_table([{"workers": 1, "extra": {}}]) == []
