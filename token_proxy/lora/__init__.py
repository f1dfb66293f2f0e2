"""LoRA adapters: the registry and its leases, adapter files, worker load/reload/sync, routes, metrics."""
