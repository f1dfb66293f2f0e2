"""CORS for browser clients, as vllm serve's --allowed-origins / --allowed-methods / --allowed-headers /
--allow-credentials (Starlette's CORSMiddleware there). Off unless origins are given: vLLM allows every
origin by default, but here the admin routes answer loopback clients without a key, and a page in a
browser on that host must not read their answers.

A preflight (OPTIONS with Access-Control-Request-Method) is answered here, before keys are checked (a
browser sends none with it); every other response to an allowed origin gets the CORS headers as it is
prepared, streams included.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

PREFLIGHT_MAX_AGE_S = 600  # Starlette's default


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def allows(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def allow_origin(self, origin: str) -> str:
        """`*` only when any origin is allowed and no credentials go with it (the Fetch standard)."""
        return "*" if "*" in self.origins and not self.credentials else origin

    def response_headers(self, origin: str) -> dict[str, str]:
        headers = {"Access-Control-Allow-Origin": self.allow_origin(origin)}
        if headers["Access-Control-Allow-Origin"] != "*":
            headers["Vary"] = "Origin"
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight_headers(self, origin: str, requested_headers: str | None) -> dict[str, str]:
        methods = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT" if "*" in self.methods else ", ".join(self.methods)
        allowed = requested_headers if "*" in self.headers and requested_headers else ", ".join(self.headers)
        return {**self.response_headers(origin), "Access-Control-Allow-Methods": methods,
                "Access-Control-Allow-Headers": allowed, "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)}


CORS = web.AppKey("cors", CorsPolicy)


@web.middleware
async def cors_preflight(request: web.Request, handler):
    policy = request.app.get(CORS)
    origin = request.headers.get("Origin")
    if (policy is None or origin is None or request.method != "OPTIONS"
            or "Access-Control-Request-Method" not in request.headers):
        return await handler(request)
    method = request.headers["Access-Control-Request-Method"].upper()
    if not policy.allows(origin) or ("*" not in policy.methods and method not in policy.methods):
        return web.Response(status=400, text="Disallowed CORS origin or method")
    return web.Response(status=200, headers=policy.preflight_headers(
        origin, request.headers.get("Access-Control-Request-Headers")))


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: before the status line goes out, so SSE streams get them too."""
    policy = request.app.get(CORS)
    origin = request.headers.get("Origin")
    if policy is not None and origin is not None and policy.allows(origin):
        response.headers.update(policy.response_headers(origin))


def add_cors(app: web.Application, origins: tuple[str, ...], methods: tuple[str, ...], headers: tuple[str, ...],
             credentials: bool) -> None:
    if origins:
        app[CORS] = CorsPolicy(origins, methods or ("*",), headers or ("*",), credentials)
        app.on_response_prepare.append(add_cors_headers)
