"""The proxy's one route table: per route its path, methods, handler, class and flags, data plane and
admin plane (every dialect) alike. add_routes registers the rows and puts the table on the app
(http_io.ROUTE_TABLE), where the middleware reads a route's flags: auth and admission its class,
the access log `quiet`, the metrics `weight_update` and the inference rows;
`in_openapi` rows are the paths ops/openapi.py describes (tests/serving/test_route_table.py checks
the two agree); a --workers process forwards the `answered_by=OWNER` rows to the admin owner.

Classes: inference (generates tokens: the API key, and an admission slot), tokenizer (data-plane
reads: the API key), admin (control plane: the admin key), ops (public probes and metrics).
Paths not listed are the admin plane's pass-through to SGLang (class admin).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from token_proxy import __version__
from token_proxy.admin import art, memory, prime_rl, removed_routes, vllm_rl, vllm_weights
from token_proxy.admin import forward as fw
from token_proxy.admin.forward import Forward, add_passthrough, forwarder, passthrough
from token_proxy.admin.prime_rl import add_admin_state
from token_proxy.api.chat.derender import chat_completions_derender
from token_proxy.api.chat.endpoint import (
    chat_completions,
    chat_completions_render,
    chat_completions_tokens,
)
from token_proxy.api.chat.sessions import finish_session
from token_proxy.api.completions.endpoint import completions
from token_proxy.api.generate.endpoint import generate_tokens
from token_proxy.api.tokenize.endpoint import detokenize, tokenize
from token_proxy.errors import BackendUnavailable, MethodNotAllowed, NotImplementedHere
from token_proxy.fleet import ownership, version_feed
from token_proxy.fleet.fence import add_fence
from token_proxy.fleet.versions import joining as fleet_joining
from token_proxy.http_io import ROUTE_TABLE, json_response
from token_proxy.lora import routes as lora
from token_proxy.lora.registry import ADAPTERS
from token_proxy.lora.routes import adapter_cards
from token_proxy.ops.exposition import metrics_endpoint
from token_proxy.ops.openapi import openapi_json
from token_proxy.route_row import ADMIN, INFERENCE, LOCAL, OPS, OWNER, TOKENIZER, Handler, Route
from token_proxy.sglang.pause import PRIME_RL, VLLM
from token_proxy.state import CONTEXT, SETTINGS

# A row's dialect: None, the proxy's own (OpenAI / vLLM serving API); else whose admin API it speaks.
SGLANG, INTERNAL = "sglang", "internal"  # and the pause dialects PRIME_RL, VLLM (sglang/pause.py)
SKYRL, ART = "skyrl", "art"  # routes the trainers' own vLLM servers add
# /v1/models' owned_by while the built-in simulator serves: its tokens come from no model.
SIMULATED_OWNER = "sglang-token-proxy-simulator (not a model: start with --backend)"


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    name = ctx.served_model_name
    owner = SIMULATED_OWNER if ctx.settings.simulator else "sglang-token-proxy"
    # vLLM: one card per --served-model-name, in the order given (each answers)
    cards = [{"id": served, "object": "model", "created": ctx.started_at, "owned_by": owner,
              "root": ctx.backend.tokenizer_path, "parent": None, "max_model_len": ctx.max_model_len,
              "permission": []} for served in (name, *ctx.settings.served_model_aliases)]
    adapters = adapter_cards(request.app[ADAPTERS], name, ctx.max_model_len, ctx.started_at)
    return json_response({"object": "list", "data": [*cards, *adapters]})


async def fetch_weights(request: web.Request) -> web.Response:
    raise NotImplementedHere("The proxy cannot serve /fetch_weights: SGLang takes weights pushed to it, it does "
                             "not fetch them. Push them with POST /update_weights (prime-rl: a weight_dir, or NCCL "
                             "after /init_broadcaster) or vLLM's /update_weights {\"update_info\"}")


async def version(request: web.Request) -> web.Response:
    """vLLM's GET /version."""
    return json_response({"version": __version__})


# --workers N: whether the admin owner (which serves every admin route and native /generate's pass-through)
# is connected too; a data-plane process sets it (serving/process_app.py), one process has none.
OWNER_NOT_READY: web.AppKey[Callable[[], Awaitable[str | None]]] = web.AppKey("owner_not_ready")


