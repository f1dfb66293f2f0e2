"""The stream reader's parts: the SSE event decoder (sglang/events.py, what an event means: sglang/replies.py)
and the deadline (sglang/deadline.py); the same timeouts, with the same messages, over http and https."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from token_proxy.errors import BackendError, BackendTimeout
from token_proxy.sglang.deadline import IDLE_MESSAGE, Deadline
from token_proxy.sglang.events import DONE_EVENT, EventDecoder
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.testing import stream_events
from token_proxy.state import CONTEXT

USER = [{"role": "user", "content": "What is the capital of France?"}]


def decoder() -> EventDecoder:
    return EventDecoder()


def test_the_decoder_keeps_an_incomplete_event_for_the_next_read():
    d = decoder()
    assert d.feed(b'data: {"a": 1}\n\ndata: {"b"') == ([{"a": 1}], None)
    assert d.pending == b'data: {"b"'
    assert d.feed(b': 2}\n\n') == ([{"b": 2}], None)
    assert d.pending == b""


def test_the_decoder_ends_at_done_and_at_an_error_after_the_events_before_them():
    assert decoder().feed(b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"c": 3}\n\n') == ([{"a": 1}], DONE_EVENT)
    events, end = decoder().feed(b'data: {"a": 1}\n\ndata: {"error": {"message": "boom"}}\n\n')
    assert events == [{"a": 1}]
    assert isinstance(end, BackendError) and end.status == 502 and str(end) == "SGLang failed: boom"


def test_the_decoder_parses_an_unterminated_last_event_at_the_end():
    d = decoder()
    assert d.feed(b': comment\n\ndata: {"a": 1}') == ([], None)
    assert d.close() == ([{"a": 1}], None)
    assert d.close() == ([], None)


async def test_a_deadline_builds_its_error_only_when_a_limit_is_hit():
    loop = asyncio.get_running_loop()
    hit: list[BaseException] = []
    deadline = Deadline(loop, 0.05, None, hit.append)
    deadline.first_done()
    await asyncio.sleep(0.1)
    assert hit == []  # the first output came in time: no error was made
    deadline.cancel()

    deadline = Deadline(loop, 0.05, None, hit.append)
    await asyncio.sleep(0.1)
    assert [str(e) for e in hit] == ["SGLang sent no output within the first-token limit of 0.05 s"]


async def test_a_paused_reader_is_not_idle_and_a_waiting_one_is():
    loop = asyncio.get_running_loop()
    hit: list[BaseException] = []
    deadline = Deadline(loop, None, 0.05, hit.append)
    deadline.pause()
    await asyncio.sleep(0.12)
    assert hit == []
    deadline.touch()
    await asyncio.sleep(0.12)
    assert [(type(e), str(e)) for e in hit] == [(BackendTimeout, IDLE_MESSAGE)]


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
async def test_a_stream_times_out_the_first_token_over_http_and_https(make_sim, make_tls_sim, make_proxy, tls):
    sim = await (make_tls_sim if tls else make_sim)(ttft_s=3.0)
    proxy = await make_proxy(sim, first_token_timeout_s=0.3)
    assert proxy.app[CONTEXT].client.base_url.startswith("https://" if tls else "http://")
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(
        {"messages": USER, "max_tokens": 2, "stream": True}))
    assert resp.status == 504
    assert (await resp.json())["error"]["message"] == "SGLang sent no output within the first-token limit of 0.3 s"
    await _aborted_once(sim)


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
async def test_a_stalled_stream_ends_alike_over_http_and_https(make_sim, make_tls_sim, make_proxy, tls):
    sim = await (make_tls_sim if tls else make_sim)(tpot_s=3.0)
    proxy = await make_proxy(sim, stream_idle_timeout_s=0.3)
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(
        {"messages": USER, "max_tokens": 50, "ignore_eos": True, "stream": True}))
    assert resp.status == 200
    error = stream_events(await resp.read())[-1]["error"]
    assert (error["code"], error["message"]) == (504, IDLE_MESSAGE)
    await _aborted_once(sim)


async def _aborted_once(sim) -> None:
    state = sim.app[SIM_STATE]
    for _ in range(200):
        if not state.running:
            break
        await asyncio.sleep(0.02)
    assert state.running == {} and len(state.aborted) == 1
