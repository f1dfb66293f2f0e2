"""`token-proxy --workers 2` as real processes, with the built-in simulator (started once).

One proxy serves the whole module (start-up is the slow part); the SIGTERM test comes last and ends it.
Every request opens a fresh connection, so the kernel's SO_REUSEPORT hash spreads them over workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from tokenizers import Tokenizer

from tests.support.admin_fixtures import free_port
from tests.support.bench_modules import load_bench_module
from tests.support.lora_fixtures import write_adapter

USER = [{"role": "user", "content": "hi"}]
SPREAD = 16  # requests per check: all on one of 2 workers has odds 2 x 2^-16
children = load_bench_module("cpu_groups").children  # pid -> command line of each child


class Proxy:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def lines(self) -> list[str]:
        """Whole lines only: a line a worker is writing right now is not read half-way."""
        text = self.log.read_text()
        return text[:text.rfind("\n") + 1].splitlines()

    def access(self) -> list[dict]:
        return [line for line in map(json.loads, self.lines()) if "endpoint" in line and "request_id" in line]

    def workers_of(self, request_ids, wait: float = 5.0) -> set[int]:
        """The workers that served these requests, from their access lines. A worker writes the line
        after the response's last byte, so a client can hold the whole reply first: wait for every line."""
        wanted = set(request_ids)
        deadline = time.monotonic() + wait
        while True:
            found = {line["request_id"]: line["worker"] for line in self.access() if line["request_id"] in wanted}
            if len(found) == len(wanted) or time.monotonic() > deadline:
                assert set(found) == wanted, f"no access line for {sorted(wanted - set(found))}"
                return set(found.values())
            time.sleep(0.05)

    @property
    def sim_url(self) -> str:
        for line in self.lines():
            found = re.search(r"starting the built-in SGLang simulator on (127\.0\.0\.1:\d+)", line)
            if found:
                return "http://" + found.group(1)
        raise AssertionError("no simulator line")


