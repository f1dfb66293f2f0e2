"""Start-up that tells the truth: the port opens at once and says why it cannot serve yet;
configuration errors end start-up in one line; wait messages name what happened."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.admin_fixtures import free_port
from token_proxy.cli import FLAG_GROUPS, normalise_backend_url, parse_settings
from token_proxy.ops.access_log import RepeatFilter
from token_proxy.serving.serve import new_event_loop

README = Path(__file__).resolve().parents[2] / "README.md"
CLI = [sys.executable, "-m", "token_proxy.cli"]


def _get(port: int, path: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_for_port(port: int, proc: subprocess.Popen, within_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"port {port} not open within {within_s} s")


def _until_refused(port: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while b"connection refused" not in _get(port, "/v1/models")[1]:
        assert time.monotonic() < deadline, f"no connection attempt reported within {within_s} s"
        time.sleep(0.05)


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKEN_PROXY_LOG_FORMAT": "json"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, check=False, timeout=timeout, env=env)


def test_port_opens_at_once_and_every_route_says_why_it_cannot_serve():
    """SGLang down for the whole --backend-wait: /metrics 200; /health, /v1/models and data routes 503
    with the reason (connection refused) in the body."""
    dead, port = free_port(), free_port()
    proc = subprocess.Popen([*CLI, "--backend", f"http://127.0.0.1:{dead}", "--host", "127.0.0.1", "--port",
                             str(port), "--backend-wait", "300", "--log-format", "json"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert _wait_for_port(port, proc, within_s=20) < 20
        status, body = _get(port, "/metrics")
        assert status == 200 and b"token_proxy_requests_total" in body
        _until_refused(port, within_s=20)  # one connection attempt has been made (polled: slow under load)
        for method, path, payload in (("GET", "/v1/models", None),
                                      ("POST", "/v1/chat/completions",
                                       b'{"messages": [{"role": "user", "content": "hi"}]}'),
                                      ("POST", "/v1/completions", b'{"prompt": "hi"}'),
                                      ("POST", "/inference/v1/generate", b'{"token_ids": [1]}')):
            status, body = _get(port, path, method, payload)
            error = json.loads(body)["error"]
            assert (path, status, error["code"]) == (path, 503, 503)
            assert "connection refused" in error["message"], error
        status, body = _get(port, "/health")
        assert status == 503 and json.loads(body)["error"]["code"] == 503
    finally:
        proc.terminate()
        proc.wait(10)
    lines = [json.loads(line) for line in proc.stderr.read().decode().splitlines()]  # all JSON
    waits = [line["message"] for line in lines if line.get("message", "").startswith("waiting for SGLang")]
    assert waits and "connection refused" in waits[0]


def test_a_nonexistent_local_tokenizer_ends_start_up_in_one_line():
    result = _run(["--tokenizer", "/nonexistent/tok", "--backend", "http://127.0.0.1:1", "--port",
                   str(free_port())])
    assert result.returncode == 2
    (line,) = [json.loads(text) for text in result.stderr.splitlines()]
    assert line["level"] == "error" and "'/nonexistent/tok'" in line["message"]


def test_a_tokenizer_that_fails_to_load_ends_start_up_naming_its_path(tmp_path):
    """The simulator runs as SGLang; the proxy's --tokenizer is a directory with a broken tokenizer."""
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    sim_port, port = free_port(), free_port()
    sim = subprocess.Popen([sys.executable, "-m", "token_proxy.simulator", "--port", str(sim_port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if _get_quiet(sim_port) == 200:
                break
            time.sleep(0.05)
        proc = subprocess.Popen([*CLI, "--backend", f"http://127.0.0.1:{sim_port}", "--tokenizer", str(tmp_path),
                                 "--host", "127.0.0.1", "--port", str(port), "--log-format", "json"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        health = []
        while proc.poll() is None:
            health.append(_get_quiet(port, "/health"))
            time.sleep(0.05)
            if len(health) > 600:
                proc.kill()
                pytest.fail("the proxy kept running with a tokenizer it cannot load")
        assert proc.returncode != 0
        lines = [json.loads(line) for line in proc.stderr.read().decode().splitlines()]
        errors = [line["message"] for line in lines if line["level"] == "error"]
        assert errors and all(str(tmp_path) in message and "\n" not in message for message in errors)
    finally:
        sim.terminate()
        sim.wait(10)


async def test_health_is_503_while_the_data_path_cannot_serve(make_sim, aiohttp_client, monkeypatch, tokenizer_dir):
    """SGLang answers /health 200, but the proxy cannot serve yet (its tokenizer is still loading)."""
    from token_proxy.app import create_app
    from token_proxy.settings import Settings
    from token_proxy.state import CONTEXT

    def slow_load(path):
        time.sleep(1.0)
        raise OSError("not a tokenizer")

    monkeypatch.setattr("token_proxy.sglang.discovery.load_tokenizer", slow_load)
    sim = await make_sim()
    proxy = await aiohttp_client(create_app(Settings(backend_url=str(sim.make_url("")).rstrip("/"),
                                                     tokenizer=str(tokenizer_dir))))
    await asyncio.sleep(0.3)
    assert not proxy.app[CONTEXT].connected
    resp = await proxy.get("/health")
    assert resp.status == 503
    url = str(sim.make_url("")).rstrip("/")  # the reason names the tokenizer, not SGLang, which is up
    assert (await resp.json())["error"]["message"] == (f"The proxy is loading the tokenizer '{tokenizer_dir}' "
                                                       f"(SGLang at {url} is up)")


def _get_quiet(port: int, path: str = "/health") -> int | None:
    try:
        return _get(port, path)[0]
    except OSError:
        return None


def test_a_busy_port_fails_in_one_line_before_the_simulator_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run(["--host", "127.0.0.1", "--port", str(port)])
    assert result.returncode == 2
    (line,) = [json.loads(text) for text in result.stderr.splitlines()]  # no simulator line before it
    assert f"127.0.0.1:{port}" in line["message"] and "Traceback" not in result.stderr


def test_a_bad_tokenizer_in_simulator_mode_names_the_path(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    result = _run(["--tokenizer", str(tmp_path), "--port", str(free_port())])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [json.loads(text) for text in result.stderr.splitlines()]
    assert any(line["level"] == "error" and str(tmp_path) in line["message"] for line in lines)
    assert len(lines) <= 4


@pytest.mark.parametrize(("given", "url", "warns"), [
    ("http://127.0.0.1:30000", "http://127.0.0.1:30000", False),
    ("http://127.0.0.1:30000/", "http://127.0.0.1:30000", False),
    ("http://sglang:30000/v1", "http://sglang:30000", True),
    ("https://host/prefix/v1/", "https://host/prefix", True),
])
def test_backend_url_is_normalised(given, url, warns):
    normalised, warning = normalise_backend_url(given)
    assert normalised == url and bool(warning) is warns


@pytest.mark.parametrize("given", ["127.0.0.1:30000", "localhost:30000", "sglang", "ftp://host:1"])
def test_backend_without_an_http_scheme_is_refused(given, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--backend", given], environ={})
    assert exit_info.value.code == 2
    assert "http://HOST:PORT" in capsys.readouterr().err


async def test_wait_reasons_say_what_happened(aiohttp_server, unused_tcp_port):
    import aiohttp

    from token_proxy.sglang import SGLangClient

    async def unhealthy(request):
        return web.Response(status=503)

    async def slow(request):
        await asyncio.sleep(2)
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", unhealthy)
    server = await aiohttp_server(app)
    slow_app = web.Application()
    slow_app.router.add_get("/health", slow)
    slow_server = await aiohttp_server(slow_app)
    async with aiohttp.ClientSession() as session:
        def client(url):
            return SGLangClient(url, session, 10)
        assert await client(str(server.make_url("")).rstrip("/")).health_problem() == "HTTP status 503"
        assert await client(f"http://127.0.0.1:{unused_tcp_port}").health_problem() == "connection refused"
        problem = await client(str(slow_server.make_url("")).rstrip("/")).health_problem(timeout_s=0.2)
        assert problem.startswith("timeout")


def test_repeated_warnings_are_written_once_per_interval_with_a_count():
    now = [0.0]
    limiter = RepeatFilter(10.0, clock=lambda: now[0])

    def record(msg, *args, level=logging.WARNING):
        return logging.LogRecord("token_proxy.x", level, __file__, 1, msg, args, None)

    passed = []
    for i in range(1000):  # an outage: every request fails within the same 10 s
        now[0] = i * 0.009
        rec = record("%s -> %d: %s", "/v1/completions", 503, "not connected")
        if limiter.filter(rec):
            passed.append(rec.getMessage())
    assert passed == ["/v1/completions -> 503: not connected"]
    now[0] = 20.0
    rec = record("%s -> %d: %s", "/v1/completions", 503, "not connected")
    assert limiter.filter(rec)
    assert rec.getMessage() == "/v1/completions -> 503: not connected [999 more like this in the last 10 s]"
    assert limiter.filter(record("another message"))
    assert all(limiter.filter(record("info %d", i, level=logging.INFO)) for i in range(5))  # INFO: never held


def test_help_groups_every_flag_with_its_default():
    result = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=False, timeout=30)
    text = result.stdout
    assert result.returncode == 0
    for title in ("serving:", "SGLang:", "limits:", "access:", "weights:", "logging and metrics:",
                  "simulator (only without --backend):"):
        assert f"\n{title}\n" in text
    assert "default ()" not in text and "Settings ->" not in text and "default None" not in text
    flags = [flag for _, group in FLAG_GROUPS for flag, *_ in group]
    assert len(re.findall(r"\[default: [^;]+; env TOKEN_PROXY_", " ".join(text.split()))) == len(flags)


def test_readme_table_lists_every_flag():
    table = [line for line in README.read_text().splitlines() if line.startswith("| `--")]
    listed = {flag for line in table for flag in re.findall(r"`(--[a-z-]+)`", line.split("|")[1])}
    flags = {flag for _, group in FLAG_GROUPS for flag, *_ in group}
    assert flags - listed == set()


@pytest.mark.skipif(sys.platform != "linux", reason="uvloop is a Linux dependency")
def test_the_server_runs_on_uvloop_where_it_is_installed(monkeypatch):
    loop = new_event_loop()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: asyncio's own loop
    loop = new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio.")
    finally:
        loop.close()
