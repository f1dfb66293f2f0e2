"""Start-up mistakes a vLLM/SGLang user makes, each answered in one line naming the fix (issue 23):
flag errors without the usage screen (JSON in JSON log mode), --backend URLs that name a route or no
port, a negative --backend-wait, an empty tokenizer directory, a hub tokenizer that cannot be fetched
(/health blames the tokenizer, its retry lines once each), SGLang lost and back, shutdown, and the
switch that turns the access line off."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from aiohttp import web

from tests.support.admin_fixtures import free_port
from tests.support.stderr_lines import StderrLines
from token_proxy.cli import parse_settings
from token_proxy.sglang.discovery import health_hint

CLI = [sys.executable, "-m", "token_proxy.cli"]
# The bound on a process's start-up (seconds when idle; a loaded 2-core machine has taken over 20 s).
STARTUP_S = 60.0


def _run(args: list[str], log_format: str = "json", timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKEN_PROXY_LOG_FORMAT": log_format}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, check=False, timeout=timeout, env=env)


async def _poll(read, done, timeout: float = STARTUP_S):
    """`read()` (a value or an awaitable) again every 20 ms until `done(value)`, for at most `timeout` seconds;
    the last value either way (the caller's assertion on it says what was wrong)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        value = await value if inspect.isawaitable(value) else value
        if done(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]  # raises on any line that is not JSON


def _get(port: int, path: str) -> tuple[int | None, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return None, b""


# --- flag errors -----------------------------------------------------------------------------------

def test_a_flag_error_is_one_line_naming_the_flag_and_help():
    result = _run(["--port", "x"], log_format="text")
    assert result.returncode == 2
    assert result.stderr == "token-proxy: error: argument --port: invalid int value: 'x' (see token-proxy --help)\n"


def test_a_flag_error_is_a_json_line_in_json_log_mode():
    result = _run(["--bogus-flag", "1"])
    assert result.returncode == 2
    (line,) = _json_lines(result.stderr)
    assert (line["level"], line["logger"], line["message"]) == (
        "error", "token_proxy", "token-proxy: error: unrecognized arguments: --bogus-flag 1 (see token-proxy --help)")
    # --log-format on the command line decides too, whatever the environment says
    flag = _run(["--log-format=json", "--port", "x"], log_format="text")
    assert _json_lines(flag.stderr)[0]["message"].startswith("token-proxy: error: argument --port")


def test_a_negative_backend_wait_is_refused():
    result = _run(["--backend", "http://127.0.0.1:30000", "--backend-wait", "-5"], log_format="text")
    assert result.returncode == 2
    assert result.stderr == ("token-proxy: error: --backend-wait must be >= 0 seconds, got -5 "
                             "(see token-proxy --help)\n")


# --- --backend ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "root"), [
    ("http://host:30000/generate", "http://host:30000"),
    ("http://host:30000/v1/chat/completions", "http://host:30000"),
    ("https://gw/sglang/health/", "https://gw/sglang"),
])
def test_a_backend_url_naming_an_sglang_route_is_refused(given, root, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--backend", given], environ={})
    assert exit_info.value.code == 2
    route = "/" + given.rstrip("/").split("/", 3)[3].removeprefix("sglang/")
    assert capsys.readouterr().err == (f"token-proxy: error: --backend {given!r} names SGLang's {route} route, "
                                       f"not the server: pass its root, --backend {root} (see token-proxy --help)\n")


def test_a_backend_url_without_a_port_warns_naming_30000_as_json():
    """Port 80 is used (a reverse proxy may be there) but said, in the configured format: the warning
    comes before logging is configured and is written once it is."""
    with socket.socket() as busy:  # start-up then ends at the port, after the warning
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run(["--backend", "http://sglang-host", "--host", "127.0.0.1", "--port", str(port)])
    assert result.returncode == 2
    warning, error = _json_lines(result.stderr)
    assert (warning["level"], warning["message"]) == (
        "warning", ("--backend 'http://sglang-host' names no port: using port 80 (SGLang listens on 30000 unless "
                   "started with --port; write http://sglang-host:30000 if that is where it is)"))
    assert error["level"] == "error" and f"127.0.0.1:{port}" in error["message"]
    assert parse_settings(["--backend", "https://sglang.example.com"], environ={}).backend_url == \
        "https://sglang.example.com"  # https on 443: an ingress, no warning needed


def test_health_hints_name_the_backend_url():
    assert health_hint("HTTP status 404", "http://h:30000/prefix") == (
        "HTTP status 404 for http://h:30000/prefix/health: no SGLang at this address (--backend must be SGLang's "
        "root URL, e.g. http://HOST:30000, without a route such as /generate)")
    assert health_hint("connection refused", "http://h") == (
        "connection refused on port 80 (--backend http://h names no port; SGLang listens on 30000 unless "
        "started with --port)")
    assert health_hint("connection refused", "http://h:30000") == "connection refused"
    assert health_hint("HTTP status 503", "http://h:30000") == "HTTP status 503"


async def test_health_names_the_url_when_the_backend_is_not_sglang(aiohttp_server, aiohttp_client, tokenizer_dir):
    from token_proxy.app import create_app
    from token_proxy.settings import Settings

    server = await aiohttp_server(web.Application())  # answers 404 to everything, /health included
    url = str(server.make_url("/prefix"))
    proxy = await aiohttp_client(create_app(Settings(backend_url=url, tokenizer=str(tokenizer_dir),
                                                     backend_metrics_interval_s=0)))
    async def health_message() -> str:
        return (await (await proxy.get("/health")).json())["error"]["message"]

    message = await _poll(health_message, lambda message: "404" in message)
    assert message == (f"The proxy is not connected to SGLang at {url} yet: its /health: HTTP status 404 for "
                       f"{url}/health: no SGLang at this address (--backend must be SGLang's root URL, e.g. "
                       "http://HOST:30000, without a route such as /generate)")


# --- the tokenizer -----------------------------------------------------------------------------------

def test_an_empty_tokenizer_directory_is_refused_naming_the_model_directory(tmp_path):
    result = _run(["--tokenizer", str(tmp_path), "--backend", "http://127.0.0.1:1", "--port", str(free_port())])
    assert result.returncode == 2
    (line,) = _json_lines(result.stderr)
    assert line["message"] == (f"token-proxy cannot start: the tokenizer directory '{tmp_path}' holds no tokenizer "
                               "(no tokenizer.json, tokenizer_config.json or tokenizer.model): pass --tokenizer "
                               "with the model's directory (the one SGLang's --model-path names)")
    assert "sentencepiece" not in result.stderr


def _start_sim(port: int) -> subprocess.Popen:
    sim = subprocess.Popen([sys.executable, "-m", "token_proxy.simulator", "--port", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_S
    while _get(port, "/health")[0] != 200:
        assert sim.poll() is None, "the simulator exited"
        if time.monotonic() > deadline:
            sim.kill()
            raise AssertionError(f"the simulator was not healthy within {STARTUP_S:g} s")
        time.sleep(0.05)
    return sim


def test_an_unreachable_hub_tokenizer_is_blamed_and_its_retries_print_once(tmp_path):
    """SGLang (the simulator) is up; the hub is not (HF_ENDPOINT: a closed loopback port). /health names
    the tokenizer, not SGLang; huggingface_hub's retry lines come out once each, as JSON."""
    sim_port, port, hub = free_port(), free_port(), free_port()
    sim = _start_sim(sim_port)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path), HF_ENDPOINT=f"http://127.0.0.1:{hub}", TOKEN_PROXY_LOG_FORMAT="json")
    proc = subprocess.Popen([*CLI, "--backend", f"http://127.0.0.1:{sim_port}", "--tokenizer", "acme/no-such-model",
                             "--host", "127.0.0.1", "--port", str(port), "--backend-metrics-interval", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    err = StderrLines(proc)
    try:
        message, deadline = "", time.monotonic() + STARTUP_S
        while "tokenizer" not in message:
            assert proc.poll() is None and time.monotonic() < deadline, err.text[-3000:]
            status, body = _get(port, "/health")
            message = json.loads(body)["error"]["message"] if status == 503 else ""
            time.sleep(0.05)
        assert message == (f"The proxy is loading the tokenizer 'acme/no-such-model' (SGLang at http://127.0.0.1:"
                           f"{sim_port} is up): a Hugging Face hub id, downloaded unless cached (HF_HOME); with no "
                           "network, mount the model directory and pass --tokenizer DIR")
        # huggingface_hub retries after 1 s, then 2 s: its second retry line, however slow the machine is
        err.wait_for(lambda line: "[Retry 2/5]" in line, timeout=STARTUP_S)
    finally:
        proc.kill()
        sim.kill()
        sim.wait(timeout=30)
    lines = _json_lines(err.wait_eof(timeout=30))
    retries = [line["message"] for line in lines if "[Retry " in line["message"]]
    assert retries[:2] == ["Retrying in 1s [Retry 1/5].", "Retrying in 2s [Retry 2/5]."]
    assert {line["logger"] for line in lines if "[Retry " in line["message"]} == {"huggingface_hub.utils._http"}


# --- SGLang lost and back, shutdown, the access line ----------------------------------------------------

async def test_losing_sglang_and_getting_it_back_are_logged_once_each(make_sim, make_proxy, aiohttp_server, caplog,
                                                                       tokenizer_dir):
    from token_proxy.simulator import SimConfig, create_sim_app

    sim = await make_sim()
    proxy = await make_proxy(sim, backend_metrics_interval_s=0.05)
    url = str(sim.make_url("")).rstrip("/")
    caplog.set_level(logging.INFO, logger="token_proxy")

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "token_proxy.sglang.discovery"
                and r.getMessage().startswith(("lost SGLang", "SGLang at"))]

    async def until(predicate):
        assert await _poll(predicate, bool), lines()

    port = sim.port
    await sim.close()
    await until(lambda: any(line.startswith("lost SGLang") for line in lines()))
    await asyncio.sleep(0.3)  # several failed reads: still one line
    (lost,) = lines()
    assert re.fullmatch(rf"lost SGLang: SGLang at {url} is unreachable: .+ \(requests get 503 until it "
                        r"answers again\)", lost), lost
    back = await aiohttp_server(create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir))), port=port)
    await until(lambda: len(lines()) == 2)
    assert re.fullmatch(rf"SGLang at {url} answers again \(after \d+ s unreachable\)", lines()[1]), lines()
    assert back.port == port and proxy.app is not None