async def call(method: str, url: str, **kwargs) -> tuple[int, dict | str]:
    """One request on its own connection."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
            session.request(method, url, timeout=aiohttp.ClientTimeout(total=30), **kwargs) as resp:
        text = await resp.text()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


async def chat(proxy: Proxy, model: str | None = None, max_tokens: int = 3, **extra) -> dict:
    body = {"messages": USER, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    if model:
        body["model"] = model
    status, reply = await call("POST", proxy.url + "/v1/chat/completions", json=body)
    assert status == 200, reply
    return reply


async def stream(proxy: Proxy, tokens: int, model: str | None = None, **extra) -> tuple[str, bytes]:
    body = {"messages": USER, "max_tokens": tokens, "ignore_eos": True, "stream": True, **extra}
    if model:
        body["model"] = model
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
            session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        return resp.headers["X-Request-Id"], await resp.read()


def error_events(raw: bytes) -> list[dict]:
    """The stream's error events ({"error": {...}}, what the proxy sends in place of the next chunk). Parsed,
    not searched for b'"error"': that is also a chunk whose text is the token "error" ("content":"error")."""
    events = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return [event for event in events if "error" in event]


@pytest.fixture(scope="module")
def proxy(tokenizer_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("workers") / "stderr.log"
    with open(log, "ab") as sink:  # O_APPEND: every process's whole-line writes land whole
        proc = subprocess.Popen([sys.executable, "-m", "token_proxy", "--workers", "2", "--host", "127.0.0.1",
                                 "--port", str(port), "--tokenizer", str(tokenizer_dir), "--sim-tpot-ms", "20",
                                 "--log-format", "json", "--shutdown-timeout", "10",
                                 "--backend-metrics-interval", "0.5"],
                                stdout=sink, stderr=sink)
    server = Proxy(proc, f"http://127.0.0.1:{port}", log)
    wait_until_serving(proc, server, log)
    yield server
    stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM first: a killed supervisor would leave the simulator behind."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until_serving(proc: subprocess.Popen, server: Proxy, log, deadline_s: float = 90) -> None:
    """Every serving process ready: 8 fresh connections in a row answer the readiness probe, /health (200 only
    once the admin owner is connected too, so an owner row such as ART's rename is served)."""
    deadline = time.monotonic() + deadline_s
    ready = 0
    while ready < 8:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            status, _ = asyncio.run(call("GET", server.url + "/health"))
        except (aiohttp.ClientError, OSError):
            status = 0
        ready = ready + 1 if status == 200 else 0
        if status != 200:
            time.sleep(0.2)


def test_a_busy_port_fails_at_once_even_for_another_workers_proxy(proxy):
    port = proxy.url.rsplit(":", 1)[1]
    done = subprocess.run([sys.executable, "-m", "token_proxy", "--workers", "2", "--host", "127.0.0.1",
                           "--port", port, "--backend", "http://127.0.0.1:9"], capture_output=True, timeout=30,
                          check=False)
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr.decode()


def test_the_simulator_starts_once_and_two_workers_serve(proxy):
    kids = list(children(proxy.proc.pid).values())
    assert len([k for k in kids if "-m token_proxy.simulator" in k]) == 1, kids
    assert len([k for k in kids if "-m token_proxy.serving.process" in k]) == 2, kids


async def test_requests_spread_over_both_workers_and_metrics_count_each_once(proxy):
    ids = []
    for _ in range(SPREAD):
        status, reply = await call("POST", proxy.url + "/v1/completions",
                                   json={"prompt": "hello", "max_tokens": 2, "ignore_eos": True})
        assert status == 200, reply
        ids.append(reply["id"])
        model = reply["model"]
    assert proxy.workers_of(ids) == {0, 1}
    await asyncio.sleep(1.0)  # one backend scrape (0.5 s) for the vllm: view
    for _ in range(6):  # whichever worker answers: one total, every family once
        status, text = await call("GET", proxy.url + "/metrics")
        assert status == 200
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        key = 'token_proxy_requests_total{endpoint="/v1/completions",status="200",stream="false"}'
        assert float(samples[key]) == SPREAD
        assert float(samples['token_proxy_completion_tokens_total{endpoint="/v1/completions"}']) == 2 * SPREAD
        types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types)), "a family is rendered twice"
        # vLLM's per-request families come from the workers (each request once), not the owner's block
        (length,) = [v for k, v in samples.items()
                     if k.startswith("vllm:request_success_total{") and 'finished_reason="length"' in k]
        assert float(length) == SPREAD
        # every finish reason at 0 from start-up, under the served model's name, in each worker
        for reason in ("stop", "abort", "error", "repetition"):
            key = f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{model}"}}'
            assert float(samples[key]) == 0.0, key
        names = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"]
        for once in ("vllm:num_requests_running", "vllm:num_requests_waiting", "process_cpu_seconds_total",
                     "token_proxy_backend_metrics_up"):
            assert names.count(once) == 1, once
        assert float(samples['token_proxy_backend_metrics_up']) == 1.0


async def test_metrics_negotiate_openmetrics_and_gzip_with_the_owners_block(proxy):
    """Issue 31: a worker's page (its merged files plus the owner's text block) in OpenMetrics, gzipped."""
    import gzip

    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    headers = {"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"}
    for _ in range(4):  # whichever worker answers
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), auto_decompress=False) \
                as session, session.get(proxy.url + "/metrics", headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
            assert resp.headers["Content-Encoding"] == "gzip"
            text = gzip.decompress(await resp.read()).decode()
        assert text.count("# EOF") == 1 and text.endswith("# EOF\n")
        names = {family.name for family in text_string_to_metric_families(text)}
        assert {"token_proxy_requests", "vllm:request_success", "vllm:request_prompt_tokens",  # the workers'
                "vllm:num_requests_running", "token_proxy_backend_metrics_up"} <= names  # the owner's block


async def test_session_metrics_are_one_total_across_workers(proxy):
    """The session store is per worker (a turn on another worker falls back to a full render); its
    collector's counters are mirrored into the multiprocess files, so /metrics sums them."""
    for n in range(SPREAD):
        status, reply = await call("POST", proxy.url + "/v1/chat/completions", headers={"X-Session-ID": f"s{n}"},
                                   json={"messages": USER, "max_tokens": 2, "ignore_eos": True})
        assert status == 200, reply
    await asyncio.sleep(1.5)  # every worker's mirror interval (1 s)
    for _ in range(4):
        _, text = await call("GET", proxy.url + "/metrics")
        samples = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("token_proxy_session_")]
        turns = sum(float(v) for k, v in samples if k.startswith(("token_proxy_session_hits_total",
                                                                 "token_proxy_session_fallbacks_total")))
        assert turns == SPREAD, samples
        assert float(dict(samples)["token_proxy_session_active"]) == SPREAD


