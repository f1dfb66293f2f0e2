"""Reading request bodies and writing JSON / SSE responses."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from token_proxy.errors import InvalidRequest

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
# orjson reads 1,024 levels but writes only 254, and the proxy re-encodes parts of a body
# (prompt-cache keys, JSON schemas): a body it could not write back is refused up front.
MAX_JSON_DEPTH = 254
# A client that stops sending mid-body would otherwise hold its admission slot for good.
BODY_TIMEOUT_S = 60.0


async def read_json(request: web.Request) -> dict:
    try:
        raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=f"The request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object", param="body")
    body = parse_json_object(raw)
    # Only a body with that many brackets can be that deep (token-id lists have few).
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and not _encodable(body):
        raise InvalidRequest(f"The request body nests deeper than {MAX_JSON_DEPTH} levels", param="body")
    return body


def parse_json_object(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object", param="body")
    return body


def _encodable(body: dict) -> bool:
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        return False
    return True


RESPONSE_HEADERS = web.RequestKey("response_headers", dict)


def response_headers(request: web.Request) -> dict:
    """Headers a handler adds to its response, whichever way it goes out (JSON, SSE, an error)."""
    headers = request.get(RESPONSE_HEADERS)
    if headers is None:
        headers = request[RESPONSE_HEADERS] = {}
    return headers


async def send_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: runs before the headers go out, streams included."""
    headers = request.get(RESPONSE_HEADERS)
    if headers:
        response.headers.update(headers)


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def sse_frames(chunks: list[dict]) -> bytes:
    return b"".join([b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks])


async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    return response
