"""What SGLang receives for a whole /generate, written by the project's own HTTP/1.1 requester on a kept-alive
connection (sglang/pool.py), so pin the request on the wire: its header names, `Content-Type:
application/json`, the exact JSON body, the key when set, a routing header when given, one connection for
calls in a row."""

from __future__ import annotations

import orjson
from aiohttp import web

from token_proxy.sglang import SGLangClient
from token_proxy.sglang.payload import SGLangRequest
from token_proxy.sglang.pool import sglang_sessions

PAYLOAD = {"input_ids": [785, 3974], "rid": "r-1", "sampling_params": {"max_new_tokens": 2}, "stream": False}
REPLY = {"text": "", "output_ids": [1, 2], "meta_info": {"id": "r-1", "finish_reason": {"type": "length"}}}
OWN = {"Host", "Content-Length", "Content-Type"}


async def recorded_calls(aiohttp_server, calls: int, api_key: str | None = None,
                         routing_key: str | None = None, ports: list | None = None) -> list[tuple[dict, bytes]]:
    seen: list[tuple[dict, bytes]] = []

    async def generate(request: web.Request) -> web.Response:
        seen.append((dict(request.headers), await request.read()))
        if ports is not None:
            ports.append(request.transport.get_extra_info("peername")[1])
        return web.Response(body=orjson.dumps(REPLY), content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", generate)
    server = await aiohttp_server(app)
    async with sglang_sessions(4.0) as (pooled, fresh, replies):
        client = SGLangClient(str(server.make_url("/")), pooled, 30.0, fresh=fresh, api_key=api_key, replies=replies)
        for _ in range(calls):
            assert await client.generate(SGLangRequest(PAYLOAD, [], routing_key)) == [REPLY]
    return seen


async def test_a_plain_generate_sends_json_with_three_headers_on_one_kept_alive_connection(aiohttp_server):
    ports: list[int] = []
    seen = await recorded_calls(aiohttp_server, calls=3, ports=ports)  # the 2nd and 3rd on the kept-alive connection
    body = orjson.dumps(PAYLOAD)
    host = seen[0][0]["Host"]
    assert host.startswith("127.0.0.1:") and int(host.split(":")[1]) > 0
    assert [(set(h), h["Content-Type"], h["Content-Length"], h["Host"], b) for h, b in seen] == \
        [(OWN, "application/json", str(len(body)), host, body)] * 3
    assert len(ports) == 3 and len(set(ports)) == 1


async def test_the_key_and_a_routing_header_ride_along(aiohttp_server):
    seen = await recorded_calls(aiohttp_server, calls=2, api_key="sk-sglang", routing_key="s-9")
    assert [(set(h) - OWN, h["Authorization"], h["X-SMG-Routing-Key"], h["Content-Type"]) for h, _ in seen] == \
        [({"Authorization", "X-SMG-Routing-Key"}, "Bearer sk-sglang", "s-9", "application/json")] * 2


async def test_the_key_alone_and_a_routing_header_alone(aiohttp_server):
    keyed = await recorded_calls(aiohttp_server, calls=1, api_key="sk-sglang")
    routed = await recorded_calls(aiohttp_server, calls=1, routing_key="s-9")
    assert [(set(h) - OWN, h["Content-Type"]) for h, _ in keyed + routed] == \
        [({"Authorization"}, "application/json"), ({"X-SMG-Routing-Key"}, "application/json")]
