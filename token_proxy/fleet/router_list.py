"""sglang-router's list of workers, changed by the fence (fence.py): a worker out, and back in.

sglang-router 0.3 (sgl-model-gateway): GET /workers lists {"url", "id"} per worker; DELETE /workers/{id}
(its UUID) removes one and POST /workers {"url"} adds one, both answered 202 and applied in the background
(so a change is waited for until the list shows it). Older routers: POST /remove_worker?url= and
POST /add_worker?url=, tried when the new routes are refused or missing.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import quote

import orjson

from token_proxy.errors import ProxyError
from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.fleet_view import router_listing

ROUTER_TIMEOUT_S = 10.0
SETTLE_S = 5.0  # how long a background add or remove may take to show in the list
SETTLE_POLL_S = 0.05


async def listed(router: SGLangClient) -> dict[str, str]:
    """url -> id of each worker the router lists; {} when the backend is no router (SGLang answers 404)."""
    try:
        return await router_listing(router) or {}
    except ProxyError:
        return {}


async def remove(router: SGLangClient, url: str) -> bool | str:
    """`url` out of the router's list: True when removed, False when it was not listed (or there is no
    router), else the router's refusal."""
    ids = await listed(router)
    if url not in ids:
        return False
    status, raw = await _call(router, "DELETE", f"/workers/{ids[url]}")
    if status in (400, 404, 405):  # before sglang-router 0.3
        status, raw = await _call(router, "POST", f"/remove_worker?url={quote(url, safe='')}")
    if status >= 300:
        return f"sglang-router did not remove {url} ({status}): {raw[:200].decode('utf-8', 'replace')}"
    await _settle(router, url, present=False)
    return True


async def add(router: SGLangClient, url: str) -> str | None:
    """`url` back in the router's list (None), or the router's refusal."""
    if url in await listed(router):
        return None
    status, raw = await _call(router, "POST", "/workers", {"url": url})
    if status in (404, 405):
        status, raw = await _call(router, "POST", f"/add_worker?url={quote(url, safe='')}")
    if status >= 300:
        return f"sglang-router did not add {url} back ({status}): {raw[:200].decode('utf-8', 'replace')}"
    await _settle(router, url, present=True)
    return None


async def _call(router: SGLangClient, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    raw = orjson.dumps(body) if body is not None else None
    try:
        status, data, _ = await router.call(method, path, raw, ROUTER_TIMEOUT_S)
    except ProxyError as exc:
        return exc.status, exc.message.encode()
    return status, data


async def _settle(router: SGLangClient, url: str, present: bool) -> None:
    deadline = time.monotonic() + SETTLE_S
    while ((url in await listed(router)) != present) and time.monotonic() < deadline:
        await asyncio.sleep(SETTLE_POLL_S)
