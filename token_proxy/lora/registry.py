"""The LoRA adapters the proxy serves: public name -> the adapter SGLang holds under an internal name.

Reloading a name in place never lets a request sample a half-loaded adapter: every load goes to SGLang
under a fresh internal name (`policy@v2`), the public name switches to it in one assignment once every
worker holds it, and requests that resolved the old one hold a lease on it and finish on it. The old
one is unloaded (by whoever listens to `on_idle`) when its last lease ends. Pure state, no HTTP.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.errors import NotFound


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str  # what clients send as `model`
    path: str  # what it was loaded from (vLLM's `root`)
    internal: str  # SGLang's lora_name, sent as lora_path on /generate
    version: int  # 1 for the first load of this name, +1 per reload
    loaded_at: float = field(default_factory=time.time)
    # vLLM's lora_int_id: one per name while it is served, kept by a reload in place (SkyRL's reply carries it)
    int_id: int = 0


def internal_name(name: str, version: int) -> str:
    return f"{name}@v{version}"


class Lease:
    """One request's hold on an adapter: it stays loaded on SGLang until released."""

    __slots__ = ("_registry", "_released", "adapter")

    def __init__(self, adapter: Adapter, registry: AdapterRegistry):
        self.adapter, self._registry, self._released = adapter, registry, False

    @property
    def lora_path(self) -> str:
        return self.adapter.internal

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self.adapter)

    def __enter__(self) -> Lease:  # noqa: PYI034 (Self needs Python 3.11; 3.10 is supported)
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class AdapterRegistry:
    base_names: set[str] = field(default_factory=set)  # the served model name(s): never adapters
    on_idle: Callable[[Adapter], None] | None = None  # a retired adapter's last lease ended
    on_change: Callable[[], None] | None = None  # the served set changed (lora/sync.py)
    # A worker's mirror: an unknown name may have been loaded through another worker a moment ago; this
    # asks the owner for its map before the name is refused (lora/sync.py).
    on_miss: Callable[[], Awaitable[None]] | None = None
    _current: dict[str, Adapter] = field(default_factory=dict)
    _retired: dict[str, Adapter] = field(default_factory=dict)  # internal -> replaced, still leased
    _leases: Counter = field(default_factory=Counter)  # internal -> requests holding it
    # name -> loads so far; one int per name ever loaded, kept after an unload on purpose: a name loaded
    # again must not reuse an internal name (name@vN) that a worker may still hold.
    _versions: Counter = field(default_factory=Counter)
    _int_ids: int = 0  # the last lora_int_id given (vLLM's lora_id_counter: every new name takes the next)

    def next_version(self, name: str) -> tuple[int, str]:
        self._versions[name] += 1
        version = self._versions[name]
        return version, internal_name(name, version)

    def int_id(self, name: str) -> int:
        """vLLM's lora_int_id for a load of `name`: the served adapter's own on a reload, else the next one."""
        current = self._current.get(name)
        if current is not None and current.int_id:
            return current.int_id
        self._int_ids += 1
        return self._int_ids

    def get(self, name: str) -> Adapter | None:
        return self._current.get(name)

    def adapters(self) -> list[Adapter]:
        return list(self._current.values())

    def held(self) -> list[Adapter]:
        """Every adapter the workers must hold: the current ones and retired ones still in use."""
        return [*self._current.values(), *self._retired.values()]

    def is_base(self, model: str | None) -> bool:
        return not model or model in self.base_names

    def resolve(self, model: str | None) -> str | None:
        """SGLang's lora_path for `model`: None for the base model; vLLM's 404 for an unknown name."""
        if self.is_base(model):
            return None
        adapter = self._current.get(model)
        if adapter is None:
            raise NotFound(f"The model `{model}` does not exist.", param="model")
        return adapter.internal

    def lease(self, model: str | None) -> Lease | None:
        """resolve(), holding the adapter until the lease is released (use it around the SGLang call)."""
        if self.resolve(model) is None:
            return None
        adapter = self._current[model]
        self._leases[adapter.internal] += 1
        return Lease(adapter, self)

    def hold(self, adapter: Adapter) -> Lease:
        """A lease on this exact adapter version (another process's hold on it: lora/sync.py)."""
        self._leases[adapter.internal] += 1
        return Lease(adapter, self)

    def in_use(self, adapter: Adapter) -> int:
        return self._leases[adapter.internal]

    def switch(self, adapter: Adapter) -> Adapter | None:
        """Serve `adapter` under its name from now on; the one it replaces is retired (returned)."""
        old = self._current.get(adapter.name)
        self._current[adapter.name] = adapter
        retired = self._retire(old) if old is not None else None
        self._changed()
        return retired

    def remove(self, name: str) -> Adapter:
        """Stop serving `name` (vLLM's 404 wording when it is not loaded); the adapter is retired."""
        adapter = self._current.pop(name, None)
        if adapter is None:
            raise NotFound(f"The lora adapter '{name}' cannot be found.")
        retired = self._retire(adapter)
        self._changed()
        return retired

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _retire(self, adapter: Adapter) -> Adapter:
        if self._leases[adapter.internal]:
            self._retired[adapter.internal] = adapter
        return adapter

    def _release(self, adapter: Adapter) -> None:
        self._leases[adapter.internal] -= 1
        if self._leases[adapter.internal] > 0:
            return
        del self._leases[adapter.internal]
        if self._retired.pop(adapter.internal, None) is not None and self.on_idle is not None:
            self.on_idle(adapter)


ADAPTERS: web.AppKey[AdapterRegistry] = web.AppKey("lora_adapters", AdapterRegistry)
