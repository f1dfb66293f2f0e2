"""What SGLang receives for a whole (pooled) /generate: the content type rides on the body, not on a
headers dict (sglang/client.py passes none on a plain call: aiohttp's header merge skipped), so pin the
request on the wire: its header names, `Content-Type: application/json`, the exact JSON body, the key
when set, a routing header when given."""

from __future__ import annotations

import orjson
from aiohttp import web

from token_proxy.sglang import SGLangClient
from token_proxy.sglang.client import sglang_sessions

PAYLOAD = {"input_ids": [785, 3974], "rid": "r-1", "sampling_params": {"max_new_tokens": 2}, "stream": False}
REPLY = {"text": "", "output_ids": [1, 2], "meta_info": {"id": "r-1", "finish_reason": {"type": "length"}}}
AIOHTTP_OWN = {"Host", "Accept", "Accept-Encoding", "User-Agent", "Content-Length", "Content-Type"}


async def recorded_calls(aiohttp_server, calls: int, api_key: str | None = None,
                         headers: dict | None = None) -> list[tuple[dict, bytes]]:
    seen: list[tuple[dict, bytes]] = []

    async def generate(request: web.Request) -> web.Response:
        seen.append((dict(request.headers), await request.read()))
        return web.Response(body=orjson.dumps(REPLY), content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", generate)
    server = await aiohttp_server(app)
    async with sglang_sessions(4.0) as (pooled, fresh):
        client = SGLangClient(str(server.make_url("/")), pooled, 30.0, fresh=fresh, api_key=api_key)
        for _ in range(calls):
            assert await client.generate(PAYLOAD, headers=headers) == [REPLY]
    return seen


async def test_a_plain_generate_sends_json_with_aiohttps_own_headers_only(aiohttp_server):
    seen = await recorded_calls(aiohttp_server, calls=3)  # the 2nd and 3rd on the pooled connection
    body = orjson.dumps(PAYLOAD)
    assert [(set(h), h["Content-Type"], h["Content-Length"], b) for h, b in seen] == \
        [(AIOHTTP_OWN, "application/json", str(len(body)), body)] * 3


async def test_the_key_and_a_routing_header_ride_along(aiohttp_server):
    seen = await recorded_calls(aiohttp_server, calls=2, api_key="sk-sglang", headers={"X-SMG-Routing-Key": "s-9"})
    assert [(set(h) - AIOHTTP_OWN, h["Authorization"], h["X-SMG-Routing-Key"], h["Content-Type"]) for h, _ in seen] == \
        [({"Authorization", "X-SMG-Routing-Key"}, "Bearer sk-sglang", "s-9", "application/json")] * 2


async def test_the_key_alone_and_a_routing_header_alone(aiohttp_server):
    keyed = await recorded_calls(aiohttp_server, calls=1, api_key="sk-sglang")
    routed = await recorded_calls(aiohttp_server, calls=1, headers={"X-SMG-Routing-Key": "s-9"})
    assert [(set(h) - AIOHTTP_OWN, h["Content-Type"]) for h, _ in keyed + routed] == \
        [({"Authorization"}, "application/json"), ({"X-SMG-Routing-Key"}, "application/json")]


async def test_an_extra_header_wins_over_the_key_as_before(aiohttp_server):
    """The merge order is the one the headers dict had: the key, then the call's extra headers."""
    seen = await recorded_calls(aiohttp_server, calls=1, api_key="sk-a", headers={"Authorization": "Bearer sk-b"})
    assert [(h["Authorization"], h["Content-Type"]) for h, _ in seen] == [("Bearer sk-b", "application/json")]