async def test_pause_through_one_worker_holds_requests_on_every_worker(proxy):
    status, reply = await call("POST", proxy.url + "/pause")
    assert (status, reply) == (200, {"status": "paused"})
    try:
        for _ in range(6):  # the owner's state, whichever worker asks
            assert await call("GET", proxy.url + "/is_paused") == (200, {"is_paused": True})
        held = [asyncio.ensure_future(chat(proxy)) for _ in range(SPREAD)]
        await asyncio.sleep(1.0)
        assert not any(task.done() for task in held)  # SGLang (the simulator) holds them
    finally:
        status, reply = await call("POST", proxy.url + "/resume")
        assert (status, reply) == (200, {"status": "resumed"})
    replies = await asyncio.wait_for(asyncio.gather(*held), 30)
    assert proxy.workers_of(r["id"] for r in replies) == {0, 1}
    assert await call("GET", proxy.url + "/is_paused") == (200, {"is_paused": False})


async def test_the_owners_internal_routes_are_not_reachable_through_a_worker(proxy):
    for _ in range(4):
        status, reply = await call("POST", proxy.url + "/_internal/adapters",
                                   json={"process": 0, "seq": 10**9, "seen": 0, "held": []})
        assert status == 404, reply
        assert reply["error"]["type"] == "NotFoundError"


async def test_lora_loaded_through_one_worker_is_sampled_through_both(proxy, tmp_path):
    status, reply = await call("POST", proxy.url + "/v1/load_lora_adapter",
                               json={"lora_name": "policy", "lora_path": str(write_adapter(tmp_path, "step_1"))})
    assert status == 200, reply
    replies = []
    for _ in range(SPREAD):  # a worker learns the map from the owner's long-poll reply
        replies.append(await chat(proxy, "policy"))
    assert {r["model"] for r in replies} == {"policy"}
    assert proxy.workers_of(r["id"] for r in replies) == {0, 1}
    for _ in range(4):
        status, models = await call("GET", proxy.url + "/v1/models")
        assert [card["id"] for card in models["data"]][1:] == ["policy"]


async def test_a_load_or_unload_answered_is_what_every_worker_serves_at_once(proxy, tmp_path):
    """issue 31: right after a 200 load, /v1/models on some worker missed the adapter 15 times in 60; after an
    unload it still listed it 11 times, and a chat naming it got a 200. The owner now answers only once every
    worker applied the new map."""
    path = str(write_adapter(tmp_path, "flip"))
    for _ in range(12):
        status, reply = await call("POST", proxy.url + "/v1/load_lora_adapter", json={"lora_name": "flip", "lora_path": path})
        assert status == 200, reply
        for _ in range(2):  # fresh connections: either worker
            status, models = await call("GET", proxy.url + "/v1/models")
            assert "flip" in [card["id"] for card in models["data"]]
        status, reply = await call("POST", proxy.url + "/v1/unload_lora_adapter", json={"lora_name": "flip"})
        assert status == 200, reply
        for _ in range(2):
            status, models = await call("GET", proxy.url + "/v1/models")
            assert "flip" not in [card["id"] for card in models["data"]]
            status, reply = await call("POST", proxy.url + "/v1/chat/completions",
                                       json={"model": "flip", "messages": USER, "max_tokens": 2})
            assert status == 404, reply


async def sim_adapters(proxy: Proxy) -> set[str]:
    status, models = await call("GET", proxy.sim_url + "/v1/models")
    assert status == 200
    return {card["id"] for card in models["data"]}


async def test_a_stream_whose_text_is_the_word_error_has_no_error_event(proxy, tokenizer_dir):
    """The reload test below once failed on a healthy stream: the simulator samples the token "error" about
    once in 10^5 tokens (~2% of that test's 16 x 120), and its chunk held b'"error"'. Forced here."""
    error_id = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id("error")
    _, raw = await stream(proxy, 3, logit_bias={str(error_id): 100})
    assert raw.count(b'"content":"error"') == 3  # what a search for b'"error"' took for an error event
    assert raw.endswith(b"data: [DONE]\n\n") and error_events(raw) == []
    assert error_events(b'data: {"error": {"message": "m", "code": 500}}\n\ndata: [DONE]\n\n') == [
        {"error": {"message": "m", "code": 500}}]