async def health(request: web.Request) -> web.Response:
    """The readiness probe: healthy only while every route can be served: connected (tokenizer loaded), the
    admin owner too under --workers, and SGLang healthy. Orchestrators route around a proxy whose engine is
    gone; the 503 body says why. (Liveness, that the process answers at all: GET /version.)"""
    ctx = request.app[CONTEXT]
    reason = ctx.not_ready_reason
    if reason is None and OWNER_NOT_READY in request.app:
        reason = await request.app[OWNER_NOT_READY]()
    if reason is None:
        reason = fleet_joining(request.app)  # every worker blocked in a group join (fleet/joins.py)
    if reason is None:
        problem = await ctx.client.health_problem(timeout_s=5.0)
        reason = problem and f"SGLang at {ctx.client.base_url} is not healthy: {problem}"
    if reason is None:
        return web.Response(status=200)
    return json_response(BackendUnavailable(reason).body(), status=503)


POST, GET, GET_POST = ("POST",), ("GET",), ("GET", "POST")
WV = "weight_version"  # the body key that names the version most of SGLang's weight calls set


def _sglang(path: str, forward: Forward, methods: tuple[str, ...] = POST, kind: str = ADMIN, **flags) -> Route:
    """One of SGLang's native admin routes, forwarded as `forward` says (admin/forward.py's one forwarder)."""
    return Route(path, methods, forwarder(path, forward), kind, dialect=SGLANG, answered_by=OWNER, **flags)


def _admin(path: str, methods: tuple[str, ...], handler: Handler, dialect: str, kind: str = ADMIN, **flags) -> Route:
    return Route(path, methods, handler, kind, dialect=dialect, answered_by=OWNER, **flags)


