"""bench/bench_bridge.py's report (issue 38 item 7), on CPU: the table of the three paths with the ratios, and the
split of the bridge's push read from the bridge's own log line (token_proxy/bridge/server.py's `push` logs it: the
format is produced here by that very logger call, so a change there breaks this test, not the GPU run)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_bridge", ROOT / "bench/bench_bridge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bridge_log_line(caplog, seconds: float, load_s: float) -> str:
    """The line server.push writes, written by its own format string."""
    from token_proxy.bridge import server

    result = {"buckets": 4, "tensors": 290, "bytes": 1 << 30, "seconds": seconds, "load_s": load_s, "errors": []}
    with caplog.at_level(logging.INFO, logger=server.log.name):
        caplog.clear()
        server.log.info("push (%s): %d bucket(s), %d tensor(s), %.3f GiB in %.3f s, of which %.3f s waiting for "
                        "SGLang's loads; errors: %s", "vllm", result["buckets"], result["tensors"],
                        result["bytes"] / (1 << 30), result["seconds"], result["load_s"], result["errors"] or "none")
        return caplog.records[-1].getMessage()


def test_the_bridges_own_log_line_is_the_one_the_bench_parses(bench, caplog):
    source = (ROOT / "token_proxy/bridge/server.py").read_text()
    assert ('"push (%s): %d bucket(s), %d tensor(s), %.3f GiB in %.3f s, of which %.3f s waiting for SGLang\'s "'
            in source)
    line = bridge_log_line(caplog, 1.25, 0.5)
    assert [m.groups() for m in bench.PUSH_LINE.finditer(line)] == [("4", "290", "1.000", "1.250", "0.500")]


def test_the_table_ratios_and_split(bench, caplog):
    gib = 1 << 30
    results = {"direct": {"bytes": gib, "tensors": 290, "seconds": [1.0, 1.2, 1.1]},
               "broadcast": {"bytes": gib, "tensors": 290, "seconds": [1.2, 1.2, 1.3]},
               "bridge": {"bytes": gib, "tensors": 290, "seconds": [1.4, 1.3, 1.5]}}
    log = "\n".join(bridge_log_line(caplog, s, 0.5) for s in (1.2, 1.1, 1.3))
    text = bench.report(results, 3, log)
    lines = text.splitlines()
    assert lines[0] == "| path | GiB | tensors | push s (median of 3) | each | GiB/s | × SGLang's own |"
    assert lines[2] == ("| SGLang's own receiver (token_proxy.broadcast straight at SGLang, no proxy) | 1.000 | 290 | "
                        "1.100 | 1.000, 1.200, 1.100 | 0.909 | 1.00 |")
    assert lines[4] == ("| weight bridge (vLLM sender → proxy + bridge → CUDA IPC → SGLang) | 1.000 | 290 | 1.400 | "
                        "1.400, 1.300, 1.500 | 0.714 | 1.27 |")
    assert "bridge / SGLang's own receiver: 1.27x (goal <= 1.25x); bridge / token_proxy.broadcast through the " \
           "proxy: 1.17x" in text
    assert "| NCCL receive + IPC hand-off, not waiting on SGLang (bridge) | 0.700 | 50% |" in text
    assert "| waiting for SGLang's loads (/update_weights_from_tensor; the next receive overlaps) | 0.500 | 36% |" \
           in text
    assert "| the proxy and HTTP (start/update/finish: session, version, flush) | 0.200 | 14% |" in text
    assert "| above SGLang's own receiver (bridge − direct) | 0.300 | 21% |" in text
    assert "FALLBACK" not in text
    assert bench.report(results, 3, log, fallback=True).startswith(f"**{bench.LABEL}**")


def test_a_log_without_every_push_says_so(bench):
    results = {m: {"bytes": 1 << 30, "tensors": 1, "seconds": [1.0]} for m in ("direct", "broadcast", "bridge")}
    assert "(the bridge's log has 0 push line(s), not 1: no split)" in bench.report(results, 1, "")
