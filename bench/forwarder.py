"""The baseline: a bare aiohttp pass-through in front of SGLang (no parsing, no tokenizing)."""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


def create_forwarder(backend: str) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def session_ctx(app):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            app[SESSION] = session
            yield

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with app[SESSION].request(request.method, backend + request.path_qs, data=body,
                                        headers={"Content-Type": "application/json"}) as upstream:
            response = web.StreamResponse(status=upstream.status,
                                          headers={"Content-Type": upstream.headers.get("Content-Type", "")})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True)
    args = parser.parse_args()
    web.run_app(create_forwarder(args.backend), host="127.0.0.1", port=args.port, access_log=None, print=None)
