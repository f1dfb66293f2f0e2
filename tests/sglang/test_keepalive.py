"""SGLang's keep-alive close (issue 20): the simulator closes idle connections as uvicorn does, late,
losing a request that arrives in that window; the proxy keeps its pool under that time and sends a
request once more when its reused connection was closed before any answer."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.support.raw_http import RawHTTPServer
from token_proxy.errors import BackendUnavailable
from token_proxy.ops import METRICS
from token_proxy.settings import Settings
from token_proxy.sglang import SGLangClient
from token_proxy.sglang.payload import SGLangRequest
from token_proxy.sglang.pool import ReplyPool, ReuseAwareConnector
from token_proxy.sglang.retry_rules import stale_reason
from token_proxy.simulator.keep_alive import KEEP_ALIVE

# The simulated SGLANG_TIMEOUT_KEEP_ALIVE (5 s on a real server), scaled down. The pool's bound under it
# (0.6 of it) leaves the proxy 0.4 s for reading a reply after the simulator wrote it (the two clocks of a
# connection's idle time start that far apart): at 0.5 s, 0.2 s of a stalled event loop on a loaded 2-core
# box (two pytest-xdist workers) let one request meet a close.
KEEP_ALIVE_S = 1.0
LATE_S = 2.0  # every close runs this late: a request sent in between is lost
GAP_S = 1.4  # the trainer's idle gap: past the keep-alive, inside the late close
BURST = 12


class _Latest:
    """The lateness draw, pinned at its maximum: every idle close runs LATE_S late."""

    def uniform(self, low: float, high: float) -> float:
        return high


async def _late_sim(make_sim):
    sim = await make_sim(keep_alive_s=KEEP_ALIVE_S, keep_alive_late_s=LATE_S)
    sim.app[KEEP_ALIVE].rng = _Latest()
    return sim


# --- the simulator ----------------------------------------------------------------------------------

async def test_simulator_closes_an_idle_connection_after_its_keep_alive(make_sim):
    sim = await make_sim(keep_alive_s=0.2, keep_alive_late_s=0.0)
    idle = sim.app[KEEP_ALIVE]
    async with aiohttp.ClientSession() as session:
        async with session.get(sim.make_url("/health")) as resp:
            assert resp.status == 200
        await asyncio.sleep(0.5)
        assert (idle.closed, idle.dropped) == (1, 0)
        async with session.get(sim.make_url("/health")) as resp:  # the pool saw the close: a new connection
            assert resp.status == 200
    assert (idle.closed, idle.dropped) == (1, 0)


async def test_simulator_loses_a_request_that_meets_its_late_close(make_sim):
    sim = await _late_sim(make_sim)
    async with aiohttp.ClientSession() as session:
        async with session.get(sim.make_url("/health")) as resp:
            assert resp.status == 200
        await asyncio.sleep(GAP_S)
        with pytest.raises(aiohttp.ServerDisconnectedError):  # a POST: aiohttp resends only idempotent methods
            async with session.post(sim.make_url("/flush_cache")):
                pass
    assert (sim.app[KEEP_ALIVE].closed, sim.app[KEEP_ALIVE].dropped) == (0, 1)


# --- the proxy: burst -> idle -> burst ------------------------------------------------------------

def _chat(i: int) -> dict:
    return {"model": "sim/qwen2-tiny", "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 4, "temperature": 0, "return_token_ids": True}


async def _burst(proxy) -> list[tuple[int, object]]:
    async def one(i: int):
        async with proxy.post("/v1/chat/completions", json=_chat(i)) as resp:
            body = await resp.json()
            return resp.status, body.get("choices", [{}])[0].get("token_ids") if resp.status == 200 else body

    async def admin(method: str, path: str, body: dict | None = None):
        async with proxy.request(method, path, json=body) as resp:
            return resp.status, await resp.read()

    # Admin calls (a forward, a fan-out) with the chats: each takes one of the idle connections.
    return list(await asyncio.gather(*(one(i) for i in range(BURST)), admin("GET", "/get_server_info"),
                                     admin("POST", "/update_weight_version", {"new_version": "v1"})))


def _retries(proxy) -> dict[str, float]:
    metric = proxy.app[METRICS].upstream_retries
    return {reason: metric.labels(reason)._value.get() for reason in ("disconnected", "reset")}


async def _rhythm(make_sim, make_proxy, **proxy_settings):
    sim = await _late_sim(make_sim)
    proxy = await make_proxy(sim, backend_metrics_interval_s=0, lora_sync_interval_s=0, **proxy_settings)
    first = await _burst(proxy)
    await asyncio.sleep(GAP_S)
    second = await _burst(proxy)
    return sim, proxy, first, second


def _failed(replies) -> list:
    return [(status, body) for status, body in replies if status != 200 or body is None]


async def test_rhythm_loses_nothing_when_the_pool_outlives_the_backend_keep_alive(make_sim, make_proxy):
    """The proxy's pool keeps connections longer than SGLang (today's 60 s against 5 s): the second
    burst meets closes in flight; each such request is sent once more on a fresh connection."""
    sim, proxy, first, second = await _rhythm(make_sim, make_proxy, backend_keepalive_s=30.0)
    assert _failed(first) == [] and _failed(second) == []
    # The second burst's POSTs that took an idle connection met its close and were sent once more (a
    # GET is resent by aiohttp itself, through the pool, uncounted): every drop was answered after all.
    retries = _retries(proxy)
    assert retries["disconnected"] >= 1 and retries["reset"] == 0
    assert sim.app[KEEP_ALIVE].dropped >= retries["disconnected"]


async def test_rhythm_pool_under_the_backend_keep_alive_needs_no_retry(make_sim, make_proxy):
    sim, proxy, first, second = await _rhythm(make_sim, make_proxy, backend_keepalive_s=KEEP_ALIVE_S * 0.6)
    assert _failed(first) == [] and _failed(second) == []
    assert sim.app[KEEP_ALIVE].dropped == 0
    assert _retries(proxy) == {"disconnected": 0.0, "reset": 0.0}


# --- the retry rule -------------------------------------------------------------------------------

class _Scripted(RawHTTPServer):
    """`plan[(connection, request)]` says what each request gets, "ok" (a 200, kept alive), "drop" (closed
    unanswered) or "half" (headers, part of the body, then closed)."""

    def __init__(self, plan: dict, default: str = "ok"):
        super().__init__()
        self.plan, self.default, self.requests = plan, default, []

    async def answer(self, conn: int, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        action = self.plan.get((conn, n), self.default)
        self.requests.append((conn, n, action))
        if action == "drop":
            return False
        if action == "half":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
            return False
        if action in ("streamed", "half_stream"):  # a streamed /generate, whole or broken before its first event
            body = (b'data: {"text": "hi", "output_ids": [1], "meta_info": {"id": "r", "finish_reason": '
                    b'{"type": "length", "length": 1}}}\n\ndata: [DONE]\n\n')
            cut = body if action == "streamed" else body[:12]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), cut))
            await writer.drain()
            return False
        if action == "generated":  # a whole /generate reply
            body = b'{"text": "hi", "output_ids": [1, 2], "meta_info": {"id": "r"}}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return True


async def _scripted(plan: dict, default: str = "ok"):
    server = _Scripted(plan, default)
    listener, url = await server.start()
    return server, listener, f"{url}/x"


async def _sessions():
    return (aiohttp.ClientSession(connector=ReuseAwareConnector(limit=0, keepalive_timeout=30)),
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)))


def _client(url: str, pooled, fresh, retried: list, keepalive_s: float = 30.0) -> SGLangClient:
    return SGLangClient(url.rsplit("/", 1)[0], pooled, 10.0, fresh=fresh, on_retry=retried.append,
                        replies=ReplyPool(keepalive_s))


async def _control_call(client: SGLangClient) -> tuple[int, bytes]:
    status, body, _ = await client.call("POST", "/x", b"{}", 10.0)
    return status, body


GENERATED = [{"text": "hi", "output_ids": [1, 2], "meta_info": {"id": "r"}}]


@pytest.mark.parametrize("path", ["control", "whole reply"])
async def test_a_reused_connection_closed_before_the_answer_is_sent_again_on_a_fresh_one(path):
    """Both pools: aiohttp's (control calls) and the kept-alive one of whole /generate replies (sglang/pool.py)."""
    whole = path == "whole reply"
    server, listener, url = await _scripted({(0, 1): "drop"}, default="generated" if whole else "ok")
    pooled, fresh = await _sessions()
    retried: list[str] = []
    async with listener, pooled, fresh:
        client = _client(url, pooled, fresh, retried)
        for _ in range(2):
            if whole:
                assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == GENERATED
            else:
                assert await _control_call(client) == (200, b"ok")
    assert retried == ["disconnected"]
    action = "generated" if whole else "ok"
    assert server.requests == [(0, 0, action), (0, 1, "drop"), (1, 0, action)]


