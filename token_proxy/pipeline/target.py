"""Step 2 of the pipeline: which model serves the request: the base model, or a loaded LoRA adapter."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from token_proxy.errors import NotFound
from token_proxy.lora.registry import ADAPTERS, Lease
from token_proxy.state import ProxyContext


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """The model a request runs on: `name` is what responses report; `lora_path` (when set) goes to
    SGLang as /generate's `lora_path`, selecting a loaded adapter. An adapter request holds a `lease`
    on the adapter version it resolved, so an in-place reload never unloads it under the request."""

    name: str
    lora_path: str | None = None
    lease: Lease | None = None

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


async def resolve_target(app: web.Application, ctx: ProxyContext, requested: str | None) -> ModelTarget:
    """resolve_model; under --workers, a name this worker's adapter mirror does not know yet is looked
    up once more after asking the admin owner for its map (a load through another worker just now)."""
    try:
        return resolve_model(app, ctx, requested)
    except NotFound:
        registry = app.get(ADAPTERS)
        if registry is None or registry.on_miss is None:
            raise
        await registry.on_miss()
        return resolve_model(app, ctx, requested)


def resolve_model(app: web.Application, ctx: ProxyContext, requested: str | None) -> ModelTarget:
    """The request's `model` -> its target. Absent means the served model; otherwise a loaded adapter's
    name, or vLLM's 404 "The model `x` does not exist."."""
    served = ctx.backend.served_model_name
    if requested is None or requested == served:
        return ModelTarget(served)
    registry = app.get(ADAPTERS)
    lease = registry.lease(requested) if registry is not None else None
    if lease is None:
        raise NotFound(f"The model `{requested}` does not exist.", param="model")
    return ModelTarget(requested, lease.lora_path, lease)
