"""LoRA's hook into the pipeline's model step: a requested name that is not the served model is looked
up in the adapter registry and leased (pipeline/run.py's MODEL_RESOLVER, registered at start-up).

Under --workers a serving process's registry is a mirror: a name it does not know yet may have been loaded
through another process a moment ago, so it asks the owner for its map (`on_miss`) and looks once more."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from token_proxy.errors import NotFound
from token_proxy.lora.registry import AdapterRegistry
from token_proxy.pipeline.run import MODEL_RESOLVER, unknown_model
from token_proxy.vocabulary import ModelTarget, Reloads

__all__ = ["AdapterResolver", "register_resolver"]


@dataclass(frozen=True, slots=True)
class AdapterResolver:
    registry: AdapterRegistry
    reloads: Reloads  # loads an adapter again on a worker that lost it (the call's one retry)

    async def __call__(self, requested: str) -> ModelTarget:
        try:
            return self._leased(requested)
        except NotFound:
            if self.registry.on_miss is None:
                raise
        await self.registry.on_miss()
        return self._leased(requested)

    def _leased(self, requested: str) -> ModelTarget:
        lease = self.registry.lease(requested)
        if lease is None:
            raise unknown_model(requested)
        return ModelTarget(requested, lease.lora_path, lease, self.reloads)


def register_resolver(app: web.Application, registry: AdapterRegistry, reloads: Reloads) -> None:
    app[MODEL_RESOLVER] = AdapterResolver(registry, reloads)