@pytest.mark.parametrize("path", ["control", "whole reply"])
async def test_a_new_connection_closed_before_the_answer_is_not_sent_again(path):
    server, listener, url = await _scripted({(0, 0): "drop"})
    pooled, fresh = await _sessions()
    retried: list[str] = []
    async with listener, pooled, fresh:
        client = _client(url, pooled, fresh, retried)
        call = client.generate(SGLangRequest({"input_ids": [1]}, [])) if path == "whole reply" else _control_call(client)
        with pytest.raises(BackendUnavailable, match=r"is unreachable: Server disconnected"):
            await call
    assert retried == []
    assert server.requests == [(0, 0, "drop")]


async def test_nothing_is_sent_again_once_the_answer_began():
    """A control call (no broken-reply rule) whose answer began on a reused connection is not sent again."""
    server, listener, url = await _scripted({(0, 1): "half"})
    pooled, fresh = await _sessions()
    retried: list[str] = []
    async with listener, pooled, fresh:
        client = _client(url, pooled, fresh, retried)
        assert await _control_call(client) == (200, b"ok")
        with pytest.raises(BackendUnavailable, match="Response payload is not completed"):
            await _control_call(client)
    assert retried == []
    assert server.requests == [(0, 0, "ok"), (0, 1, "half")]