async def test_a_reloaded_adapter_stays_in_sglang_until_every_worker_is_done_with_it(proxy, tmp_path):
    status, reply = await call("POST", proxy.url + "/v1/load_lora_adapter",
                               json={"lora_name": "actor", "lora_path": str(write_adapter(tmp_path, "a1"))})
    assert status == 200, reply
    assert "actor@v1" in await sim_adapters(proxy)
    await chat(proxy, "actor")
    # Streams on v1 on both workers (~2.4 s each; SPREAD of them, so both workers get some), then an
    # in-place reload to v2 through some worker.
    streams = [asyncio.ensure_future(stream(proxy, 120, "actor")) for _ in range(SPREAD)]
    await asyncio.sleep(0.4)
    status, reply = await call("POST", proxy.url + "/load_lora_adapter",
                               json={"lora_name": "actor", "lora_path": str(write_adapter(tmp_path, "a2"))})
    assert status == 200, reply
    assert (await chat(proxy, "actor"))["model"] == "actor"
    await asyncio.sleep(0.3)
    assert not all(task.done() for task in streams)
    assert {"actor@v1", "actor@v2"} <= await sim_adapters(proxy)  # v1 still leased by a worker
    results = await asyncio.wait_for(asyncio.gather(*streams), 30)
    for rid, raw in results:  # the whole error event (if any) and the stream's end, not a cut repr
        assert raw.endswith(b"data: [DONE]\n\n") and not error_events(raw), \
            f"{rid}: {error_events(raw)} ... {raw[-300:]!r}"
    assert proxy.workers_of(rid for rid, _ in results) == {0, 1}
    for _ in range(50):  # the last release reaches the owner, which unloads v1
        if "actor@v1" not in await sim_adapters(proxy):
            break
        await asyncio.sleep(0.1)
    assert "actor@v1" not in await sim_adapters(proxy)
    assert "actor@v2" in await sim_adapters(proxy)


async def test_no_worker_process_returns_a_reply_on_weights_the_fleet_left(proxy, tmp_path):
    """Issue 28: the fleet's version lives in the owner; both data-plane processes check every reply
    against it (mirrored). Rollouts in flight when SGLang drifts to another version behind the proxy's
    back are sent again (the last line) and the owner's fence pauses, heals (from the fleet's checkpoint)
    and resumes the worker: every reply carries the fleet's version 7."""
    step = tmp_path / "step_7"
    step.mkdir()
    (step / "model.safetensors").write_bytes(b"\0")
    assert await call("POST", proxy.url + "/update_weights", json={"weight_dir": str(step)}) == (
        200, {"status": "ok", "weight_version": "7"})
    rollouts = [asyncio.ensure_future(chat(proxy, max_tokens=20)) for _ in range(SPREAD)]
    await asyncio.sleep(0.15)  # on their way (20 ms a token)
    status, _ = await call("POST", proxy.sim_url + "/update_weight_version",
                           json={"new_version": "rogue", "abort_all_requests": False})
    assert status == 200
    replies = await asyncio.wait_for(asyncio.gather(*rollouts), 60)
    assert [[v["version"] for v in r["choices"][0]["weight_versions"]] for r in replies] == [["7"]] * SPREAD
    assert proxy.workers_of(r["id"] for r in replies) == {0, 1}
    deadline = time.monotonic() + 10
    while True:  # the fence counts the heal just after it resumes the worker
        status, text = await call("GET", proxy.url + "/metrics")
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        events = (samples['token_proxy_fence_events_total{event="fenced"}'],
                  samples['token_proxy_fence_events_total{event="healed"}'])
        if events == ("1.0", "1.0") or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert events == ("1.0", "1.0")
    assert float(samples['token_proxy_stale_replies_total{endpoint="/v1/chat/completions"}']) >= 1
    assert (await call("GET", proxy.sim_url + "/model_info"))[1]["weight_version"] == "7"


def test_every_log_line_is_one_whole_json_object(proxy):
    lines = proxy.lines()
    assert len(proxy.access()) >= 3 * SPREAD
    for line in lines:
        assert isinstance(json.loads(line), dict), line


