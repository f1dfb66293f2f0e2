"""SGLang's control and info endpoints, with the bodies and status codes a 0.5.17 server sends."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from token_proxy.simulator import info
from token_proxy.simulator import metrics as sim_metrics
from token_proxy.simulator.errors import RequestValidationError, json_response
from token_proxy.simulator.generate_route import decode_json_body
from token_proxy.simulator.request_defaults import with_defaults
from token_proxy.simulator.state import SIM_STATE, SimState

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
PAUSE_MODES = ("abort", "retract", "in_place")
# 0.5.22+: an update whose flush finds requests pending (scheduler_components/weight_updater.py).
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")


def empty(status: int = 200, text: str = "") -> web.Response:
    """FastAPI's bare Response(content=...): no content type at all."""
    response = web.Response(status=status, body=text.encode())
    response.content_type = ""  # aiohttp would otherwise label the body application/octet-stream
    return response


async def health(request: web.Request) -> web.Response:
    return empty()


async def health_generate(request: web.Request) -> web.Response:
    # A real server answers 503 once its 1-token probe has waited 20 s with generation paused.
    return empty(503 if request.app[SIM_STATE].paused else 200)


async def model_info(request: web.Request) -> web.Response:
    return json_response(info.model_info(request.app[SIM_STATE]))


async def server_info(request: web.Request) -> web.Response:
    host, port = request.transport.get_extra_info("sockname")[:2]
    return json_response(info.server_info(request.app[SIM_STATE], host, port))


async def models(request: web.Request) -> web.Response:
    return json_response(info.models_list(request.app[SIM_STATE]))


async def get_load(request: web.Request) -> web.Response:
    return json_response(info.load(request.app[SIM_STATE]))


async def v1_loads(request: web.Request) -> web.Response:
    return json_response(info.loads(request.app[SIM_STATE]))


async def metrics(request: web.Request) -> web.Response:
    body = sim_metrics.metrics_text(request.app[SIM_STATE]).encode()
    return web.Response(body=body, headers={"Content-Type": sim_metrics.CONTENT_TYPE})


async def weight_version_gone(request: web.Request) -> web.Response:
    message = (
        "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
    )
    return json_response(
        {"object": "error", "message": message, "type": "404", "param": None, "code": 404}, 404
    )


async def flush_cache(request: web.Request) -> web.Response:
    sim = request.app[SIM_STATE]
    if sim.running:
        return empty(400, "Flush cache failed.\n")
    sim.prefix_cache.clear()
    return empty(200, FLUSHED)


async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request, (1587, "abort_request"))
    request.app[SIM_STATE].abort(body.get("rid"), bool(body.get("abort_all")))
    return empty()


async def pause_generation(request: web.Request) -> web.Response:
    body = await _body(request, (1665, "pause_generation"), allow_empty=True)
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise _literal_error(mode, (1665, "pause_generation", "POST /pause_generation"))
    await _pause(request.app[SIM_STATE], mode)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


async def _pause(sim: SimState, mode: str) -> None:
    sim.paused, sim.pause_mode = True, mode
    if mode == "retract":  # retracted requests are recomputed later, and say so in meta_info
        for sequence in sim.running.values():
            sequence.num_retractions += sequence.started
    if mode == "abort":
        victims = [s for s in sim.running.values() if s.started]
        for sequence in victims:
            sequence.abort_requested = True
        sim.notify()
        while any(s.rid in sim.running for s in victims):
            await sim.changed()


async def continue_generation(request: web.Request) -> web.Response:
    await _body(request, (1678, "continue_generation"), allow_empty=True)
    sim = request.app[SIM_STATE]
    sim.paused, sim.pause_mode = False, None
    sim.notify()
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await _body(request, (1215, "update_weights_from_disk"), required=("model_path",))
    sim = request.app[SIM_STATE]
    if body.get("abort_all_requests"):
        sim.abort(abort_all=True)
    path = str(body["model_path"])
    if not sim.paused:
        await _drain(sim)
    ok = path in (sim.weights_path, sim.config.model_path) or _has_safetensors(path)
    message = (
        "Succeeded to update model weights."
        if ok
        else f"Failed to get weights iterator: Cannot find any model weights with `{path}`."
    )
    flush = flush_outcome(sim, body) if ok else FLUSH_DONE
    if flush == CRASH:
        return crash_scheduler(sim)
    if flush == REFUSED:
        sim.weights_path = path  # updated; the flush (and the tokenizer's version bump) skipped
        return json_response({"success": False, "message": FLUSH_REFUSED, "num_paused_requests": 0}, 400)
    if ok:
        _load_weights(sim, path, body)
        for hook in sim.on_disk_load:  # a disk load replaces every tensor (what an NCCL push changed is gone)
            hook()
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
    return json_response({"success": ok, "message": message, "num_paused_requests": 0}, 200 if ok else 400)


FLUSH_DONE, CRASH, REFUSED = "flushed", "crash", "refused"


