"""The proxy's routes, and the small handlers that need no module of their own."""

from __future__ import annotations

from aiohttp import web

from token_proxy.proxy.admin.routes import add_admin_routes
from token_proxy.proxy.endpoints.chat import chat_completions, chat_completions_tokens
from token_proxy.proxy.endpoints.completions import completions
from token_proxy.proxy.endpoints.generate import generate_tokens
from token_proxy.proxy.endpoints.tokenize import detokenize, tokenize
from token_proxy.proxy.http_io import json_response
from token_proxy.proxy.ops.metrics import metrics_endpoint
from token_proxy.proxy.ops.openapi import openapi_json
from token_proxy.proxy.upstream.context import CONTEXT


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    name = ctx.backend.served_model_name
    card = {"id": name, "object": "model", "created": ctx.started_at, "owned_by": "sglang-token-proxy",
            "root": ctx.backend.tokenizer_path, "parent": None, "max_model_len": ctx.max_model_len,
            "permission": []}
    return json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    """Healthy only while SGLang is: orchestrators route around a proxy whose engine is gone."""
    ctx = request.app[CONTEXT]
    if await ctx.client.healthy(timeout_s=5.0):
        return web.Response(status=200)
    return json_response({"error": {"message": f"SGLang at {ctx.client.base_url} is not healthy",
                                    "type": "ServiceUnavailableError", "param": None, "code": 503}},
                         status=503)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/chat/completions/tokens", chat_completions_tokens)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/inference/v1/generate", generate_tokens)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    for prefix in ("", "/v1"):
        app.router.add_post(f"{prefix}/tokenize", tokenize)
        app.router.add_post(f"{prefix}/detokenize", detokenize)
    add_admin_routes(app)  # last: it ends with the catch-all pass-through to SGLang
