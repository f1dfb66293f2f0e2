"""LoRA adapters on every SGLang worker: load (all or nothing), in-place reload, unload once unused,
and re-load on workers that restarted or joined (a sync pass comparing each worker's /v1/models).

The registry (lora_registry.py) decides what is served; this module makes the workers hold it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.errors import InvalidRequest, ProxyError
from token_proxy.lora import files as lora_files
from token_proxy.lora.registry import Adapter, AdapterRegistry
from token_proxy.sglang.workers import WorkerReply, Workers, server_infos

log = logging.getLogger(__name__)

SHORT_TIMEOUT_S = 10.0
# SGLang's words for "no such adapter files on this worker" (a Hub lookup when the path is no directory).
_MISSING_FILES = ("No such file or directory", "Repo id must be", "Repository Not Found", "is not a directory",
                  "cached snapshot")  # the last: HF_HUB_OFFLINE with a hub-id-like path
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}


class AdapterCallFailed(ProxyError):
    """A load or unload failed on some workers; the message names each with SGLang's words.
    Status as vLLM's: 400 a refusal, 404 files missing there, 500 a worker failed or was unreachable
    (prime-rl retries 404 and 500, not 503); 503 with Retry-After when every failed worker answered SGLang's
    503 (restarting or starting)."""

    def __init__(self, status: int, message: str):
        super().__init__(message, param="lora_path" if status in (400, 404) else None)
        self.status = status
        self.type = _TYPES.get(status, "InternalServerError")

    def headers(self) -> dict | None:
        return {"Retry-After": "1"} if self.status == 503 else None


def _reply_status(reply: WorkerReply) -> int:
    if reply.error is None and reply.status == 503:
        return 503  # SGLang answers 503 while it restarts or starts (its /health too): retrying helps
    if reply.error is not None or reply.status >= 500:
        return 500
    return 404 if any(words in reply.message for words in _MISSING_FILES) else 400


def raise_for_workers(action: str, replies: list[WorkerReply]) -> None:
    failed = [r for r in replies if not r.ok]
    if not failed:
        return
    statuses = [_reply_status(r) for r in failed]
    status = 400 if 400 in statuses else 404 if 404 in statuses else 503 if set(statuses) == {503} else 500
    details = "; ".join(f"{r.url}: {r.status or 'unreachable'} {r.message}" for r in failed)
    raise AdapterCallFailed(status, f"{action} failed on {len(failed)} of {len(replies)} worker(s): {details}")


@dataclass
class LoraAdmin:
    plane: Workers  # the admin plane's fan-out
    registry: AdapterRegistry
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Internal names unloaded (or to unload) from every worker; a sync pass removes leftovers.
    garbage: set[str] = field(default_factory=set)
    _resync: asyncio.Future | None = field(default=None, repr=False)  # the pass lost-adapter retries share

    @property
    def timeout_s(self) -> float:
        return self.plane.settings.weight_update_timeout_s

    async def load(self, name: str, path, inplace: bool) -> Adapter:
        """Load `path` as `name` on every worker, then serve it; the adapter it replaces is unloaded
        once no request uses it. A failure anywhere leaves every worker and the mapping as they were."""
        name = _checked_name(name, self.registry)
        path = lora_files.checked_path(name, path, self.plane.settings)
        async with self.lock:
            if self.registry.get(name) is not None and not inplace:
                raise InvalidRequest(f"The lora adapter '{name}' has already been loaded. If you want to load "
                                     "the adapter in place, set 'load_inplace' to True.", param="lora_name")
            urls = await self.plane.worker_urls()
            await self._check_limits(name, path, urls)
            version, internal = self.registry.next_version(name)
            await self._load_everywhere(internal, path, urls)
            adapter = Adapter(name=name, path=path, internal=internal, version=version,
                              int_id=self.registry.int_id(name))
            old = self.registry.switch(adapter)
        log.info("LoRA %s v%d served from %s (%s)", name, version, path, internal)
        if old is not None and not self.registry.in_use(old):
            self.retire_later(old)  # not awaited: SGLang's unload waits for requests sent around the proxy
        return adapter

    async def unload(self, name: str) -> Adapter:
        """Stop serving `name` at once; SGLang unloads it when its last request has finished."""
        async with self.lock:
            adapter = self.registry.remove(_checked_name(name, self.registry, "lora_name"))
        if not self.registry.in_use(adapter):
            self.retire_later(adapter)
        return adapter

    async def retire(self, adapter: Adapter) -> None:
        """Unload a replaced or removed adapter from every worker (it serves no request any more)."""
        self.garbage.add(adapter.internal)
        replies = await self.plane.fan_out("POST", "/unload_lora_adapter", {"lora_name": adapter.internal},
                                           self.plane.settings.admin_timeout_s)
        unloaded = [r for r in replies if r.ok or "does not exist" in r.message]
        if len(unloaded) == len(replies):
            self.garbage.discard(adapter.internal)
        else:
            log.warning("LoRA %s: unload left on %s (the sync pass retries)", adapter.internal,
                        ", ".join(r.url for r in replies if r not in unloaded))

    def retire_later(self, adapter: Adapter) -> None:
        """In the background (also the registry's on_idle: the last request on a retired adapter ended);
        with nothing to spawn it on, the next sync pass unloads it."""
        if self.plane.spawn is not None:
            self.plane.spawn(self.retire(adapter))
        else:
            self.garbage.add(adapter.internal)

    async def _load_everywhere(self, internal: str, path: str, urls: list[str]) -> None:
        body = {"lora_name": internal, "lora_path": path}
        replies = await self.plane.fan_out("POST", "/load_lora_adapter", body, self.timeout_s, urls)
        stale = [r.url for r in replies if not r.ok and "already loaded" in r.message]
        if stale:  # left by an earlier proxy run under the same internal name
            await self.plane.fan_out("POST", "/unload_lora_adapter", {"lora_name": internal}, self.timeout_s, stale)
            again = iter(await self.plane.fan_out("POST", "/load_lora_adapter", body, self.timeout_s, stale))
            replies = [next(again) if r.url in stale else r for r in replies]
        if not all(r.ok for r in replies):
            loaded = [r.url for r in replies if r.ok]
            if loaded:  # all or nothing: take it back where it did load
                await self.plane.fan_out("POST", "/unload_lora_adapter", {"lora_name": internal},
                                         self.timeout_s, loaded)
            raise_for_workers(f"load_lora_adapter {internal.rsplit('@', 1)[0]}", replies)

    async def _check_limits(self, name: str, path: str, urls: list[str]) -> None:
        """Rank and target modules against what each worker was started with, when both are known."""
        if not (self.plane.settings.check_local_paths and lora_files.check.looks_local(path)):
            return
        config = lora_files.read_config(name, path)
        for url, info in zip(urls, await server_infos(self.plane, urls, strict=False)):  # the load names one down
            lora_files.check_fits(name, config, lora_files.limits_of(info), url)

    async def sync_workers(self) -> int:
        """Load what each worker lacks (it restarted, or joined), unload leftovers; returns loads made."""
        if not self.registry.held() and not self.garbage:
            return 0
        made, examined, left = 0, set(self.garbage), set()
        async with self.lock:  # no load switches versions meanwhile
            for url in await self.plane.worker_urls():
                listed = await self._listed(url)
                if listed is None:  # down: the next pass sees it again
                    left |= examined
                    continue
                made += await self._sync_one(url, listed)
                left |= await self._unload_leftovers(url, examined & listed)
        self.garbage -= examined - left  # gone from every worker
        return made

    async def resync(self) -> int:
        """One sync pass shared by every caller that asks while it runs: N requests refused for a lost
        adapter wait on one pass, not N."""
        if self._resync is None or self._resync.done():
            self._resync = asyncio.ensure_future(self.sync_workers())
        return await asyncio.shield(self._resync)

    async def _sync_one(self, url: str, listed: set[str]) -> int:
        made = 0
        for adapter in self.registry.held():
            if adapter.internal not in listed and adapter in self.registry.held():  # not retired meanwhile
                made += await self._reload_on(url, adapter)
        return made

    async def _unload_leftovers(self, url: str, leftovers: set[str]) -> set[str]:
        """Unload retired adapters a worker still lists; returns those it still holds."""
        left = set()
        for internal in leftovers:
            [reply] = await self.plane.fan_out("POST", "/unload_lora_adapter", {"lora_name": internal},
                                               self.plane.settings.admin_timeout_s, [url])
            if not (reply.ok or "does not exist" in reply.message):
                left.add(internal)
        return left

    async def _listed(self, url: str) -> set[str] | None:
        [reply] = await self.plane.fan_out("GET", "/v1/models", None, SHORT_TIMEOUT_S, [url])
        body = reply.body if reply.ok else None
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            return None
        return {card.get("id") for card in body["data"] if isinstance(card, dict)}

    async def _reload_on(self, url: str, adapter: Adapter) -> int:
        body = {"lora_name": adapter.internal, "lora_path": adapter.path}
        [reply] = await self.plane.fan_out("POST", "/load_lora_adapter", body, self.timeout_s, [url])
        if reply.ok:
            log.info("LoRA %s re-loaded on %s (it had lost it)", adapter.internal, url)
            return 1
        log.error("LoRA %s could not be re-loaded on %s: %s", adapter.internal, url, reply.message)
        return 0

    async def sync_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sync_workers()
            except ProxyError as exc:
                log.warning("LoRA sync pass failed: %s", exc.message)
            except Exception:  # a bug must not end background sync for the proxy's lifetime
                log.exception("LoRA sync pass failed; the next runs in %g s", interval_s)

    async def load_modules(self, modules) -> None:
        """vLLM's --lora-modules: (name, path) pairs loaded once SGLang is up."""
        for name, path in modules:
            try:
                await self.load(name, path, inplace=True)
            except ProxyError as exc:
                log.error("--lora-modules %s=%s was not loaded: %s", name, path, exc.message)


def _checked_name(name, registry: AdapterRegistry, param: str = "lora_name") -> str:
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{param} must be a non-empty string, got {name!r}", param=param)
    if name in registry.base_names:
        raise InvalidRequest(f"The lora adapter '{name}' conflicts with a served base model.", param=param)
    return name


LORA: web.AppKey[LoraAdmin] = web.AppKey("lora_admin", LoraAdmin)
