"""One place that turns errors into OpenAI's {"error": {...}} body."""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from token_proxy.errors import ProxyError, error_body
from token_proxy.ops.metrics import CLIENT_CLOSED

log = logging.getLogger(__name__)

_HTTP_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "RequestEntityTooLargeError"}


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   headers: dict | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(error_body(message, err_type, param, status)), content_type="application/json", headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ProxyError as exc:
        if exc.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
        return web.Response(status=exc.status, body=orjson.dumps(exc.body()), content_type="application/json",
                            headers=exc.headers())
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.status != 404 else f"The route {request.path} does not exist"
        return error_response(exc.status, message or exc.reason, _HTTP_TYPES.get(exc.status, "BadRequestError"))
    except Exception as exc:
        if isinstance(exc, ConnectionResetError) and _client_left(request):
            # The client left mid-response (the SGLang request is already aborted): nobody to answer.
            log.info("%s %s: the client closed the connection", request.method, request.path)
            return web.Response(status=CLIENT_CLOSED)
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "Internal error in the proxy; see its log", "InternalServerError")


def _client_left(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()