ROUTES: tuple[Route, ...] = (
    # --- the data plane (every process answers it; on every row a wrong method is a 405 with Allow) ---
    Route("/v1/chat/completions", POST, chat_completions, INFERENCE, in_openapi=True),
    Route("/v1/chat/completions/tokens", POST, chat_completions_tokens, INFERENCE, in_openapi=True),
    Route("/v1/chat/completions/render", POST, chat_completions_render, TOKENIZER, in_openapi=True),  # no SGLang
    Route("/v1/chat/completions/derender", POST, chat_completions_derender, TOKENIZER),  # ids back: no SGLang
    Route("/v1/completions", POST, completions, INFERENCE, in_openapi=True),
    Route("/inference/v1/generate", POST, generate_tokens, INFERENCE, in_openapi=True),
    *(Route(f"{prefix}/{name}", POST, handler, TOKENIZER, in_openapi=True)
      for prefix in ("", "/v1") for name, handler in (("tokenize", tokenize), ("detokenize", detokenize))),
    Route("/v1/models", GET, list_models, TOKENIZER, in_openapi=True),
    # SkyRL: a trajectory's session ends; with --workers N the owner drops it in every process
    Route("/finish_session", POST, finish_session, TOKENIZER, answered_by=OWNER),
    Route("/fetch_weights", GET_POST, fetch_weights, ADMIN),  # a 501 that says how weights reach SGLang
    Route("/openapi.json", GET, openapi_json, OPS),
    Route("/health", GET, health, OPS, quiet=True, in_openapi=True),
    Route("/version", GET, version, OPS),
    Route("/metrics", GET, metrics_endpoint, OPS, quiet=True),
    # --- prime-rl's admin plane (admin/prime_rl.py); /pause, /resume, /update_weights speak vLLM's too ---
    _admin("/pause", POST, prime_rl.pause, PRIME_RL),
    _admin("/resume", POST, prime_rl.resume, PRIME_RL),
    _admin("/update_weights", POST, prime_rl.update_weights, PRIME_RL, weight_update=True),
    _admin("/reload_weights", POST, prime_rl.reload_weights, PRIME_RL, weight_update=True),
    _admin("/init_broadcaster", POST, prime_rl.init_broadcaster, PRIME_RL),
    _admin("/liveness", GET, prime_rl.liveness, PRIME_RL, kind=OPS),  # asks every worker
    # --- one owner for the fleet's weights (fleet/ownership.py): what a follower mirrors ---
    _admin("/fleet/versions", GET, version_feed.fleet_versions, None),
    # --- vLLM 0.33's RL admin API (admin/vllm_rl.py; its weight transfer: admin/vllm_weights.py) ---
    _admin("/is_paused", GET, vllm_rl.is_paused, VLLM),
    _admin("/abort_requests", POST, vllm_rl.abort_requests, VLLM),
    _admin("/sleep", POST, vllm_rl.sleep, VLLM),
    _admin("/wake_up", POST, vllm_rl.wake_up, VLLM),
    _admin("/is_sleeping", GET, vllm_rl.is_sleeping, VLLM),
    _admin("/release_kv_cache_memory", POST, vllm_rl.release_kv_cache_memory, VLLM),
    _admin("/reset_prefix_cache", POST, vllm_rl.reset_prefix_cache, VLLM),
    _admin("/init_weight_transfer_engine", POST, vllm_weights.init_weight_transfer_engine, VLLM),
    _admin("/shutdown_weight_transfer_engine", POST, vllm_weights.shutdown_weight_transfer_engine, VLLM),
    _admin("/start_weight_update", POST, vllm_weights.start_weight_update, VLLM),
    _admin("/start_draft_weight_update", POST, vllm_weights.start_draft_weight_update, VLLM),
    _admin("/finish_weight_update", POST, vllm_weights.finish_weight_update, VLLM),
    _admin("/weight_info", GET, vllm_weights.weight_info, VLLM),
    _admin("/weight_checker", POST, vllm_weights.weight_checker, VLLM),
    _admin("/get_world_size", GET, vllm_weights.get_world_size, VLLM),
    _admin("/collective_rpc", POST, vllm_weights.collective_rpc, VLLM),
    # --- LoRA, one registry behind both dialects (lora/routes.py) ---
    _admin("/v1/load_lora_adapter", POST, lora.load_v1, VLLM),
    _admin("/v1/unload_lora_adapter", POST, lora.unload_v1, VLLM),
    _admin("/load_lora_adapter", POST, lora.load_in_place, SGLANG),
    _admin("/unload_lora_adapter", POST, lora.unload_sglang, SGLANG),
    _admin("/skyrl/v1/load_lora_adapter", POST, lora.load_skyrl, SKYRL),
    # --- ART's own route on its vLLM runtime (admin/art.py): the served base model renamed ---
    _admin("/art/set_served_model_name", POST, art.set_served_model_name, ART),
    # --- SGLang's native admin routes, forwarded to every worker (admin/forward.py): a Forward names the
    # timeout's Settings field, how each worker's body is made and the bookkeeping after. /load_lora_adapter
    # and /unload_lora_adapter: the LoRA registry owns them (above). ---
    _sglang("/update_weights_from_disk", Forward("weight_update_timeout_s", prepare=fw.disk_bodies,
                                                 after=fw.note_version), weight_update=True, version_key=WV),
    _sglang("/init_weights_update_group", Forward("init_group_timeout_s", prepare=fw.group_bodies,
                                                  after=fw.note_group)),
    _sglang("/update_weights_from_distributed", Forward("weight_update_timeout_s", prepare=fw.tensor_bodies,
                                                        session=True, push=True), weight_update=True, version_key=WV),
    # SGLang 0.5.21+: a client's own session reaches every worker, and the proxy's bracket stands aside.
    _sglang("/begin_weight_update", Forward("admin_timeout_s", after=fw.note_session_open)),
    _sglang("/end_weight_update", Forward("weight_update_timeout_s", after=fw.note_session_closed)),
    _sglang("/destroy_weights_update_group", Forward("admin_timeout_s", prepare=fw.destroy_bodies,
                                                     after=fw.note_group_gone)),
    _sglang("/update_weight_version", Forward("admin_timeout_s", prepare=fw.version_bodies,
                                              after=fw.note_new_version), version_key="new_version"),
    _sglang("/pause_generation", Forward("admin_timeout_s", after=fw.note_pause)),
    _sglang("/continue_generation", Forward("admin_timeout_s", after=fw.note_continue)),
    _sglang("/flush_cache", Forward("admin_timeout_s"), GET_POST),
    # guarded: a misused release or resume kills SGLang's scheduler (admin/memory.py)
    _admin("/release_memory_occupation", GET_POST, memory.release_memory_occupation, SGLANG),
    _admin("/resume_memory_occupation", GET_POST, memory.resume_memory_occupation, SGLANG),
    _sglang("/get_weights_by_name", Forward("admin_timeout_s", fan_out=False, prepare=fw.weight_read_bodies),
            GET_POST),
    *(_sglang(path, Forward("short", fan_out=False), GET, kind=TOKENIZER)
      for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info")),
    # --- routes SGLang 0.5.21 deleted, answered in their old shape (admin/removed_routes.py) ---
    _admin("/get_load", GET, removed_routes.get_load, SGLANG, kind=TOKENIZER),
    _admin("/clear_hicache_storage_backend", GET_POST, removed_routes.clear_hicache_storage_backend, SGLANG),
    _admin("/get_weight_version", GET, removed_routes.weight_version, SGLANG),
    _admin("/weight_version", GET, removed_routes.weight_version, SGLANG),
    # --- SGLang's own routes, reached through the pass-through: listed for their class and flags ---
    Route("/generate", POST, None, INFERENCE, dialect=SGLANG, answered_by=OWNER),
    Route("/health_generate", GET, None, TOKENIZER, dialect=SGLANG, answered_by=OWNER),
    Route("/ping", GET, None, OPS, dialect=SGLANG, answered_by=OWNER),
    Route("/update_weights_from_tensor", POST, None, ADMIN, weight_update=True, version_key=WV, dialect=SGLANG,
          answered_by=OWNER),
)
_TABLE = {route.path: route for route in ROUTES}


def method_not_allowed(allowed: tuple[str, ...]) -> Handler:
    async def refuse(request: web.Request) -> web.StreamResponse:
        raise MethodNotAllowed(request.method, request.path, allowed)

    return refuse


def add_rows(app: web.Application, rows, handler: Handler | None = None) -> None:
    """Register the rows and list each in the app's table (http_io.ROUTE_TABLE). Every row answers only
    its methods (and HEAD where it has GET); any other is a 405 with Allow, never the pass-through (an
    open row such as /ping would otherwise take any method to SGLang without a key). A row with no
    handler is SGLang's: its methods go to the pass-through. `handler`: answers every row in place of
    its own (a --workers process forwards the OWNER rows to the owner). HEAD is answered wherever GET is: the
    pass-through sends SGLang a GET (its FastAPI routes take no HEAD) and answers without the body."""
    table = app.get(ROUTE_TABLE)
    if table is None:
        table = app[ROUTE_TABLE] = {}
    for route in rows:
        table[route.path] = route
        answer = handler or route.handler or passthrough
        methods = route.methods + (("HEAD",) if "GET" in route.methods else ())
        for method in methods:
            app.router.add_route(method, route.path, answer)
        app.router.add_route("*", route.path, method_not_allowed(methods))


def add_admin_plane(app: web.Application) -> None:
    """This process answers the admin plane: its state, its rows, then (last: aiohttp matches in order)
    the pass-through of every other route to SGLang."""
    add_admin_state(app)
    add_fence(app)  # after the plane's state: its watcher and the data path's fleet versions
    rows = [route for route in ROUTES if route.answered_by == OWNER]
    if app[SETTINGS].fleet_controller:  # a follower: the fleet's admin calls go to its controller
        ownership.add_follower(app)
        add_rows(app, [route for route in rows if ownership.follows(route)], ownership.forward_to_controller)
        rows = [route for route in rows if not ownership.follows(route)]
    add_rows(app, rows)
    add_passthrough(app)


def add_routes(app: web.Application, add_admin: Callable[[web.Application], None] = add_admin_plane) -> None:
    """The LOCAL rows, then the admin plane's (`add_admin`: a --workers process forwards the OWNER rows).
    The whole table goes on the app whoever answers a row: a serving process checks keys and logs as the owner would."""
    add_rows(app, [route for route in ROUTES if route.answered_by == LOCAL])
    app[ROUTE_TABLE].update(_TABLE)
    add_admin(app)
