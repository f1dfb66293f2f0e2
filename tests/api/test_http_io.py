"""http_io's request side: a body that is already in is read without a loop turn (every request's
critical path); one still arriving keeps its deadline (tests/api/test_fuzz.py: the 408)."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp import streams
from aiohttp.test_utils import make_mocked_request

from token_proxy.errors import InvalidRequest
from token_proxy.http_io import read_json


def _request(body: bytes, complete: bool):
    protocol = mock.Mock(_reading_paused=False)
    content = streams.StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())
    content.feed_data(body)
    if complete:
        content.feed_eof()
    return make_mocked_request("POST", "/v1/chat/completions", headers={"Content-Length": str(len(body))},
                               payload=content)


async def test_a_complete_body_is_read_without_yielding_to_the_loop():
    coro = read_json(_request(b'{"messages": [], "max_tokens": 3}', complete=True))
    with pytest.raises(StopIteration) as done:  # finished on its first step: no task, no loop turn
        coro.send(None)
    assert done.value.value == {"messages": [], "max_tokens": 3}


async def test_a_complete_but_bad_body_is_still_a_400_naming_body():
    with pytest.raises(InvalidRequest) as err:
        await read_json(_request(b"[1, 2]", complete=True))
    assert (err.value.status, err.value.param, err.value.message) == (
        400, "body", "The request body must be a JSON object")


async def test_a_body_still_arriving_is_awaited_and_read_whole():
    request = _request(b'{"max_tokens": ', complete=False)
    reading = asyncio.ensure_future(read_json(request))
    await asyncio.sleep(0.01)
    assert not reading.done()
    request.content.feed_data(b"5}")
    request.content.feed_eof()
    assert await asyncio.wait_for(reading, 1.0) == {"max_tokens": 5}
