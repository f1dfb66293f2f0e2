"""The two readers of a streamed /generate (the callback relay and aiohttp's path) share one SSE event decoder
(sglang/events.py) and one deadline helper (sglang/deadline.py): the same events and the same timeouts, with
the same messages, whichever reads the stream."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from token_proxy.errors import BackendError, BackendTimeout
from token_proxy.sglang import client as client_module
from token_proxy.sglang.deadline import IDLE_MESSAGE, Deadline
from token_proxy.sglang.events import DONE_EVENT, EventDecoder
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.testing import stream_events
from token_proxy.state import CONTEXT

USER = [{"role": "user", "content": "What is the capital of France?"}]


def decoder() -> EventDecoder:
    return EventDecoder(client_module._parse_event)


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


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "aiohttp"])
async def test_both_readers_time_out_the_first_token_alike(make_sim, make_proxy, relay):
    sim = await make_sim(ttft_s=3.0)
    proxy = await make_proxy(sim, first_token_timeout_s=0.3)
    proxy.app[CONTEXT].client.callback_streams = relay
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(
        {"messages": USER, "max_tokens": 2, "stream": True}))
    assert resp.status == 504
    assert (await resp.json())["error"]["message"] == "SGLang sent no output within the first-token limit of 0.3 s"
    await _aborted_once(sim)


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "aiohttp"])
async def test_both_readers_end_a_stalled_stream_alike(make_sim, make_proxy, relay):
    sim = await make_sim(tpot_s=3.0)
    proxy = await make_proxy(sim, stream_idle_timeout_s=0.3)
    proxy.app[CONTEXT].client.callback_streams = relay
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
