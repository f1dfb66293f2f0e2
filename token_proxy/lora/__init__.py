"""LoRA adapters, a feature that hooks into the pipeline: the registry and its leases (registry.py),
the model-resolution hook it registers at start-up (resolve.py), adapter files (files.py), making every
SGLang worker hold the adapters (workers.py; its `resync` is what the client's one retry point calls for a
lost adapter), the --workers map sync (sync.py), both dialects' routes (routes.py) and the adapter series
(metrics.py)."""

from token_proxy.lora.registry import ADAPTERS, AdapterRegistry
from token_proxy.lora.resolve import register_resolver
from token_proxy.lora.routes import add_lora_admin
from token_proxy.lora.workers import LORA, LoraAdmin

__all__ = [
    "ADAPTERS",
    "LORA",
    "AdapterRegistry",
    "LoraAdmin",
    "add_lora_admin",
    "register_resolver",
]
