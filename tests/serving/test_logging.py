"""One JSON access line per request, with every field, and the X-Request-Id that names it."""

from __future__ import annotations

import atexit
import io
import logging
import re

import orjson
import pytest

from token_proxy.ops import configure_logging
from token_proxy.ops.access_log import ACCESS_LOGGER, JsonFormatter
from token_proxy.simulator import SIM_STATE

CHAT = "/v1/chat/completions"
FIELDS = {"ts", "request_id", "method", "endpoint", "path", "status", "stream", "prompt_tokens",
          "completion_tokens", "cached_tokens", "latency_s", "ttft_s", "sent_s", "render_s", "backend_rid", "weight_version",
          "adapter", "prompt_cache_hit", "client_disconnected"}


def access_lines(caplog) -> list[dict]:
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    for line in lines:
        assert set(line) == FIELDS
    return lines


@pytest.fixture
def access(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    return caplog


async def test_chat_line_has_every_field_and_the_id_is_the_sglang_rid(make_sim, make_proxy, access):
    sim = await make_sim(weight_version="step-3")
    proxy = await make_proxy(sim)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    resp = await proxy.post(CHAT, json=body, headers={"X-Request-Id": "trace-1"})
    reply = await resp.json()
    assert resp.status == 200
    sent_rid = sim.app[SIM_STATE].received[-1]["rid"]
    assert resp.headers["X-Request-Id"] == sent_rid == "chatcmpl-trace-1"
    (line,) = [line for line in access_lines(access) if line["endpoint"] == CHAT]
    assert line["request_id"] == line["backend_rid"] == sent_rid
    assert (line["method"], line["path"], line["status"], line["stream"]) == ("POST", CHAT, 200, False)
    assert line["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert line["completion_tokens"] == reply["usage"]["completion_tokens"] == 3
    assert line["weight_version"] == "step-3"
    assert line["prompt_cache_hit"] is False and line["client_disconnected"] is False
    assert 0 < line["sent_s"] < line["ttft_s"] <= line["latency_s"] < 10
    assert 0 < line["render_s"] < line["sent_s"]  # a first render: a cache miss


async def test_streams_carry_the_header_too(proxy, access):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    resp = await proxy.post(CHAT, json=body)
    await resp.read()
    rid = resp.headers["X-Request-Id"]
    assert rid.startswith("chatcmpl-")
    (line,) = [line for line in access_lines(access) if line["endpoint"] == CHAT]
    assert (line["request_id"], line["stream"], line["status"]) == (rid, True, 200)


async def test_requests_without_a_backend_rid_get_the_clients_id_or_a_fresh_one(proxy, access):
    given = await proxy.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "mine-7"})
    fresh = await proxy.post("/tokenize", json={"prompt": "hi"})
    bad = await proxy.post(CHAT, data=b"{", headers={"Content-Type": "application/json"})
    assert given.headers["X-Request-Id"] == "mine-7"
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["X-Request-Id"])
    assert bad.status == 400 and bad.headers["X-Request-Id"]
    lines = access_lines(access)
    assert [(line["request_id"], line["status"]) for line in lines] == [
        ("mine-7", 200), (fresh.headers["X-Request-Id"], 200), (bad.headers["X-Request-Id"], 400)]
    assert lines[0]["prompt_tokens"] == lines[0]["completion_tokens"] == 0
    assert lines[0]["backend_rid"] is None and lines[0]["ttft_s"] is None and lines[0]["sent_s"] is None


async def test_probes_log_at_debug_only(proxy, access):
    await proxy.get("/metrics")
    assert access_lines(access) == []
    access.set_level(logging.DEBUG, logger=ACCESS_LOGGER)
    await proxy.get("/metrics")
    assert [line["endpoint"] for line in access_lines(access)] == ["/metrics"]


def test_configured_logging_writes_access_lines_raw_and_the_rest_as_json(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        listener = configure_logging("info", "json")
        logging.getLogger("token_proxy.app").info("serving %s", "tiny")
        logging.getLogger(ACCESS_LOGGER).info('{"request_id":"r1"}')
        logging.getLogger("token_proxy.app").debug("hidden")
        listener.stop()
        atexit.unregister(listener.stop)
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    first, second = stream.getvalue().splitlines()
    assert orjson.loads(first) | {"ts": 0} == {"ts": 0, "level": "info", "logger": "token_proxy.app",
                                                "message": "serving tiny"}
    assert second == '{"request_id":"r1"}'


def test_json_formatter_keeps_exceptions():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, __import__("sys").exc_info())
    line = orjson.loads(JsonFormatter().format(record))
    assert line["message"] == "failed" and "ValueError: boom" in line["exception"]


def test_library_lines_go_through_the_proxy_logger_as_json(monkeypatch):
    """transformers prints through a stderr handler of its own (its "PyTorch was not found" advisory,
    on import without torch): under --log-format json that line must come out as JSON too."""
    stream, library_stream = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root, library = logging.getLogger(), logging.getLogger("transformers")
    saved = root.handlers[:], root.level, library.handlers[:], library.propagate, library.filters[:]
    try:
        listener = configure_logging("info", "json")
        own = logging.StreamHandler(library_stream)  # what transformers installs when it is imported
        library.addHandler(own)
        library.propagate = False
        library.warning("PyTorch was not found. Models won't be available")
        logging.getLogger("transformers.tokenization_utils_base").warning("a child logger's line")
        listener.stop()
        atexit.unregister(listener.stop)
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        library.handlers[:], library.propagate, library.filters[:] = saved[2], saved[3], saved[4]
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["logger"], line["level"]) for line in lines][:1] == [("transformers", "warning")]
    assert "PyTorch was not found" in lines[0]["message"]
    assert "PyTorch" not in library_stream.getvalue()