async def test_a_whole_reply_broken_off_mid_body_is_generated_again_once():
    """A worker behind sglang-router killed mid-reply (the GPU fleet round: one non-streamed rollout got a 503):
    a /generate whose body broke off is sent again, once, and counted as broken_reply; other calls are not."""
    # the retry's new connection joins the kept-alive pool: the second call's first try goes out on it
    server, listener, url = await _scripted({(0, 0): "half", (1, 1): "half", (2, 0): "half"}, default="generated")
    pooled, fresh = await _sessions()
    retried: list[str] = []
    async with listener, pooled, fresh:
        client = SGLangClient(url.rsplit("/", 1)[0], pooled, 10.0, fresh=fresh, on_retry=retried.append)
        assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [{"text": "hi", "output_ids": [1, 2], "meta_info": {"id": "r"}}]
        assert retried == ["broken_reply"]
        with pytest.raises(BackendUnavailable, match="closed the connection mid-response"):
            await client.generate(SGLangRequest({"input_ids": [1]}, []))  # broken twice: the second is the client's to see
        assert retried == ["broken_reply", "broken_reply"]
    assert [action for _, _, action in server.requests] == ["half", "generated", "half", "half"]


async def test_a_stream_broken_before_its_first_event_is_opened_again_once():
    server, listener, url = await _scripted({(0, 0): "half_stream", (1, 0): "streamed"})
    pooled, fresh = await _sessions()
    retried: list[str] = []
    async with listener, pooled, fresh:
        client = SGLangClient(url.rsplit("/", 1)[0], pooled, 10.0, fresh=fresh, on_retry=retried.append)
        stream, first = await client.start_stream(SGLangRequest({"input_ids": [1], "stream": True}, []))
        await stream.aclose()
        assert [event["output_ids"] for event in first] == [[1]]
    assert retried == ["broken_reply"]
    assert [action for _, _, action in server.requests] == ["half_stream", "streamed"]


@pytest.mark.parametrize(("exc", "reason"), [
    (aiohttp.ServerDisconnectedError(), "disconnected"),
    (aiohttp.ClientOSError(104, "Connection reset by peer"), "reset"),
    (aiohttp.ClientConnectionResetError("Cannot write to closing transport"), "reset"),
    (aiohttp.ClientOSError(32, "Broken pipe"), "reset"),
    (aiohttp.ClientOSError(113, "No route to host"), None),
    (aiohttp.ClientPayloadError("Response payload is not completed"), None),
    (aiohttp.ServerTimeoutError("Timeout on reading data from socket"), None),
])
def test_stale_reason(exc, reason):
    assert stale_reason(exc) == reason


@pytest.mark.parametrize("value", [0, -1, 4000])
def test_backend_keepalive_is_checked_at_start_up(value):
    with pytest.raises(ValueError, match=r"--backend-keepalive must be in \(0, 3600\] seconds"):
        Settings(backend_keepalive_s=value)


def test_backend_keepalive_default_is_under_sglangs_five_seconds():
    assert Settings().backend_keepalive_s == 4.0


# --- both hops of a request go out unbuffered -------------------------------------------------------

def _nodelay(transport) -> int:
    import socket

    return transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


async def test_both_connections_of_a_request_send_without_nagle(proxy):
    """A request's small writes (SGLang's answer, the client's reply) must not wait for an ACK: Nagle
    plus delayed ACK would add up to 40 ms on loopback. aiohttp and asyncio set TCP_NODELAY on every side
    today; this pins it on the client's connection to the proxy and the kept-alive and pooled ones to SGLang."""
    from token_proxy.state import CONTEXT

    async with proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 1}) as resp:
        assert resp.status == 200
        await resp.read()
    served = [handler.transport for handler in proxy.server.runner.server.connections]
    client = proxy.app[CONTEXT].client
    pooled = [proto.transport for conns in client._session.connector._conns.values() for proto, _ in conns]
    kept = [conn.transport for conns in client._replies._idle.values() for conn in conns]  # the chat's /generate
    assert len(served) == 1 and len(kept) == 1  # start-up's discovery calls hold aiohttp's pooled ones
    assert [_nodelay(t) for t in served + kept + pooled] == [1] * (2 + len(pooled))
