"""Whole /generate replies on the kept-alive pool of the project's own HTTP/1.1 connections (sglang/pool.py):
SGLang's keep-alive bound, the lost-adapter rule, TLS, time limits, and connections that must not be reused.
(The stale-connection rule, the broken reply and the key: tests/sglang/test_keepalive.py and
tests/sglang/test_generate_request.py, on the same pool.)"""

from __future__ import annotations

import asyncio
import re
import ssl

import orjson
import pytest

from tests.support.raw_http import RawHTTPServer
from token_proxy.errors import BackendTimeout, BackendUnavailable
from token_proxy.sglang import SGLangClient
from token_proxy.sglang.payload import SGLangRequest
from token_proxy.sglang.pool import ReplyPool

REPLY = {"text": "hi", "output_ids": [1, 2], "meta_info": {"id": "r"}}
LOST = b'{"error": {"message": "The following requested LoRA adapters are not loaded: policy@v1", "code": 400}}'


class Server(RawHTTPServer):
    """Each request gets `answers.pop(0)` (default: REPLY, kept alive), an answer being (status, body, extra
    header lines, then close?). It records (connection, request) and, as every raw server does, when each
    connection closed."""

    def __init__(self, answers: list | None = None):
        super().__init__()
        self.answers = answers or []
        self.requests: list[tuple[int, int]] = []

    async def answer(self, conn: int, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        self.requests.append((conn, n))
        status, body, extra, close = self.answers.pop(0) if self.answers else (200, orjson.dumps(REPLY), b"", False)
        if status is None:  # never answer: wait for the client to close
            await asyncio.wait_for(reader.read(1), 10)
            return False
        writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%b\r\n%b" % (status, len(body), extra, body))
        await writer.drain()
        return not close


async def serving(answers: list | None = None):
    server = Server(answers)
    listener, url = await server.start()
    return server, listener, url


def client_of(url: str, keepalive_s: float = 30.0, timeout_s: float = 10.0, **kwargs) -> SGLangClient:
    return SGLangClient(url, None, timeout_s, replies=ReplyPool(keepalive_s), **kwargs)


async def test_calls_in_a_row_share_one_connection():
    server, listener, url = await serving()
    async with listener:
        client = client_of(url)
        for _ in range(3):
            assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]
        client._replies.close()
    assert server.requests == [(0, 0), (0, 1), (0, 2)]


async def test_an_idle_connection_is_closed_at_the_keep_alive_bound_and_never_written_on_after():
    """SGLang's 5 s bound, scaled: a connection idle for `keepalive_s` is closed by the pool (before SGLang would)
    and the next call opens a new one; one idle for less is reused."""
    server, listener, url = await serving()
    async with listener:
        client = client_of(url, keepalive_s=0.3)
        assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]
        await asyncio.sleep(0.1)
        assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]  # idle 0.1 s: reused
        await asyncio.sleep(0.5)
        assert server.closed == [0]  # the pool's sweep closed it, unasked
        assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]
        client._replies.close()
    assert server.requests == [(0, 0), (0, 1), (1, 0)]


async def test_a_connection_past_the_bound_is_not_taken_even_before_the_sweep():
    pool = ReplyPool(keepalive_s=0.2)
    server, listener, url = await serving()
    async with listener:
        client = SGLangClient(url, None, 10.0, replies=pool)
        assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]
        pool._sweep.cancel()  # the sweep is late (a busy loop): the take still refuses the old connection
        pool._sweep = None
        await asyncio.sleep(0.3)
        assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]
        pool.close()
    assert server.requests == [(0, 0), (1, 0)]


async def test_an_answer_that_closes_its_connection_is_not_reused():
    server, listener, url = await serving([(200, orjson.dumps(REPLY), b"Connection: close\r\n", True)])
    async with listener:
        client = client_of(url)
        for _ in range(2):
            assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]
        client._replies.close()
    assert server.requests == [(0, 0), (1, 0)]


async def test_a_lost_adapter_is_reloaded_and_the_call_sent_again():
    class Reload:
        calls = 0

        async def resync(self) -> None:
            Reload.calls += 1

    server, listener, url = await serving([(400, LOST, b"", False)])
    async with listener:
        client = client_of(url)
        assert await client.generate(SGLangRequest({"input_ids": [1], "lora_path": "policy@v1"}, [], reload=Reload())) == [REPLY]
        client._replies.close()
    assert (Reload.calls, server.requests) == (1, [(0, 0), (1, 0)])  # the retry's on a new connection


async def test_an_sglang_error_is_typed_and_keeps_the_connection():
    server, listener, url = await serving([(400, LOST, b"", False)])
    async with listener:
        client = client_of(url)
        with pytest.raises(Exception, match="not loaded") as refused:
            await client.generate(SGLangRequest({"input_ids": [1]}, []))  # no reload: the lost-adapter rule does not apply
        assert refused.value.status == 400
        assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]
        client._replies.close()
    assert server.requests == [(0, 0), (0, 1)]


async def test_a_reply_past_the_request_timeout_is_a_504_and_its_connection_closed():
    server, listener, url = await serving([(None, b"", b"", False)])
    async with listener:
        client = client_of(url, timeout_s=0.2)
        with pytest.raises(BackendTimeout, match="did not finish the request in time"):
            await client.generate(SGLangRequest({"input_ids": [1]}, []))
        await asyncio.sleep(0.05)
        assert server.closed == [0]
        assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]
        client._replies.close()
    assert server.requests == [(0, 0), (1, 0)]


async def test_a_call_cancelled_while_waiting_closes_its_connection():
    """The client left: the handler is cancelled; the connection, with an answer still due, is never reused."""
    server, listener, url = await serving([(None, b"", b"", False)])
    async with listener:
        client = client_of(url)
        task = asyncio.ensure_future(client.generate(SGLangRequest({"input_ids": [1]}, [])))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert server.closed == [0]
        assert await client.generate(SGLangRequest({"input_ids": [1]}, [])) == [REPLY]
        client._replies.close()
    assert server.requests == [(0, 0), (1, 0)]


async def test_whole_replies_over_https_verify_the_certificate(make_tls_sim):
    sim = await make_tls_sim()
    url = str(sim.make_url("")).rstrip("/")
    payload = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    untrusting = SGLangClient(url, None, 10.0, ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
                              replies=ReplyPool())
    with pytest.raises(BackendUnavailable, match=rf"^SGLang at {re.escape(url)} is unreachable: Cannot connect "
                                                 r"to host 127\.0\.0\.1:\d+ \[.*CERTIFICATE_VERIFY_FAILED"):
        await untrusting.generate(SGLangRequest(payload, []))
    trusted = SGLangClient(url, None, 10.0, replies=ReplyPool())  # the default context: SSL_CERT_FILE names the CA
    first = await trusted.generate(SGLangRequest(payload, []))
    second = await trusted.generate(SGLangRequest(payload, []))
    assert [r["meta_info"]["prompt_tokens"] for r in first + second] == [2, 2]
    assert len(trusted._replies._idle) == 1 and len(next(iter(trusted._replies._idle.values()))) == 1  # kept alive
    trusted._replies.close()


async def test_a_url_that_is_not_http_is_a_503_at_the_call():
    client = SGLangClient("ftp://x", None, 10.0, replies=ReplyPool())
    with pytest.raises(BackendUnavailable, match="not an http"):
        await client.generate(SGLangRequest({"input_ids": [1]}, []))
