"""prime-rl's orchestrator admin fan-out, as the per-node layout's trainer runs it (issue 37 item 4).

prime-rl (github.com/PrimeIntellect-ai/prime-rl, src/prime_rl/utils/client.py at 005c286c) cannot be imported
offline (it needs verifiers, vLLM and its own configs), so this follows that file's protocol call for call,
written anew (its code is not copied):
- one admin client per server base URL (`/v1` stripped), all calls fanned out with asyncio.gather;
- `_admin_post`: raise for any status >= 400; 5xx and transport errors are retried with exponential
  backoff (at most 10 attempts, within twice the per-call timeout); 4xx is not retried;
- `update_weights(weight_dir)`: POST /pause?mode=keep&clear_cache=false on every server, then (after
  touching weight_dir/NCCL_READY when weight_dir is set) POST /update_weights {"weight_dir"} on every
  server, and in a `finally`, POST /resume on every server;
- `init_nccl_broadcast(host, port, timeout, inference_world_size)`: server i gets POST /init_broadcaster
  {"host", "port", "rank_offset": i * (inference_world_size // servers), "inference_world_size",
  "timeout", "quantize_in_weight_transfer": false}, one plain POST each; an error status is swallowed (a
  404 with a warning), as upstream does.
The backoff's base is a parameter (prime-rl: 1 s doubling to 10 s) so that tests stay short.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

NCCL_READY_MARKER = "NCCL_READY"
ADMIN_TIMEOUT_S = 300.0
UPDATE_WEIGHTS_TIMEOUT_S = 720.0


class AdminCallFailed(Exception):
    """What httpx's raise_for_status gives prime-rl: the status, the URL, and the body."""

    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{status} from {url}: {body[:300]}")
        self.url, self.status, self.body = url, status, body


class PrimeRLAdmin:
    def __init__(self, session: aiohttp.ClientSession, base_urls: list[str], backoff_s: float = 1.0,
                 attempts: int = 10):
        self.session, self.backoff_s, self.attempts = session, backoff_s, attempts
        self.urls = [url.rstrip("/").removesuffix("/v1") for url in base_urls]

    async def _admin_post(self, url: str, path: str, timeout_s: float = ADMIN_TIMEOUT_S, **kwargs) -> None:
        deadline, wait = time.monotonic() + 2 * timeout_s, self.backoff_s
        for attempt in range(1, self.attempts + 1):
            try:
                async with self.session.post(url + path, timeout=aiohttp.ClientTimeout(
                        sock_connect=10.0, sock_read=timeout_s), **kwargs) as response:
                    if response.status < 400:
                        return
                    failure = AdminCallFailed(url + path, response.status, await response.text())
                if failure.status < 500:
                    raise failure
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                failure = exc
            if attempt == self.attempts or time.monotonic() + wait > deadline:
                raise failure
            await asyncio.sleep(wait)
            wait = min(wait * 2, 10 * self.backoff_s)

    async def pause_engines(self) -> None:
        await asyncio.gather(*(self._admin_post(url, "/pause", params={"mode": "keep", "clear_cache": "false"})
                               for url in self.urls))

    async def resume_engines(self) -> None:
        await asyncio.gather(*(self._admin_post(url, "/resume") for url in self.urls))

    async def update_weights(self, weight_dir: Path | None) -> None:
        await self.pause_engines()
        try:
            if weight_dir is not None:
                (weight_dir / NCCL_READY_MARKER).parent.mkdir(parents=True, exist_ok=True)
                (weight_dir / NCCL_READY_MARKER).touch()
            body = {"weight_dir": weight_dir.as_posix() if weight_dir is not None else None}
            await asyncio.gather(*(self._admin_post(url, "/update_weights", UPDATE_WEIGHTS_TIMEOUT_S, json=body)
                                   for url in self.urls))
        finally:
            await self.resume_engines()

    async def init_nccl_broadcast(self, host: str, port: int, timeout: int, inference_world_size: int,
                                  extra: dict | None = None) -> list[int]:
        """Returns each server's status (upstream returns nothing; the tests read them). `extra`: fields added to
        the body, the one departure from upstream (a CPU test's {"backend": "gloo"}: upstream names no backend,
        so the proxy asks SGLang for its default, nccl)."""
        per_server = inference_world_size // len(self.urls)

        async def init(url: str, rank_offset: int) -> int:
            """One plain POST (no retry); an error status is swallowed, as upstream's `except
            HTTPStatusError` does (only a 404 is logged): the trainer's join timing out is what shows it."""
            async with self.session.post(url + "/init_broadcaster", json={
                    "host": host, "port": port, "rank_offset": rank_offset,
                    "inference_world_size": inference_world_size, "timeout": timeout,
                    "quantize_in_weight_transfer": False, **(extra or {})}) as response:
                return response.status

        return await asyncio.gather(*(init(url, i * per_server) for i, url in enumerate(self.urls)))
