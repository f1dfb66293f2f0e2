"""Reading request bodies and writing JSON / SSE responses."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from token_proxy.errors import InvalidRequest
from token_proxy.route_row import ADMIN, RouteFlags

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
# orjson reads 1,024 levels but writes only 254, and the proxy re-encodes parts of a body
# (prompt-cache keys, JSON schemas): a body it could not write back is refused up front.
MAX_JSON_DEPTH = 254
# A client that stops sending mid-body would otherwise hold the connection (and its handler) for good.
BODY_TIMEOUT_S = 60.0


async def read_json(request: web.Request) -> dict:
    raw = await read_body(request)
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object", param="body")
    body = parse_json_object(raw)
    # Only a body with that many brackets can be that deep (token-id lists have few).
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and not _encodable(body):
        raise InvalidRequest(f"The request body nests deeper than {MAX_JSON_DEPTH} levels", param="body")
    return body


async def read_body(request: web.Request) -> bytes:
    """The whole body (kept by aiohttp: a second read returns it at once), or a 408 past BODY_TIMEOUT_S."""
    try:
        if request.content.is_eof():
            # The whole body is in (as for almost every request): read() cannot wait, and wait_for's
            # task would cost two loop turns on every request's critical path.
            raw = await request.read()
        else:
            raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=f"The request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    return raw


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


# --- the route table's flags, as request data --------------------------------------------------------
# routes.add_routes fills ROUTE_TABLE (path -> route_row.Route); the middleware (ops/) reads a route's flags
# here, so it never imports routes.py (which is above it: it imports the handlers).

ROUTE_TABLE = web.AppKey("route_table", dict)  # path -> route_row.Route


def route_of(app: web.Application, path: str) -> RouteFlags | None:
    table = app.get(ROUTE_TABLE)
    return None if table is None else table.get(path)


def route_kind(app: web.Application, path: str) -> str:
    return kind_in(app.get(ROUTE_TABLE) or {}, path)


def kind_in(table: dict, path: str) -> str:
    """A path the table does not list is the admin plane's (its pass-through to SGLang included)."""
    route = table.get(path)
    return ADMIN if route is None else route.kind


def routes_where(app: web.Application, flag: str) -> list[str]:
    """The paths of the rows with `flag` set, in table order."""
    return [path for path, route in app.get(ROUTE_TABLE, {}).items() if getattr(route, flag)]


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


SSE_RESPONSE = web.RequestKey("sse_response", web.StreamResponse)  # the stream a handler opened
PASSED_THROUGH = web.RequestKey("passed_through", web.StreamResponse)  # SGLang's reply the pass-through relays


async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    request[SSE_RESPONSE] = response  # ops/drain.py ends it with an error event at SIGTERM's deadline
    return response


class SSEWriter:
    """Synchronous writes to a prepared StreamResponse's connection (a stream's read callback cannot
    await), framed as the response's own writer frames them; `blocked`/`drained` are its flow control."""

    HIGH = 0x10000  # bytes waiting in the client's socket buffer before SGLang stops being read
    LOW = 0x4000

    def __init__(self, request: web.Request, response: web.StreamResponse):
        self._transport = request.transport
        # aiohttp chunks an HTTP/1.1 response of unknown length itself (response.chunked stays False).
        self._chunked = "chunked" in response.headers.get("Transfer-Encoding", "").lower()

    def write(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    def blocked(self) -> bool:
        transport = self._transport
        return transport is not None and transport.get_write_buffer_size() > self.HIGH

    async def drained(self) -> None:
        transport = self._transport
        while transport is not None and not transport.is_closing() and transport.get_write_buffer_size() > self.LOW:
            await asyncio.sleep(0.005)
