"""Routes SGLang deleted whose clients still call them, answered in their SGLang 0.5.17 shape.

SGLang 0.5.21 deleted four deprecated routes (bench/SGLANG_VERSIONS.md, read from the wheels). On a release
that still has a route the proxy passes the call through unchanged; on one that deleted it
(`SGLangFeatures.removed_routes`) it answers from what that release offers:

| route (0.5.17) | answered from | shape (0.5.17 http_server.py) |
|---|---|---|
| GET /get_load (TorchRL 0.14.1 polls it while pausing for a weight sync) | GET /v1/loads?include=core | `[{dp_rank, num_reqs, num_waiting_reqs, num_tokens, num_pending_tokens, ts_tic}]` per dp rank |
| GET, POST /clear_hicache_storage_backend | POST /hicache/storage-backend/clear | its text, 200 or 400 as the new route's status |
| GET /get_weight_version, GET /weight_version | nothing: 0.5.17 already answered a 404 naming /model_info | that 404 |
"""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from token_proxy.admin.forward import passthrough
from token_proxy.errors import BackendUnavailable
from token_proxy.http_io import json_response
from token_proxy.state import CONTEXT

LOADS_PATH = "/v1/loads?include=core"
READ_TIMEOUT_S = 10.0
HICACHE_CLEAR = "/hicache/storage-backend/clear"
HICACHE_CLEARED = ("Deprecated endpoint. Use POST /hicache/storage-backend/clear.\n"
                   "Hierarchical cache storage backend cleared.\n")
WEIGHT_VERSION_GONE = {  # SGLang's HTTPException handler's body (golden-checked in the simulator)
    "object": "error",
    "message": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead.",
    "type": "404", "param": None, "code": 404}


# --- the old shapes (pure) -------------------------------------------------------------------------

def get_load_items(loads: dict, ts_tic: float) -> list[dict]:
    """SGLang 0.5.17's /get_load: its shim projected each /v1/loads core entry thus."""
    items = loads.get("loads") if isinstance(loads, dict) else None
    if not isinstance(items, list):
        raise TypeError(f"/v1/loads answered no `loads` list: {str(loads)[:200]}")
    return [{"dp_rank": core["dp_rank"],
             "num_reqs": core["num_running_reqs"] + core["num_waiting_reqs"],
             "num_waiting_reqs": core["num_waiting_reqs"],
             "num_tokens": core["num_total_tokens"],
             "num_pending_tokens": core["num_total_tokens"] - core["num_used_tokens"],
             "ts_tic": ts_tic} for core in items]


# --- handlers ----------------------------------------------------------------------------------------

def _removed(request: web.Request) -> bool:
    return request.path in request.app[CONTEXT].backend.api.removed_routes


async def get_load(request: web.Request) -> web.StreamResponse:
    if not _removed(request):
        return await passthrough(request)
    status, raw, content_type = await request.app[CONTEXT].client.call("GET", LOADS_PATH, None, READ_TIMEOUT_S)
    if status != 200:
        return _as_is(status, raw, content_type)
    try:
        items = get_load_items(orjson.loads(raw), time.perf_counter())
    except (orjson.JSONDecodeError, ValueError, KeyError, TypeError) as exc:
        raise BackendUnavailable(f"/get_load: SGLang's {LOADS_PATH} cannot stand in for it: {exc}") from None
    return json_response(items)


async def clear_hicache_storage_backend(request: web.Request) -> web.StreamResponse:
    if not _removed(request):
        return await passthrough(request)
    status, raw, content_type = await request.app[CONTEXT].client.call("POST", HICACHE_CLEAR, None, READ_TIMEOUT_S)
    if status not in (200, 400):  # not 0.5.17's two outcomes (e.g. no such route): SGLang's reply as is
        return _as_is(status, raw, content_type)
    response = web.Response(status=status, body=HICACHE_CLEARED.encode())
    response.content_type = ""  # FastAPI's bare Response(content=...): no content type
    return response


async def weight_version(request: web.Request) -> web.StreamResponse:
    if not _removed(request):
        return await passthrough(request)
    return json_response(WEIGHT_VERSION_GONE, status=404)


def _as_is(status: int, raw: bytes, content_type: str) -> web.Response:
    response = web.Response(status=status, body=raw)
    response.content_type = content_type or "application/octet-stream"
    return response
