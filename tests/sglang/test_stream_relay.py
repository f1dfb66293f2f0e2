"""The stream reader of streamed /generate (sglang/relay.py): HTTP framing split at any byte, typed
errors, timeouts, flow control, and the same bytes to the client over http and https (TLS, coalescing)."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import orjson
import pytest

from token_proxy.errors import BackendError, BackendTimeout, BackendUnavailable, InvalidRequest
from token_proxy.sglang.payload import SGLangRequest
from token_proxy.sglang.relay import RelayStream, Target, relay_target

USER = [{"role": "user", "content": "What is the capital of France?"}]


class FakeTransport:
    def __init__(self):
        self.closed = False
        self.paused = False

    def close(self):
        self.closed = True

    def abort(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False


class Down:
    """A client that is blocked until `open()`."""

    def __init__(self, blocked=False):
        self._blocked = blocked
        self.drains = 0

    def blocked(self):
        return self._blocked

    async def drained(self):
        self.drains += 1
        self._blocked = False


def relay_stream(coalesce_s=0.0) -> tuple[RelayStream, FakeTransport]:
    stream = RelayStream(asyncio.get_running_loop(), "http://sglang", coalesce_s)
    transport = FakeTransport()
    stream.connection_made(transport)
    return stream, transport


def event(i: int, finish=None) -> dict:
    return {"text": f"t{i}", "output_ids": [i], "meta_info": {"id": "r", "finish_reason": finish}}


def chunked(body: bytes, size: int = 7, ext: bytes = b";ext=1") -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x%b\r\n%b\r\n" % (len(p), ext, p) for p in parts) + b"0\r\n\r\n"


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [event(0), event(1), event(2, {"type": "length", "length": 3})]
SSE = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in EVENTS) + b"data: [DONE]\n\n"


async def collect(stream: RelayStream, down=None) -> list[dict]:
    got = list(await stream.first() or [])
    seen = []

    def sink(events):
        seen.append(events)
        got.extend(events)
        return False

    await stream.relay(sink, down or Down())
    return got


@pytest.mark.parametrize("ext", [b";ext=1", b""])
@pytest.mark.parametrize("size", [7, 100, 100_000])
@pytest.mark.parametrize("piece", [1, 2, 3, 5, 64, 100_000])
async def test_events_come_out_whole_however_the_bytes_are_split(piece, size, ext):
    stream, _ = relay_stream()
    raw = b"HTTP/1.1 100 Continue\r\n\r\n" + HEAD_CHUNKED + chunked(SSE, size, ext)
    for i in range(0, len(raw), piece):
        stream.data_received(raw[i:i + piece])
    assert await collect(stream) == EVENTS
    await stream.aclose()


async def test_content_length_and_close_delimited_bodies():
    body = SSE.replace(b"data: [DONE]\n\n", b"")
    for head, tail in ((b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), None),
                       (b"HTTP/1.1 200 OK\r\n\r\n", "close")):
        stream, _ = relay_stream()
        stream.data_received(head + body)
        if tail:
            stream.connection_lost(None)
        assert await collect(stream) == EVENTS


async def test_sglang_refusing_the_request_is_a_typed_error():
    stream, transport = relay_stream()
    body = orjson.dumps({"error": {"message": "bad input_ids", "code": 400}})
    stream.data_received(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    with pytest.raises(InvalidRequest, match="SGLang rejected the request: bad input_ids"):
        await stream.first()
    assert transport.closed


async def test_in_stream_error_after_events_delivers_them_then_raises():
    stream, _ = relay_stream()
    error = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    first = b"data: " + orjson.dumps(event(0)) + b"\n\n"
    stream.data_received(HEAD_CHUNKED + chunked(first, 1000)[:-5])
    got = []
    assert await stream.first() == [event(0)]
    stream.data_received(chunked(b"data: " + orjson.dumps(event(1)) + b"\n\n" + error, 1000))
    with pytest.raises(BackendError, match="SGLang failed: boom"):
        await stream.relay(lambda events: got.extend(events) or False, Down())
    assert got == [event(1)]


async def test_a_connection_lost_mid_chunk_is_unavailable():
    stream, _ = relay_stream()
    stream.data_received(HEAD_CHUNKED + chunked(SSE, 1000)[:50])
    stream.connection_lost(ConnectionResetError("reset"))
    with pytest.raises(BackendUnavailable, match="SGLang closed the connection mid-response: reset"):
        await collect(stream)


@pytest.mark.parametrize("size", [b"zz", b"-5", b"zz;ext=1"])
async def test_a_bad_chunk_size_is_unavailable(size):
    stream, transport = relay_stream()
    stream.data_received(HEAD_CHUNKED + size + b"\r\n" + SSE)
    with pytest.raises(BackendUnavailable, match=f"bad chunk size {re.escape(repr(size))}"):
        await collect(stream)
    assert transport.closed


async def test_the_idle_limit_ends_a_stalled_stream():
    stream, transport = relay_stream()
    stream.start_timers(first_token_s=None, idle_s=0.05, total_s=None)
    stream.data_received(HEAD_CHUNKED + chunked(b"data: " + orjson.dumps(event(0)) + b"\n\n", 1000)[:-5])
    assert await stream.first() == [event(0)]
    with pytest.raises(BackendTimeout, match="SGLang stalled"):
        await asyncio.wait_for(stream.relay(lambda events: False, Down()), 2)
    assert transport.closed


async def test_a_slow_client_pauses_reading_sglang_until_it_drains():
    stream, transport = relay_stream()
    stream.data_received(HEAD_CHUNKED + chunked(b"data: " + orjson.dumps(event(0)) + b"\n\n", 1000)[:-5])
    await stream.first()
    down = Down(blocked=True)
    task = asyncio.ensure_future(stream.relay(lambda events: False, down))
    await asyncio.sleep(0)  # the relay waits for events
    stream.data_received(chunked(b"data: " + orjson.dumps(event(1)) + b"\n\n", 1000)[:-5])
    assert transport.paused and down.drains == 0
    await asyncio.sleep(0.01)
    assert not transport.paused and down.drains == 1
    stream.data_received(b"0\r\n\r\n")
    await asyncio.wait_for(task, 1)


def sse_chunk(i: int) -> bytes:
    return chunked(b"data: " + orjson.dumps(event(i)) + b"\n\n", 1000)[:-5]


async def test_coalescing_rests_the_connection_after_each_relayed_read_never_before_the_first():
    stream, transport = relay_stream(coalesce_s=0.03)
    stream.data_received(HEAD_CHUNKED + sse_chunk(0))
    assert not transport.paused  # the first batch (the first token) is never held
    assert await stream.first() == [event(0)]
    seen = []
    task = asyncio.ensure_future(stream.relay(lambda events: seen.append(events) or False, Down()))
    await asyncio.sleep(0)
    stream.data_received(sse_chunk(1))
    assert seen == [[event(1)]] and transport.paused  # relayed at once, then SGLang rests unread
    await asyncio.sleep(0.01)
    assert transport.paused
    await asyncio.sleep(0.04)
    assert not transport.paused
    stream.data_received(sse_chunk(2) + sse_chunk(3))  # what SGLang sent meanwhile: one read, one sink call
    assert seen[-1] == [event(2), event(3)]
    stream.data_received(b"0\r\n\r\n")
    await asyncio.wait_for(task, 1)
    await asyncio.sleep(0.05)
    assert transport.paused is True  # ended while resting: not read again


async def test_no_coalescing_rest_once_every_output_has_finished():
    stream, transport = relay_stream(coalesce_s=5.0)
    stream.data_received(HEAD_CHUNKED + sse_chunk(0))
    await stream.first()

    def sink(events):
        stream.ending()  # what the pipeline says when the last choice's finish event has been relayed
        return False

    task = asyncio.ensure_future(stream.relay(sink, Down()))
    await asyncio.sleep(0)
    stream.data_received(sse_chunk(1))
    assert not transport.paused  # SGLang's [DONE] and the body's end are read at once, not 5 s later
    stream.data_received(b"0\r\n\r\n")
    await asyncio.wait_for(task, 1)


async def test_a_drained_client_does_not_end_the_coalescing_rest_early():
    stream, transport = relay_stream(coalesce_s=0.05)
    stream.data_received(HEAD_CHUNKED + sse_chunk(0))
    await stream.first()
    down = Down(blocked=True)
    task = asyncio.ensure_future(stream.relay(lambda events: False, down))
    await asyncio.sleep(0)
    stream.data_received(sse_chunk(1))
    await asyncio.sleep(0.01)
    assert down.drains == 1 and transport.paused  # drained, but the rest still holds the reads
    await asyncio.sleep(0.06)
    assert not transport.paused
    stream.data_received(b"0\r\n\r\n")
    await asyncio.wait_for(task, 1)


async def test_coalescing_sends_the_same_bytes_in_fewer_writes(make_sim, make_proxy):
    sim = await make_sim(incremental_streaming_output=True, tpot_s=0.005)
    body = orjson.dumps({"messages": USER, "max_tokens": 40, "ignore_eos": True, "stream": True, "seed": 7,
                         "return_token_ids": True})

    async def stream(proxy) -> tuple[bytes, int]:
        resp = await proxy.post("/v1/chat/completions", data=body)
        assert resp.status == 200
        data, writes = b"", 0
        async for piece, end_of_chunk in resp.content.iter_chunks():
            data += piece
            writes += end_of_chunk  # one HTTP chunk per write of the proxy
        return re.sub(rb'"(id|created)":("[^"]*"|\d+)', b"", data), writes

    plain, _ = await stream(await make_proxy(sim))
    coalesced, writes = await stream(await make_proxy(sim, stream_coalesce_ms=40))
    assert coalesced == plain and plain.count(b"data: ") == 42  # 40 tokens + the final chunk + [DONE]
    assert writes <= 12  # 40 events 5 ms apart, read every 40 ms: ~6 reads (+ the first, the end)


def test_http_and_https_urls_are_both_relayed():
    assert relay_target("http://10.0.0.1:30000") == Target("10.0.0.1", 30000, "", tls=False)
    assert relay_target("http://sglang/prefix/") == Target("sglang", 80, "/prefix", tls=False)
    assert relay_target("https://sglang") == Target("sglang", 443, "", tls=True)
    with pytest.raises(BackendUnavailable, match="SGLang at ftp://sglang is unreachable: not an http"):
        relay_target("ftp://sglang")


@pytest.mark.parametrize("body", [
    {"messages": USER, "max_tokens": 40, "ignore_eos": True, "stream": True, "seed": 7, "return_token_ids": True,
     "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    {"messages": USER, "max_tokens": 30, "ignore_eos": True, "stream": True, "seed": 3, "n": 2, "logprobs": True,
     "top_logprobs": 2, "stop": ["e"]},
])
async def test_https_and_coalescing_send_the_bytes_plain_http_sends(make_sim, make_tls_sim, make_proxy, body):
    """Over TLS, and with --stream-coalesce-ms (which works for every URL), the client gets the same bytes."""
    async def stream_bytes(sim, **settings) -> list[bytes]:
        proxy = await make_proxy(sim, **settings)
        resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(body))
        assert resp.status == 200
        # ids and timestamps differ per request; everything else must be byte-identical
        return re.sub(rb'"(id|created)":("[^"]*"|\d+)', b"", await resp.read()).split(b"\n\n")

    plain = await stream_bytes(await make_sim(incremental_streaming_output=True, tpot_s=0.002))
    tls_sim = await make_tls_sim(incremental_streaming_output=True, tpot_s=0.002)
    assert str(tls_sim.make_url("")).startswith("https://")
    assert await stream_bytes(tls_sim) == plain
    async with aiohttp.ClientSession() as session, session.post(tls_sim.make_url("/flush_cache"), ssl=False) as resp:
        assert resp.status == 200  # the same prefix-cache state (cached_tokens) for the next request
    assert await stream_bytes(tls_sim, stream_coalesce_ms=20) == plain


@pytest.mark.parametrize("value", [-1, 1500])
def test_stream_coalesce_is_checked_at_start_up(value):
    from token_proxy.settings import Settings

    with pytest.raises(ValueError, match=r"--stream-coalesce-ms must be in 0\.\.1000 milliseconds"):
        Settings(stream_coalesce_ms=value)
    with pytest.raises(ValueError, match=r"--stream-coalesce-ms 500 must stay under --stream-idle-timeout \(0\.5 s\)"):
        Settings(stream_coalesce_ms=500, stream_idle_timeout_s=0.5)
    assert Settings(stream_coalesce_ms=500, stream_idle_timeout_s=0).stream_coalesce_ms == 500  # idle limit off


async def test_a_stream_closed_while_resting_is_not_read_again():
    stream, transport = relay_stream(coalesce_s=0.03)
    stream.data_received(HEAD_CHUNKED + sse_chunk(0))
    await stream.first()
    task = asyncio.ensure_future(stream.relay(lambda events: False, Down()))
    await asyncio.sleep(0)
    stream.data_received(sse_chunk(1))
    assert transport.paused
    task.cancel()  # the client left
    await stream.aclose()
    await asyncio.sleep(0.05)
    assert transport.paused and transport.closed  # the pause's timer was cancelled with the stream


async def test_an_https_sglang_whose_certificate_is_not_trusted_is_unreachable(make_tls_sim):
    """The relay verifies SGLang's certificate: a context that does not trust the test's CA (injected, as a
    deployment's own CA would be) refuses the stream before anything is sent."""
    import ssl

    from token_proxy.sglang import SGLangClient

    sim = await make_tls_sim()
    url = str(sim.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        client = SGLangClient(url, session, 10.0, ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
        with pytest.raises(BackendUnavailable, match=rf"^SGLang at {re.escape(url)} is unreachable: Cannot connect "
                                                     r"to host 127\.0\.0\.1:\d+ \[.*CERTIFICATE_VERIFY_FAILED"):
            await client.open_stream({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "stream": True})
        trusted = SGLangClient(url, session, 10.0)  # the default context: SSL_CERT_FILE names the test's CA
        stream, first = await trusted.start_stream(SGLangRequest({"input_ids": [1, 2], "stream": True,
                                                                  "sampling_params": {"max_new_tokens": 2}}, []))
        assert first[0]["meta_info"]["prompt_tokens"] == 2
        await stream.aclose()