async def test_sigterm_drains_streams_on_every_worker_then_exits_zero(proxy):
    kids = children(proxy.proc.pid)
    assert len(kids) == 3
    # ~3 s of tokens each; 16 fresh connections, spread by the kernel's SO_REUSEPORT hash, all land on one
    # worker with odds 2**-15 (with 8 it was 2**-7: seen once in a run). SIGTERM only once SGLang runs all 16:
    # a connection still in a worker's accept queue when it stops listening is reset by the kernel (a fixed
    # 0.4 s wait let one be, on a loaded 2-core box: "Can not write request body").
    streams = [asyncio.ensure_future(stream(proxy, 150)) for _ in range(16)]
    deadline = time.monotonic() + 20
    while (running := await asyncio.to_thread(sim_running, proxy.sim_url)) != 16:
        assert time.monotonic() < deadline and not any(task.done() for task in streams), running
        await asyncio.sleep(0.05)
    proxy.proc.send_signal(signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*streams), 30)
    for _, raw in results:
        assert raw.endswith(b"data: [DONE]\n\n")
        assert raw.count(b'"finish_reason":"length"') == 1
    assert proxy.workers_of(rid for rid, _ in results) == {0, 1}
    assert await asyncio.to_thread(proxy.proc.wait, 30) == 0
    assert not [pid for pid in kids if Path(f"/proc/{pid}").exists()]  # workers and simulator ended
    with pytest.raises((aiohttp.ClientError, OSError)):
        await call("GET", proxy.url + "/health")
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"token-proxy-{proxy.proc.pid}-*"))  # run dir


def sim_running(sim: str) -> int:
    """How many requests the simulator (SGLang 0.5.17's /get_load) runs now."""
    with urllib.request.urlopen(sim + "/get_load", timeout=2) as resp:
        return sum(item["num_reqs"] for item in json.load(resp))


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_a_killed_worker_is_started_again_and_joins_the_port_only_once_ready(tokenizer_dir, tmp_path):
    """Under a loop of requests on fresh connections, a killed worker's successor takes none before it can
    serve: no reply is a 503 (before: "The proxy is loading the tokenizer ..." or "... not connected to
    SGLang yet" for each connection the kernel gave it during its start-up), and it serves once ready."""
    port = free_port()
    log = tmp_path / "stderr.log"
    with open(log, "ab") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "token_proxy", "--workers", "2", "--host", "127.0.0.1",
                                 "--port", str(port), "--tokenizer", str(tokenizer_dir), "--log-format", "json"],
                                stdout=sink, stderr=sink)
    proxy = Proxy(proc, f"http://127.0.0.1:{port}", log)

    def reply() -> tuple[int, dict | str]:
        try:
            return asyncio.run(call("POST", f"http://127.0.0.1:{port}/v1/completions",
                                    json={"prompt": "hi", "max_tokens": 2}))
        except (aiohttp.ClientError, OSError) as exc:
            return 0, repr(exc)

    def worker_one() -> int | None:
        return next((pid for pid, cmd in children(proc.pid).items()
                     if "token_proxy.serving.process" in cmd and cmd.split()[-1] == "1"), None)

    def served_by_worker_one_since(lines: int) -> int:
        return sum(1 for line in proxy.access()[lines:] if line["worker"] == 1 and line["status"] == 200)

    try:
        deadline = time.monotonic() + 60
        while len(children(proc.pid)) < 3 or [reply()[0] for _ in range(8)] != [200] * 8:  # both serve
            assert proc.poll() is None and time.monotonic() < deadline, (
                "not serving on both workers within 60 s: " + log.read_text()[-2000:])
            time.sleep(0.2)
        killed = worker_one()
        before = len(proxy.access())
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while alive(killed):  # until its socket is closed (a connection it held then is reset: that is the kill)
            assert time.monotonic() < deadline, f"pid {killed} still alive 30 s after SIGKILL"
            time.sleep(0.01)
        replies = []
        deadline = time.monotonic() + 60
        # Until the new worker 1 has served 4 requests: it is listening, and the kernel spreads over both.
        while served_by_worker_one_since(before) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"{len(replies)} replies in 60 s, none from a new worker 1: " + log.read_text()[-2000:])
            replies.append(reply())
        again = worker_one()
        assert again not in (None, killed)
        assert [(status, body) for status, body in replies if status not in (0, 200)] == []  # no 503 at all
        # One connection may be reset around the restart (most runs, on a loaded 2-core machine: the new worker
        # was not accepting it; a retry helps, unlike a 503 that says the proxy cannot serve). Main: 93 of ~250
        # replies were not 200 (20+ of them the start-up 503s).
        assert len([body for status, body in replies if status == 0]) <= 1, replies[:3]
        assert len(replies) >= 8
        errors = [line["message"] for line in map(json.loads, log.read_text().splitlines())
                  if line.get("level") == "error"]
        assert errors == [(f"worker 1 (pid {killed}) exited with status -9: started again as pid {again} "
                           "(its requests in flight were cut)")]
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        stop(proc)