def _dead_backend_run(tmp_path, *flags: str) -> list[dict]:
    """The proxy in front of a closed port for a moment: one /v1/models (503, logged), then SIGTERM."""
    port = free_port()
    proc = subprocess.Popen([*CLI, "--backend", f"http://127.0.0.1:{free_port()}", "--host", "127.0.0.1",
                             "--port", str(port), "--log-format", "json", "--backend-metrics-interval", "0.05",
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + STARTUP_S
        while b"connection refused" not in _get(port, "/v1/models")[1]:
            assert proc.poll() is None and time.monotonic() < deadline, "no 503 naming the closed port in time"
            time.sleep(0.05)
        time.sleep(0.3)  # several /metrics reads of the closed port
    finally:
        proc.terminate()
        stderr = proc.communicate(timeout=20)[1].decode()
    assert proc.returncode == 0, stderr
    return _json_lines(stderr)


def test_a_closed_backend_port_logs_no_metrics_hint_and_shutdown_is_one_line(tmp_path):
    lines = _dead_backend_run(tmp_path)
    messages = [line.get("message", "") for line in lines]
    assert not [m for m in messages if "--enable-metrics" in m or "/metrics" in m], messages
    assert messages[-1] == ("token-proxy shutting down: not accepting; 0 requests in flight get up to 30 s "
                            "(--shutdown-timeout)")
    access = [line for line in lines if "request_id" in line]
    assert [(a["path"], a["status"]) for a in access] and access[-1]["status"] == 503


@pytest.mark.parametrize("flag", ["--disable-log-requests", "--disable-uvicorn-access-log"])
def test_the_access_line_can_be_turned_off(tmp_path, flag):
    lines = _dead_backend_run(tmp_path, flag)
    assert not [line for line in lines if "request_id" in line]
    assert any(line.get("message", "").startswith("token-proxy listening") for line in lines)
    assert parse_settings([flag], environ={}).disable_log_requests is True
    assert parse_settings([], environ={"TOKEN_PROXY_DISABLE_LOG_REQUESTS": "true"}).disable_log_requests is True


async def test_a_tokenizer_path_sglang_reports_but_this_host_lacks_names_the_mount(aiohttp_server, aiohttp_client):
    """issue 31: SGLang's tokenizer_path was a directory of its own container; the proxy logged it as a
    "hub id" with transformers' "Repo id must be ..." error. Now one line says what to mount."""
    from aiohttp import web

    from token_proxy.app import create_app
    from token_proxy.settings import Settings
    from token_proxy.sglang.discovery import CONNECTION

    info = {"model_path": "/models/Qwen2.5-0.5B", "tokenizer_path": "/models/Qwen2.5-0.5B", "weight_version": "default"}

    async def answer(request):
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})
        return web.json_response(info if "model_info" in request.path else {"version": "0.5.17"})

    fake = web.Application()
    for path in ("/health", "/model_info", "/server_info", "/v1/models"):
        fake.router.add_get(path, answer)
    server = await aiohttp_server(fake)
    app = create_app(Settings(backend_url=str(server.make_url("")).rstrip("/"), backend_wait_s=5.0))
    client = await aiohttp_client(app)
    await _poll(lambda: app[CONNECTION].fatal, bool)
    assert app[CONNECTION].fatal == (
        "SGLang reports its tokenizer at '/models/Qwen2.5-0.5B', which does not exist where the proxy runs (another "
        "container or host): mount that directory at the same path (docker run -v /models:/models:ro, or a compose "
        "volume), or pass --tokenizer with a local copy or the model's Hugging Face id")
    response = await client.get("/health")
    assert response.status == 503 and "/models:/models:ro" in (await response.json())["error"]["message"]


