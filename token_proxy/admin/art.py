"""ART's (OpenPipe) own route on its vLLM runtime: POST /art/set_served_model_name {"name"} renames the served
base model and replies {"name"}. ART posts `{model}@{step}` after each merged-weights sync (openpipe-art
0.5.18: art/unsloth/service.py and art/megatron/service.py `_set_served_model_name`; its dedicated_server.py
sets `base_model_paths[0].name`): /v1/models and `model` then know the new name only, the old one is a 404.
Further --served-model-name aliases keep answering, as vLLM's other base_model_paths do. The route is an
admin row (routes.py), so `/art/*` needs the admin key when one is set.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from token_proxy.errors import InvalidRequest
from token_proxy.http_io import json_response, read_json
from token_proxy.lora.registry import ADAPTERS
from token_proxy.state import CONTEXT

# With --workers N, on the owner: returns once every serving process applied the owner's new name
# (serving/owner_news.py sets it). Absent in one process.
NAME_PUBLISHED = web.AppKey("served_name_published", Callable[[], Awaitable[bool]])


async def set_served_model_name(request: web.Request) -> web.Response:
    name = (await read_json(request)).get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"name must be a non-empty string, got {name!r}", param="name")
    ctx = request.app[CONTEXT]
    registry = request.app.get(ADAPTERS)
    if registry is not None and registry.get(name) is not None:
        raise InvalidRequest(f"The name '{name}' is a loaded LoRA adapter's; unload it first.", param="name")
    ctx.backend  # noqa: B018 (a 503 naming the reason until SGLang is known: there is no base model yet)
    ctx.renamed = name
    if registry is not None:
        registry.base_names = {name}
    published = request.app.get(NAME_PUBLISHED)
    if published is not None:
        await published()
    return json_response({"name": name})
