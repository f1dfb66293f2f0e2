"""LoRA adapters, a feature that hooks into the pipeline: the registry and its leases (registry.py),
the model-resolution hook it registers at start-up (resolve.py), adapter files (files.py), making every
SGLang worker hold the adapters (workers.py), the --workers map sync (sync.py), the lost-adapter retry
(leases.py), both dialects' routes (routes.py) and the adapter series (metrics.py)."""

from token_proxy.faces import door

__all__ = [
    "ADAPTERS",
    "LORA",
    "AdapterRegistry",
    "LoraAdmin",
    "add_lora_admin",
    "register_resolver",
]

__getattr__ = door(__name__, {
    "ADAPTERS": "registry",
    "LORA": "workers",
    "AdapterRegistry": "registry",
    "LoraAdmin": "workers",
    "add_lora_admin": "routes",
    "register_resolver": "resolve",
})
