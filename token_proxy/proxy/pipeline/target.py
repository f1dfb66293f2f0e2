"""Step 2 of the pipeline: which model serves the request (the base model, or later a LoRA adapter)."""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.errors import NotFound
from token_proxy.proxy.upstream.context import ProxyContext


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """The model a request runs on: `name` is what responses report; `lora_path` (when set) goes to
    SGLang as /generate's `lora_path`, selecting a loaded adapter."""

    name: str
    lora_path: str | None = None


def resolve_model(ctx: ProxyContext, requested: str | None) -> ModelTarget:
    """The request's `model` -> its target. Absent means the served model.

    The LoRA hook: an adapter registry answers here, e.g.
    `if (adapter := registry.get(requested)) is not None: return ModelTarget(requested, adapter.path)`.
    """
    served = ctx.backend.served_model_name
    if requested is not None and requested != served:
        raise NotFound(f"The model `{requested}` does not exist.", param="model")
    return ModelTarget(served)
