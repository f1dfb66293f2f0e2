"""LoRA routes in both dialects, one registry behind them.

vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (plain-text success, vLLM's errors), and
/load_lora_adapter + /unload_lora_adapter, which prime-rl (its wrapper forces load_inplace) and SGLang
clients call: replies carry prime-rl's {"status": "ok"} and SGLang's success / loaded_adapters; and SkyRL's
/skyrl/v1/load_lora_adapter (its vLLM server's own route: a load or reload in place that keeps the name's
lora_int_id).
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from token_proxy.errors import InvalidRequest
from token_proxy.http_io import json_response, read_json
from token_proxy.lora.metrics import AdapterCollector
from token_proxy.lora.registry import ADAPTERS, AdapterRegistry
from token_proxy.lora.resolve import register_resolver
from token_proxy.lora.sync import MAP_PUBLISHED
from token_proxy.lora.workers import LORA, LoraAdmin
from token_proxy.sglang.workers import WORKERS
from token_proxy.state import CONTEXT, REGISTER_COLLECTOR


async def _load_request(request: web.Request) -> tuple[str, str, dict]:
    body = await read_json(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.",
                             param="lora_path" if name else "lora_name")
    return name, path, body


async def load_v1(request: web.Request) -> web.Response:
    name, path, body = await _load_request(request)
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise InvalidRequest(f"load_inplace must be a boolean, got {inplace!r}", param="load_inplace")
    await request.app[LORA].load(name, path, inplace)
    await visible_everywhere(request.app)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def load_in_place(request: web.Request) -> web.Response:
    """prime-rl reloads one name with a new step's weights every step (its server forces load_inplace)."""
    name, path, _ = await _load_request(request)
    await request.app[LORA].load(name, path, inplace=True)
    await visible_everywhere(request.app)
    return json_response({"status": "ok", "success": True, "error_message": None,
                          "loaded_adapters": loaded(request.app[ADAPTERS])})


async def load_skyrl(request: web.Request) -> web.Response:
    """SkyRL 0.3.0's POST /skyrl/v1/load_lora_adapter (RemoteInferenceClient.load_lora_adapter, posted to every
    server; vllm_server_actor.py serves it): load, or reload in place keeping the name's lora_int_id."""
    name, path, _ = await _load_request(request)
    adapter = await request.app[LORA].load(name, path, inplace=True)
    await visible_everywhere(request.app)
    return json_response({"status": "ok", "lora_name": adapter.name, "lora_int_id": adapter.int_id})


async def unload_v1(request: web.Request) -> web.Response:
    name = await _unload_name(request)
    await request.app[LORA].unload(name)
    await visible_everywhere(request.app)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def unload_sglang(request: web.Request) -> web.Response:
    await request.app[LORA].unload(await _unload_name(request))
    await visible_everywhere(request.app)
    return json_response({"success": True, "error_message": "", "loaded_adapters": loaded(request.app[ADAPTERS])})


async def _unload_name(request: web.Request) -> str:
    name = (await read_json(request)).get("lora_name")
    if not name:
        raise InvalidRequest("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
    return name


async def visible_everywhere(app: web.Application) -> None:
    """With --workers N, answer a load or unload only once every serving process applied it (lora/sync.py)."""
    published = app.get(MAP_PUBLISHED)
    if published is not None:
        await published()


def loaded(registry: AdapterRegistry) -> dict[str, str]:
    return {adapter.name: adapter.path for adapter in registry.adapters()}


def adapter_cards(registry: AdapterRegistry, base_name: str, max_model_len: int | None, created: int) -> list[dict]:
    """vLLM's /v1/models cards for the adapters (id = name, root = path, parent = base). vLLM leaves an
    adapter's max_model_len null; the proxy gives the base's, which renderers' client reads by id."""
    return [{"id": a.name, "object": "model", "created": created, "owned_by": "sglang-token-proxy",
             "root": a.path, "parent": base_name, "max_model_len": max_model_len, "permission": []}
            for a in registry.adapters()]


def add_lora_admin(app: web.Application) -> None:
    """After the admin plane's cleanup context (the LoRA admin uses it). The routes are rows of
    token_proxy/routes.py (vLLM's /v1/... and SGLang's dialect)."""
    app.cleanup_ctx.append(_lora_admin)


async def _lora_admin(app: web.Application):
    ctx = app[CONTEXT]
    registry = app[ADAPTERS] = AdapterRegistry()
    admin = app[LORA] = LoraAdmin(plane=app[WORKERS], registry=registry)
    register_resolver(app, registry, admin)
    registry.on_idle = admin.retire_later
    if REGISTER_COLLECTOR in app:
        app[REGISTER_COLLECTOR](AdapterCollector(registry))
    modules = ctx.settings.lora_modules

    def learn(backend) -> None:  # the base name is no adapter name; --lora-modules load once SGLang is up
        registry.base_names = {ctx.renamed or backend.served_model_name}
        if modules:
            ctx.spawn(admin.load_modules(modules))

    ctx.when_ready(learn)
    interval = ctx.settings.lora_sync_interval_s
    sync = asyncio.get_running_loop().create_task(admin.sync_forever(interval)) if interval > 0 else None
    yield
    if sync is not None:
        sync.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sync