def flush_outcome(sim: SimState, body: dict) -> str:
    """What an update's cache flush (flush_cache, default true) does when it finds requests pending
    (paused retract / in_place): before 0.5.22 SGLang asserts "Cache flush failed after updating
    weights" and its scheduler dies (CRASH); 0.5.22+ keeps the new weights, skips the flush and the
    version bump and answers success false (REFUSED). Nothing pending: FLUSH_DONE."""
    if not (bool(body.get("flush_cache", True)) and bool(sim.running)):
        return FLUSH_DONE
    return REFUSED if sim.config.since("0.5.22") else CRASH


def crash_scheduler(sim: SimState) -> web.Response:
    sim.crashed = True
    sim.notify()
    return web.Response(status=500, text="Internal Server Error")


async def _drain(sim: SimState) -> None:
    """SGLang's writer lock: new requests wait, in-flight ones finish first."""
    sim.updating_weights = True
    try:
        while sim.active:
            await sim.changed()
    finally:
        sim.updating_weights = False
        sim.notify()


def _load_weights(sim: SimState, path: str, body: dict) -> None:
    sim.weights_path = sim.loaded_from = path
    if body.get("weight_version") is not None:
        sim.weight_version = str(body["weight_version"])
    if body.get("flush_cache", True):
        sim.prefix_cache.clear()


def _has_safetensors(path: str) -> bool:
    directory = Path(path)
    return directory.is_dir() and any(directory.glob("*.safetensors"))


async def update_weight_version(request: web.Request) -> web.Response:
    body = await _body(request, (1412, "update_weight_version"), required=("new_version",))
    sim = request.app[SIM_STATE]
    if body.get("abort_all_requests"):
        sim.abort(abort_all=True)
    sim.weight_version = str(body["new_version"])
    return json_response(
        {
            "success": True,
            "message": f"Weight version updated to {sim.weight_version}",
            "new_version": sim.weight_version,
        }
    )


async def _body(
    request: web.Request, route: tuple[int, str], required: tuple[str, ...] = (), allow_empty: bool = False
) -> dict:
    """A JSON object body, refused with FastAPI's validation error like SGLang does, with each field it
    leaves out set to the default of SGLang's request dataclass for the simulated release."""
    raw = await request.read()
    full_route = (*route, f"{request.method} {request.path}")
    version = request.app[SIM_STATE].config.sglang_version
    if not raw.strip() and allow_empty:
        return with_defaults(version, request.path, {})
    try:
        body = decode_json_body(raw)
    except RequestValidationError as error:
        raise RequestValidationError(error.errors, full_route) from None
    body = body if isinstance(body, dict) else {}
    missing = [
        {"type": "missing", "loc": ("body", key), "msg": "Field required", "input": body}
        for key in required
        if key not in body
    ]
    if missing:
        raise RequestValidationError(missing, full_route)
    return with_defaults(version, request.path, body)


def _literal_error(value, route: tuple[int, str, str]) -> RequestValidationError:
    expected = "'abort', 'retract' or 'in_place'"
    return RequestValidationError(
        [
            {
                "type": "literal_error",
                "loc": ("body", "mode"),
                "msg": f"Input should be {expected}",
                "input": value,
                "ctx": {"expected": expected},
            }
        ],
        route,
    )


ROUTES = (
    ("GET", "/health", health),
    ("GET", "/health_generate", health_generate),
    ("GET", "/ping", health),
    ("GET", "/model_info", model_info),
    ("GET", "/get_model_info", model_info),
    ("GET", "/server_info", server_info),
    ("GET", "/get_server_info", server_info),
    ("GET", "/v1/models", models),
    ("GET", "/get_load", get_load),
    ("GET", "/v1/loads", v1_loads),
    ("GET", "/metrics", metrics),
    ("GET", "/get_weight_version", weight_version_gone),
    ("GET", "/weight_version", weight_version_gone),
    ("GET", "/flush_cache", flush_cache),
    ("POST", "/flush_cache", flush_cache),
    ("POST", "/abort_request", abort_request),
    ("POST", "/pause_generation", pause_generation),
    ("POST", "/continue_generation", continue_generation),
    ("POST", "/update_weights_from_disk", update_weights_from_disk),
    ("POST", "/update_weight_version", update_weight_version),
)


# Deprecated routes a release deleted (http_server.py of each wheel; bench/SGLANG_VERSIONS.md lists them): from
# that release on the simulator does not serve them either, and FastAPI's 404 {"detail": "Not Found"} answers.
REMOVED_IN = {"/get_load": "0.5.21", "/get_weight_version": "0.5.21", "/weight_version": "0.5.21"}


def add_admin_routes(app: web.Application) -> None:
    config = app[SIM_STATE].config
    for method, path, handler in ROUTES:
        if path in REMOVED_IN and config.since(REMOVED_IN[path]):
            continue
        app.router.add_route(method, path, handler)
