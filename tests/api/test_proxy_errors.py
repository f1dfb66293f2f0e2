"""Every error path: the status, OpenAI's error body, and the parameter named."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request

import orjson
import pytest
from aiohttp import web

from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.testing import stream_events

USER = [{"role": "user", "content": "What is the capital of France?"}]


async def post_raw(client, data: bytes, path="/v1/chat/completions"):
    resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    return resp.status, orjson.loads(await resp.read())


async def post(client, body, path="/v1/chat/completions"):
    return await post_raw(client, orjson.dumps(body), path)


def assert_error(status, body, want_status, param=None, contains=None):
    assert status == want_status, body
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == want_status
    if param is not None:
        assert body["error"]["param"] == param
    if contains is not None:
        assert contains in body["error"]["message"]


@pytest.mark.parametrize("raw,param", [
    (b"{not json", "body"), (b"", "body"), (b"[1, 2]", "body"), (b'"text"', "body"),
    (b'{"messages": "\xff\xfe"}', "body"),
])
async def test_malformed_bodies_are_400(proxy, raw, param):
    status, body = await post_raw(proxy, raw)
    assert_error(status, body, 400, param)


@pytest.mark.parametrize("extra,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "oracle", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"n": 0}, "n"), ({"n": -3}, "n"), ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": "10"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": 1.5}, "top_k"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"use_beam_search": True}, "use_beam_search"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
])
async def test_validation_errors_name_the_parameter(proxy, sim, extra, param):
    before = len(sim.app[SIM_STATE].received)
    status, body = await post(proxy, {"messages": USER, **extra})
    assert_error(status, body, 400, param)
    assert len(sim.app[SIM_STATE].received) == before  # nothing reached SGLang


async def test_template_error_is_400(proxy):
    status, body = await post(proxy, {"messages": USER, "chat_template": "{{ raise_exception('no way') }}"})
    assert_error(status, body, 400, "messages", "no way")


async def test_prompt_longer_than_context_gets_vllms_message(proxy, sim):
    long = [{"role": "user", "content": "hello " * 5000}]
    status, body = await post(proxy, {"messages": long})
    assert_error(status, body, 400, "input_tokens", "This model's maximum context length is 4096 tokens. However, "
                                                    "your prompt contains 50")
    status, body = await post(proxy, {"messages": USER, "max_tokens": 5000})
    assert_error(status, body, 400, "max_tokens", "max_tokens=5000 cannot be greater than max_model_len=4096")
    assert len(sim.app[SIM_STATE].received) == 0
    # prompt + max_tokens past the context is clamped, as vLLM does
    status, body = await post(proxy, {"messages": USER, "max_tokens": 4090, "ignore_eos": True,
                                      "return_token_ids": True})
    assert status == 200
    assert sim.app[SIM_STATE].received[-1]["sampling_params"]["max_new_tokens"] == 4096 - 15


async def test_a_prompt_that_renders_to_nothing_is_refused_in_vllms_words(proxy, sim):
    """The built-in template renders no developer turn: no ids at all. vLLM's processor refuses an empty prompt;
    SGLang would answer "input_ids cannot be empty" (schemathesis' positive-data check found it)."""
    status, body = await post(proxy, {"messages": [{"role": "developer", "content": "9G"}, {"role": "developer"}],
                                      "add_generation_prompt": False})
    assert_error(status, body, 400, "input_tokens", "The decoder prompt cannot be empty")
    assert len(sim.app[SIM_STATE].received) == 0


async def test_prompt_past_sglangs_input_limit_is_refused_in_vllms_words(proxy, sim, hf_tokenizer):
    """SGLang refuses prompts of max_req_input_len (context - 6) tokens or more; so does the proxy."""
    assert len(hf_tokenizer.encode(" hello" * 10)) == 10
    empty = len(hf_tokenizer.encode(hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False)))
    msgs = [{"role": "user", "content": " hello" * (4092 - empty)}]  # a 4092-token prompt
    for stream in (False, True):
        status, body = await post(proxy, {"messages": msgs, "stream": stream})
        assert_error(status, body, 400, "input_tokens", "This model's maximum context length is 4096 tokens. "
                     "However, your prompt contains 4092 input tokens, which exceeds the engine's limit of 4089")
    assert sim.app[SIM_STATE].received == []


async def test_unknown_model_is_404(proxy):
    status, body = await post(proxy, {"model": "gpt-9", "messages": USER})
    assert_error(status, body, 404, "model", "gpt-9")


async def test_unknown_route_is_404_json(proxy):
    resp = await proxy.get("/v1/nothing")
    body = orjson.loads(await resp.read())
    assert_error(resp.status, body, 404)


async def test_backend_gone_is_503_and_health_follows(make_sim, make_proxy):
    sim = await make_sim()
    proxy = await make_proxy(sim)
    assert (await proxy.get("/health")).status == 200
    await sim.close()
    status, body = await post(proxy, {"messages": USER, "max_tokens": 2})
    assert_error(status, body, 503, contains="unreachable")
    resp = await proxy.get("/health")
    assert resp.status == 503


