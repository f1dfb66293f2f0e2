"""The proxy's route table: per route its path, methods, handler and class. Auth, admission and
metrics read the class from here; a wrong method on a listed route answers 405 with `Allow`.

Classes: inference (generates tokens: the API key, and an admission slot), tokenizer (data-plane
reads: the API key), admin (control plane: the admin key), ops (public probes and metrics).
Paths not listed are the admin plane's (proxy/admin/, including the pass-through to SGLang).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from token_proxy.admin.routes import add_admin_routes
from token_proxy.api.chat.endpoint import (
    chat_completions,
    chat_completions_render,
    chat_completions_tokens,
)
from token_proxy.api.completions.endpoint import completions
from token_proxy.api.generate.endpoint import generate_tokens
from token_proxy.api.tokenize.endpoint import detokenize, tokenize
from token_proxy.errors import BackendUnavailable, MethodNotAllowed
from token_proxy.http_io import json_response
from token_proxy.lora.registry import ADAPTERS
from token_proxy.lora.routes import adapter_cards
from token_proxy.ops.metrics import metrics_endpoint
from token_proxy.ops.openapi import openapi_json
from token_proxy.state import CONTEXT

INFERENCE, TOKENIZER, ADMIN, OPS = "inference", "tokenizer", "admin", "ops"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    name = ctx.backend.served_model_name
    card = {"id": name, "object": "model", "created": ctx.started_at, "owned_by": "sglang-token-proxy",
            "root": ctx.backend.tokenizer_path, "parent": None, "max_model_len": ctx.max_model_len,
            "permission": []}
    adapters = adapter_cards(request.app[ADAPTERS], name, ctx.max_model_len, ctx.started_at)
    return json_response({"object": "list", "data": [card, *adapters]})


async def health(request: web.Request) -> web.Response:
    """Healthy only while the data path can serve: connected (tokenizer loaded) and SGLang healthy.
    Orchestrators route around a proxy whose engine is gone; the 503 body says why."""
    ctx = request.app[CONTEXT]
    reason = ctx.not_ready_reason
    if reason is None:
        problem = await ctx.client.health_problem(timeout_s=5.0)
        reason = problem and f"SGLang at {ctx.client.base_url} is not healthy: {problem}"
    if reason is None:
        return web.Response(status=200)
    return json_response(BackendUnavailable(reason).body(), status=503)


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    methods: tuple[str, ...]
    handler: Handler | None  # None: served by the admin plane or SGLang (pass-through); listed for its class
    kind: str  # INFERENCE / TOKENIZER / ADMIN / OPS


ROUTES: tuple[Route, ...] = (
    Route("/v1/chat/completions", ("POST",), chat_completions, INFERENCE),
    Route("/v1/chat/completions/tokens", ("POST",), chat_completions_tokens, INFERENCE),
    Route("/v1/chat/completions/render", ("POST",), chat_completions_render, TOKENIZER),  # renders, no SGLang
    Route("/v1/completions", ("POST",), completions, INFERENCE),
    Route("/inference/v1/generate", ("POST",), generate_tokens, INFERENCE),
    *(Route(f"{prefix}/{name}", ("POST",), handler, TOKENIZER)
      for prefix in ("", "/v1") for name, handler in (("tokenize", tokenize), ("detokenize", detokenize))),
    Route("/v1/models", ("GET",), list_models, TOKENIZER),
    Route("/openapi.json", ("GET",), openapi_json, OPS),
    Route("/health", ("GET",), health, OPS),
    Route("/metrics", ("GET",), metrics_endpoint, OPS),
    Route("/liveness", ("GET",), None, OPS),  # prime-rl's; the admin plane asks every worker
    Route("/ping", ("GET",), None, OPS),
    # SGLang's own data-plane routes, reached through the pass-through:
    Route("/generate", ("POST",), None, INFERENCE),
    *(Route(path, ("GET",), None, TOKENIZER) for path in (
        "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/get_load", "/health_generate")),
)
_CLASS_OF = {route.path: route.kind for route in ROUTES}


def route_class(path: str) -> str:
    return _CLASS_OF.get(path, ADMIN)


def method_not_allowed(allowed: tuple[str, ...]) -> Handler:
    async def refuse(request: web.Request) -> web.StreamResponse:
        raise MethodNotAllowed(request.method, request.path, allowed)

    return refuse


def add_routes(app: web.Application, add_admin: Callable[[web.Application], None] = add_admin_routes) -> None:
    """The table's routes, then the admin plane's (`add_admin`: a --workers process forwards them)."""
    for route in ROUTES:
        if route.handler is None:
            continue
        allowed = route.methods + (("HEAD",) if "GET" in route.methods else ())
        for method in route.methods:
            app.router.add_route(method, route.path, route.handler)
        if "GET" in route.methods:
            app.router.add_route("HEAD", route.path, route.handler)
        app.router.add_route("*", route.path, method_not_allowed(allowed))
    add_admin(app)  # last: it ends with the catch-all pass-through to SGLang
