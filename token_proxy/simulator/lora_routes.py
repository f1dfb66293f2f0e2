"""SGLang's /load_lora_adapter and /unload_lora_adapter: LoRAUpdateOutput, 200 or 400."""

from __future__ import annotations

from aiohttp import web

from token_proxy.simulator.admin_routes import _body
from token_proxy.simulator.errors import json_response
from token_proxy.simulator.lora import NOT_ENABLED, pool_of
from token_proxy.simulator.state import SIM_STATE, SimState


def _reply(error: str | None, loaded: dict[str, str] | None) -> web.Response:
    body = {"success": error is None, "error_message": error or "", "loaded_adapters": loaded}
    return json_response(body, 400 if error else 200)


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request, (1521, "load_lora_adapter"), required=("lora_name", "lora_path"))
    sim = request.app[SIM_STATE]
    if not sim.config.enable_lora:
        return _reply(NOT_ENABLED, None)
    error = sim.lora.load(body["lora_name"], str(body["lora_path"]), pool_of(sim.config))
    return _reply(error, dict(sim.lora.loaded))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Unregistered at once (new requests refused), unloaded once its running requests finish."""
    body = await _body(request, (1544, "unload_lora_adapter"), required=("lora_name",))
    sim, name = request.app[SIM_STATE], body["lora_name"]
    if not sim.config.enable_lora:
        return _reply(NOT_ENABLED, None)
    error = sim.lora.unregister(name)
    if error:
        return _reply(error, None)
    while _in_use(sim, name):
        await sim.changed()
    return _reply(None, dict(sim.lora.loaded))


def _in_use(sim: SimState, name: str) -> bool:
    return any(s.spec.lora is not None and s.spec.lora[0] == name for s in sim.running.values())


def add_lora_routes(app: web.Application) -> None:
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