NGINX_404 = b"""<html>
<head><title>404 Not Found</title></head>
<body>
<center><h1>404 Not Found</h1></center>
<hr><center>nginx/1.25.3</center>
</body>
</html>
<!-- a padding comment -->
<!-- a padding comment -->
<!-- a padding comment -->
<!-- a padding comment -->
<!-- a padding comment -->
<!-- a padding comment -->
"""


def test_an_html_page_is_one_line_naming_its_title():
    from token_proxy.sglang.replies import error_from_status

    error = error_from_status(404, NGINX_404)
    assert error.message == ("SGLang failed with HTTP 404: an HTML page titled '404 Not Found', not SGLang's JSON "
                             "(is this URL SGLang's?)")
    # JSON is no HTML page: FastAPI's `detail` is quoted as SGLang's words (replies.message_of, the one reader
    # the admin fan-out uses too; it quoted the raw JSON before the two readers were merged)
    assert error_from_status(404, b'{"detail": "Not Found"}').message == "SGLang failed with HTTP 404: Not Found"


async def test_a_metrics_page_that_is_not_sglangs_is_logged_in_one_line(aiohttp_server, aiohttp_client, tokenizer_dir,
                                                                        caplog):
    """issue 31: a backend that is not SGLang made the metrics reader log a 13-line HTML page plus the
    --enable-metrics hint."""
    from token_proxy.app import create_app
    from token_proxy.settings import Settings

    async def answer(request):
        if request.path == "/metrics":
            return web.Response(status=404, body=NGINX_404, content_type="text/html")
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})
        return web.json_response({"model_path": "m", "tokenizer_path": str(tokenizer_dir), "version": "0.5.17",
                                  "incremental_streaming_output": True})

    fake = web.Application()
    for path in ("/health", "/model_info", "/server_info", "/v1/models", "/metrics"):
        fake.router.add_get(path, answer)
    server = await aiohttp_server(fake)
    caplog.set_level(logging.WARNING, logger="token_proxy.ops.backend_scrape")
    await aiohttp_client(create_app(Settings(backend_url=str(server.make_url("")).rstrip("/"),
                                             tokenizer=str(tokenizer_dir), backend_metrics_interval_s=0.05)))
    lines = await _poll(lambda: [r.getMessage() for r in caplog.records if "/metrics" in r.getMessage()], bool)
    assert lines == [("cannot read SGLang's /metrics: SGLang failed with HTTP 404: an HTML page titled '404 Not Found', "
                      "not SGLang's JSON (is this URL SGLang's?); the vllm: view goes stale")]
