"""Reading request bodies and writing JSON / SSE responses."""

from __future__ import annotations

import orjson
from aiohttp import web

from token_proxy.errors import InvalidRequest

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


async def read_json(request: web.Request) -> dict:
    raw = await request.read()
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object", param="body")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object", param="body")
    return body


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def sse_frames(chunks: list[dict]) -> bytes:
    return b"".join([b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks])


async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    return response