async def test_backend_crash_is_502_not_a_client_error(proxy, sim):
    sim.app[SIM_STATE].crashed = True
    status, body = await post(proxy, {"messages": USER, "max_tokens": 2})
    assert status in (502, 503), body
    assert body["error"]["code"] == status


async def test_timeout_is_504_and_aborts_upstream(make_sim, make_proxy):
    sim = await make_sim(ttft_s=5.0)
    proxy = await make_proxy(sim, request_timeout_s=0.3)
    status, body = await post(proxy, {"messages": USER, "max_tokens": 2})
    assert_error(status, body, 504)
    state = sim.app[SIM_STATE]
    for _ in range(100):
        if not state.running:
            break
        await asyncio.sleep(0.02)
    assert state.running == {}
    assert len(state.aborted) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts_the_sglang_request(make_sim, make_proxy, stream):
    sim = await make_sim(tpot_s=0.05)
    proxy = await make_proxy(sim)
    state = sim.app[SIM_STATE]
    body = {"messages": USER, "max_tokens": 500, "ignore_eos": True, "stream": stream}
    task = asyncio.ensure_future(proxy.post("/v1/chat/completions", data=orjson.dumps(body)))
    for _ in range(200):
        if state.running:
            break
        await asyncio.sleep(0.01)
    assert len(state.running) == 1
    rid = next(iter(state.running))
    if stream:
        resp = await task
        await resp.content.readany()
        resp.close()
    else:
        task.cancel()
    await proxy.session.close()
    for _ in range(200):
        if not state.running:
            break
        await asyncio.sleep(0.01)
    assert state.running == {}
    assert rid in state.aborted


async def _fake_backend(aiohttp_server, stream_events: list[bytes]):
    """A backend that streams the given raw SSE frames (for errors the simulator never makes)."""
    async def info(request):
        return web.json_response({"model_path": "fake", "tokenizer_path": "fake", "served_model_name": "fake",
                                  "incremental_streaming_output": True, "weight_version": "v0",
                                  "data": [{"id": "fake", "max_model_len": 4096}]})

    async def generate(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for frame in stream_events:
            await resp.write(frame)
        return resp

    async def healthy(request):
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", healthy)
    for path in ("/model_info", "/server_info", "/v1/models"):
        app.router.add_get(path, info)
    app.router.add_post("/generate", generate)
    return await aiohttp_server(app)


async def test_sglang_error_mid_stream_becomes_an_error_chunk_then_done(aiohttp_server, make_proxy):
    first = {"text": "a", "output_ids": [64], "meta_info": {"finish_reason": None, "completion_tokens": 1}}
    error = {"error": {"message": "scheduler exploded", "type": "internal", "code": 500}}
    backend = await _fake_backend(aiohttp_server, [b"data: " + orjson.dumps(first) + b"\n\n",
                                                   b"data: " + orjson.dumps(error) + b"\n\n", b"data: [DONE]\n\n"])
    proxy = await make_proxy(backend, served_model_name="fake")
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps({"messages": USER, "stream": True}))
    assert resp.status == 200
    last = stream_events(await resp.read())[-1]
    assert last["error"]["code"] == 502 and "scheduler exploded" in last["error"]["message"]


async def test_sglang_error_before_first_token_is_an_http_error(aiohttp_server, make_proxy):
    error = {"error": {"message": "The input (5000 tokens) is longer than the model's context length",
                       "code": 400}}
    backend = await _fake_backend(aiohttp_server, [b"data: " + orjson.dumps(error) + b"\n\n", b"data: [DONE]\n\n"])
    proxy = await make_proxy(backend, served_model_name="fake")
    status, body = await post(proxy, {"messages": USER, "stream": True})
    assert_error(status, body, 400, contains="longer than the model's context length")


async def test_sglang_scheduler_refusal_in_stream_is_an_http_error(aiohttp_server, make_proxy):
    """SGLang's scheduler refuses some inputs with an abort event carrying status_code 400."""
    refusal = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {
        "type": "abort", "message": "Input length (4092 tokens) exceeds the maximum allowed length (4090 tokens).",
        "status_code": 400, "err_type": "BadRequestError"}, "completion_tokens": 0}}
    backend = await _fake_backend(aiohttp_server, [b"data: " + orjson.dumps(refusal) + b"\n\n", b"data: [DONE]\n\n"])
    proxy = await make_proxy(backend, served_model_name="fake")
    status, body = await post(proxy, {"messages": USER, "stream": True})
    assert_error(status, body, 400, contains="exceeds the maximum allowed length (4090 tokens)")


async def test_stream_cut_short_by_sglang_ends_with_error_chunk(aiohttp_server, make_proxy):
    first = {"text": "a", "output_ids": [64], "meta_info": {"finish_reason": None, "completion_tokens": 1}}
    backend = await _fake_backend(aiohttp_server, [b"data: " + orjson.dumps(first) + b"\n\n"])
    proxy = await make_proxy(backend, served_model_name="fake")
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps({"messages": USER, "stream": True}))
    assert "before every choice finished" in stream_events(await resp.read())[-1]["error"]["message"]


async def _wait_until_idle(state):
    for _ in range(200):
        if not state.running:
            return
        await asyncio.sleep(0.02)


async def test_first_token_timeout_is_504_and_aborts(make_sim, make_proxy):
    sim = await make_sim(ttft_s=3.0)
    proxy = await make_proxy(sim, first_token_timeout_s=0.3)
    status, body = await post(proxy, {"messages": USER, "max_tokens": 2, "stream": True})
    assert_error(status, body, 504, contains="first-token limit of 0.3 s")
    state = sim.app[SIM_STATE]
    await _wait_until_idle(state)
    assert state.running == {} and len(state.aborted) == 1


async def test_stalled_stream_ends_with_a_timeout_chunk_and_is_aborted(make_sim, make_proxy):
    sim = await make_sim(tpot_s=3.0)
    proxy = await make_proxy(sim, stream_idle_timeout_s=0.3)
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(
        {"messages": USER, "max_tokens": 50, "ignore_eos": True, "stream": True}))
    assert resp.status == 200
    error = stream_events(await resp.read())[-1]["error"]
    assert error["code"] == 504 and "stalled" in error["message"]
    state = sim.app[SIM_STATE]
    await _wait_until_idle(state)
    assert state.running == {} and len(state.aborted) == 1


async def test_proxy_starts_without_sglang_and_connects_when_it_comes_up(aiohttp_server, tokenizer_dir,
                                                                          make_proxy, unused_tcp_port):
    from token_proxy.simulator import SimConfig, create_sim_app

    url = f"http://127.0.0.1:{unused_tcp_port}"
    proxy = await make_proxy(url, backend_wait_s=0.2)
    status, body = await post(proxy, {"messages": USER, "max_tokens": 2})
    assert_error(status, body, 503, contains="not connected to SGLang")
    assert (await proxy.get("/health")).status == 503
    assert (await proxy.get("/v1/models")).status == 503
    sim_app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir)))
    await aiohttp_server(sim_app, port=unused_tcp_port)
    for _ in range(100):  # the proxy's retry backoff is capped at 5 s
        status, body = await post(proxy, {"messages": USER, "max_tokens": 2})
        if status == 200:
            break
        await asyncio.sleep(0.1)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")
    assert (await proxy.get("/health")).status == 200


def _start_simulator_process(port: int, tokenizer_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "token_proxy.simulator", "--port", str(port), "--tokenizer",
                             str(tokenizer_dir), "--tpot-ms", "20"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60  # seconds when idle; a loaded 2-core machine took over 15 s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"simulator did not start (exit status {proc.poll()})")


async def test_sglang_killed_mid_request_then_restarted(tokenizer_dir, make_proxy, unused_tcp_port):
    """kill -9 mid-stream: the stream ends with an error chunk and [DONE]; new requests get 503;
    once SGLang is back, requests succeed with no proxy restart."""
    proc = await asyncio.to_thread(_start_simulator_process, unused_tcp_port, tokenizer_dir)
    try:
        proxy = await make_proxy(f"http://127.0.0.1:{unused_tcp_port}")
        in_flight = asyncio.ensure_future(proxy.post("/v1/chat/completions", data=orjson.dumps(
            {"messages": USER, "max_tokens": 500, "ignore_eos": True, "stream": True})))
        resp = await in_flight  # its headers: SGLang's first event has come (~10 s of tokens left)
        proc.kill()
        assert stream_events(await resp.read())[-1]["error"]["code"] == 503
        status, body = await post(proxy, {"messages": USER, "max_tokens": 2})
        assert_error(status, body, 503, contains="unreachable")
        assert (await proxy.get("/health")).status == 503
        proc = await asyncio.to_thread(_start_simulator_process, unused_tcp_port, tokenizer_dir)
        status, body = await post(proxy, {"messages": USER, "max_tokens": 2})
        assert status == 200
        assert (await proxy.get("/health")).status == 200
    finally:
        proc.kill()


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v1/chat/completions", "POST"),
    ("PUT", "/v1/completions", "POST"),
    ("GET", "/inference/v1/generate", "POST"),
    ("GET", "/tokenize", "POST"),
    ("POST", "/v1/models", "GET, HEAD"),
    ("DELETE", "/health", "GET, HEAD"),
])
async def test_wrong_method_on_a_known_route_is_405_with_allow(proxy, sim, method, path, allow):
    resp = await proxy.request(method, path)
    body = orjson.loads(await resp.read())
    assert_error(resp.status, body, 405, contains=path)
    assert resp.headers["Allow"] == allow
    assert body["error"]["type"] == "MethodNotAllowedError"
    assert sim.app[SIM_STATE].received == []  # never passed through to SGLang
